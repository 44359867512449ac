"""A tiny decoder whose norms cast their input to their own weight's dtype, `norm(x.to(norm.weight.dtype))`, as
transformers' hy_v4 does for `self_attn.indexer.k_norm` (a module it keeps in fp32): found by the zoo sweep
under tp2_bf16.

torch.export traces the cast as `.to(torch.float32)`. Under `precision bf16` the program's weights are bf16
copies, so the norm got an fp32 input with bf16 weight and bias and stopped at step 0 (`mixed dtype (CPU):
expect parameter to have scalar type of Float`). passes/precision.py `norm_operands` gives such a norm's weight
and bias the input's dtype at run time (tests/test_bf16_casts.py). Its MLPs are sharded under
tp by tests/test_bf16_casts.py's NORM_CAST_TP.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, DIM, LAYERS = 64, 8, 32, 2


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(DIM), nn.RMSNorm(DIM)
        self.mlp, self.up = MLP(), MLP()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ln, rms = self.input_layernorm, self.post_attention_layernorm
        h = h + self.up(ln(h.to(ln.weight.dtype)))      # traced: ln(h.to(torch.float32)), weight and bias
        return h + self.mlp(rms(h.to(rms.weight.dtype)))  # the same for an RMSNorm (weight only)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h)
        return h


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()           # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
