"""A small GPT in plain PyTorch, nanoGPT-like, following parc's model-file convention.

Start here: `build_model`, `get_batch` and `loss_fn` at the bottom are what parc
calls (see docs/model-convention.md); `GPT` above them is the model. Module names
are the ones plans refer to: `wte`, `wpe`, `blocks.{i}.attn.qkv`,
`blocks.{i}.attn.proj`, `blocks.{i}.mlp.fc`, `blocks.{i}.mlp.proj`, `ln_f`,
`lm_head`. Other files reuse the model with `from gpt import GPT, GPTConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # byte-level: no tokenizer to ship
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = False  # off by default: a tied lm_head complicates vocab-parallel sharding


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 × (B, T, C)
        # Heads are read off the last dim, so a column-sharded qkv holds whole heads:
        # -1 lets the head count follow the local width.
        hs = C // self.n_head
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        # GPT-2's init; under torch.device("meta") these are no-ops that cost nothing.
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


CONFIG = GPTConfig()
ASSETS = ["data/corpus.txt"]  # copied into compiled/model/ by `parc compile`, so the copy finds its data
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"
_DATA: torch.Tensor | None = None


def _data() -> torch.Tensor:
    # Read once per process; the corpus is tens of KB.
    global _DATA
    if _DATA is None:
        _DATA = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    return _DATA


def build_model() -> nn.Module:
    return GPT(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step`: random byte windows, a pure function of (step, batch_size)."""
    return windows(step, batch_size, CONFIG.block_size)


def windows(step: int, batch_size: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random (T + 1)-byte windows of the corpus drawn by `step`'s seed, shifted by one for the
    targets (examples/cp.py and bench/gpt_long.py draw their longer windows here too)."""
    data = _data()
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - T - 1, (batch_size,), generator=g)  # (B,)
    windows = torch.stack([data[s:s + T + 1] for s in starts.tolist()])  # (B, T+1)
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))  # mean over B·T tokens
