"""A small decoder whose replicated values meet head- and feature-sharded ones in every way a model
can, so each kind of Partial gradient of passes/tp_grads.py is exercised (tests/test_tp_grads.py):

- `q_norm`, `k_norm`: per-head RMSNorm weights (head_dim) on head-sharded q and k (Qwen3, OLMo2 style):
  every use Partial, summed once per step;
- `head_mix`: an nn.Linear (head_dim → head_dim) no rule names, applied to head-sharded v: its weight's
  gradient is a sum over heads, every use Partial;
- `scale`: one parameter used on sharded q (Partial) and on the replicated residual (complete):
  mixed, so an f goes before its sharded use;
- `gate`: a per-token gate (B, T, 1) computed from the replicated input, broadcast onto the column-sharded
  MLP hidden: an activation with a Partial gradient, so an f goes before the multiply;
- `head_ln`: a LayerNorm with weight and bias over head_dim, on the head-sharded attention output:
  both parameters' uses Partial.

Start here: `build_model`. Batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

D, HEADS, HD, LAYERS = 64, 4, 16, 2


class RMSNorm(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = RMSNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(HD), RMSNorm(HD)
        self.head_mix = nn.Linear(HD, HD)
        self.head_ln = nn.LayerNorm(HD)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, HD))
        self.gate = nn.Linear(D, 1)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        h = self.ln(x)
        q = self.q_norm(self.q(h).view(B, T, -1, HD)).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_norm(self.k(h).view(B, T, -1, HD)).transpose(1, 2)
        v = self.head_mix(self.v(h).view(B, T, -1, HD)).transpose(1, 2)
        q = q * self.scale  # the sharded use of `scale`
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = self.head_ln(y).transpose(1, 2).reshape(B, T, -1)  # (B, T, D)
        x = x + self.o(y) + x[..., :HD].sum(-1, keepdim=True) * self.scale.mean()  # its replicated use
        g = torch.sigmoid(self.gate(x))  # (B, T, 1): replicated, broadcast onto the sharded hidden
        return x + self.down(F.gelu(self.up(x)) * g)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return _Out(self.lm_head(self.norm(x)))


class _Out:
    def __init__(self, logits):
        self.logits = logits


def build_model() -> nn.Module:
    return Model()
