"""A small mixture-of-experts GPT in plain PyTorch, following parc's model-file convention.

Start here: `build_model`, `get_batch` and `loss_fn` at the bottom are what parc calls
(docs/model-convention.md); `MoE` is the layer parc's expert-parallel pass rewrites
(docs/moe.md). Every other block's feed-forward is an MoE: a softmax router picks the
top-k experts of each token, each expert takes at most `capacity` tokens (the rest are
dropped: they pass through the residual only), and the experts run in a plain loop, so
the model runs serially as written. Blocks, attention and data come from examples/gpt.py.

The dispatch is GShard's, with static shapes so it traces on the meta device: a one-hot
`dispatch` (N, E, cap) places token n in slot c of expert e; `einsum` gathers the expert
inputs (E, cap, C), and the `combine` weights (N, E, cap) scatter the outputs back.

Which tokens compete for capacity: those of one forward. The capacity and the auxiliary
loss couple the samples of a batch, so `PER_MICRO_BATCH` tells parc's serial reference
to run the model on each micro-batch, as each data-parallel rank does.

Module names: `blocks.{i}.moe.router`, `blocks.{i}.moe.experts.{e}.fc` / `.proj` for odd i.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import MLP, Attention, GPTConfig, get_batch as _gpt_batch  # noqa: E402


@dataclass(frozen=True)
class MoEConfig:
    gpt: GPTConfig = GPTConfig(n_layer=4, n_embd=32, block_size=16)
    num_experts: int = 4        # ≤ n_layer, so parc takes `blocks` (not `experts`) as the layer list
    top_k: int = 2              # 1: Switch; 2: GShard
    capacity_factor: float = 1.25
    aux_weight: float = 0.01    # the load-balancing loss's weight in the total loss


class Expert(nn.Module):
    """One expert: the dense block's feed-forward (fc → gelu → proj)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (cap, C)


def capacity(tokens: int, cfg: MoEConfig) -> int:
    """Slots per expert: ⌈capacity_factor × k × tokens / E⌉ (Switch, GShard)."""
    return max(1, math.ceil(cfg.capacity_factor * cfg.top_k * tokens / cfg.num_experts))


def route(probs: torch.Tensor, k: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dispatch, combine), each (N, E, cap), from router probabilities (N, E).

    Priority: every token's first choice before any token's second (GShard), tokens in order
    within a choice. A token whose place in its expert's queue is ≥ cap is dropped for that
    expert. The kept choices' gates are renormalised to sum to 1 when k > 1."""
    N, E = probs.shape
    gates, experts = probs.topk(k, dim=-1)  # (N, k) each
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    slots = torch.arange(cap, device=probs.device)  # (cap,)
    dispatch = probs.new_zeros(N, E, cap)
    combine = probs.new_zeros(N, E, cap)
    taken = probs.new_zeros(E)  # slots already given, per expert
    for choice in range(k):
        mask = F.one_hot(experts[:, choice], E).to(probs.dtype)  # (N, E)
        place = (torch.cumsum(mask, dim=0) - 1 + taken) * mask  # (N, E) queue position, 0 where not chosen
        keep = mask * (place < cap).to(probs.dtype)  # (N, E)
        one = keep.unsqueeze(-1) * (place.unsqueeze(-1) == slots).to(probs.dtype)  # (N, E, cap)
        dispatch = dispatch + one
        combine = combine + one * gates[:, choice, None, None]
        taken = taken + mask.sum(dim=0)
    return dispatch, combine


def balance_loss(probs: torch.Tensor, k: int) -> torch.Tensor:
    """Switch's load-balancing loss E · Σ_e f_e · P_e: f_e the fraction of tokens whose first
    choice is e, P_e the mean router probability of e. 1 when balanced."""
    E = probs.shape[-1]
    first = F.one_hot(probs.argmax(dim=-1), E).to(probs.dtype)  # (N, E)
    return E * (first.mean(dim=0) * probs.mean(dim=0)).sum()


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.gpt.n_embd, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.gpt) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)  # (N, C)
        probs = F.softmax(self.router(tokens), dim=-1)  # (N, E)
        dispatch, combine = route(probs, self.cfg.top_k, capacity(B * T, self.cfg))  # (N, E, cap) each
        expert_in = torch.einsum("nec,nd->ecd", dispatch, tokens)  # (E, cap, C)
        expert_out = torch.stack([expert(expert_in[e]) for e, expert in enumerate(self.experts)])  # (E, cap, C)
        y = torch.einsum("nec,ecd->nd", combine, expert_out)  # (N, C); a dropped token gets 0
        return y.reshape(B, T, C), balance_loss(probs, self.cfg.top_k)


class Block(nn.Module):
    """examples/gpt.py's block, with an MoE feed-forward when `moe`. Returns (x, aux loss)."""

    def __init__(self, cfg: MoEConfig, moe: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.gpt.n_embd)
        self.attn = Attention(cfg.gpt)
        self.ln_2 = nn.LayerNorm(cfg.gpt.n_embd)
        if moe:
            self.moe = MoE(cfg)
        else:
            self.mlp = MLP(cfg.gpt)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.ln_1(x))
        if hasattr(self, "moe"):
            y, aux = self.moe(self.ln_2(x))
            return x + y, aux
        return x + self.mlp(self.ln_2(x)), None


class MoEGPT(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        g = cfg.gpt
        self.wte = nn.Embedding(g.vocab_size, g.n_embd)
        self.wpe = nn.Embedding(g.block_size, g.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, moe=i % 2 == 1) for i in range(g.n_layer))
        self.ln_f = nn.LayerNorm(g.n_embd)
        self.lm_head = nn.Linear(g.n_embd, g.vocab_size, bias=False)
        for m in self.modules():  # GPT-2's init, as examples/gpt.py
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, a = block(x)
            if a is not None:
                aux = aux + a
        return self.lm_head(self.ln_f(x)), aux  # (B, T, vocab), ()


CONFIG = MoEConfig()
ASSETS = ["data/corpus.txt", "gpt.py"]  # the copy in compiled/model/ imports gpt beside it
PER_MICRO_BATCH = True  # capacity and the aux loss couple a forward's samples (docs/model-convention.md)


def build_model() -> nn.Module:
    return MoEGPT(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets = _gpt_batch(step, batch_size)  # (B, gpt block_size)
    T = CONFIG.gpt.block_size
    return idx[:, :T].contiguous(), targets[:, :T].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits, aux = model(idx)  # (B, T, vocab), ()
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return ce + CONFIG.aux_weight * aux
