"""A small decoder written with the ops current model code uses on head-sharded values, so each op rule
of passes/tp_layouts.py and passes/tp_contract.py is trained under tensor parallelism (tests/test_tp_ops.py):

- `type_as`: q and k normed in float32 and cast back, as Gemma 3 and Llama write their norms;
- `view_as`: k's projection viewed as q's;
- `view_as_complex` / `view_as_real`: rotary embeddings as complex rotations (Llama 4, DeepSeek style),
  the rotations built in forward from `arange` (traced on meta, never data);
- `zeros_like`, `new_zeros`: a zero added to q, a zero bias made with full sizes;
- eager attention: `einsum` of q and k over head-sharded batch dims, a per-head ALiBi bias (H, T, T)
  added to the scores, softmax, `matmul` with v;
- `mean` and `var` over the whole (sharded) hidden of q: a LayerNorm written out, as OLMo-style norms
  over the full q width are;
- `scaled_dot_product_attention` with a per-head float mask (1, H, T, T) in the second layer;
- `stack` / `unbind` of head-sharded q, k and v;
- `new_empty` shaped like head-sharded k, filled by `copy_` of slices (DeepSeek's MLA keys): one from k,
  one from a replicated projection expanded over the heads;
- `logsumexp` over the keys (the eager layer's softmax written out);
- a `with torch.no_grad():` block in forward (a mask from the activations, as MoE routers compute).

Start here: `build_model`. Batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import math
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
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * self.weight).type_as(x)


def rotate(x):  # (B, T, nh, hd): each pair of features turned by its position's angle
    T = x.shape[1]
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2, dtype=torch.float32, device=x.device) / HD))
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=x.device), inv)  # (T, hd/2)
    turn = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * turn).flatten(3).type_as(x)


def alibi(T: int, device) -> torch.Tensor:  # (H, T, T): a per-head linear penalty on distance
    slopes = 2.0 ** (-8.0 * torch.arange(1, HEADS + 1, dtype=torch.float32, device=device) / HEADS)
    pos = torch.arange(T, device=device)
    dist = (pos[None, :] - pos[:, None]).clamp(max=0).float()
    return slopes[:, None, None] * dist[None]


class Block(nn.Module):
    def __init__(self, eager: bool):
        super().__init__()
        self.eager = eager
        self.ln = RMSNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(HD), RMSNorm(HD)
        self.k_extra = nn.Linear(D, HD, bias=False)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        h = self.ln(x)
        with torch.no_grad():
            keep = (h.abs() < 3.0).to(h.dtype)
        h = h * keep
        qf = self.q(h)
        qf = (qf - qf.mean(-1, keepdim=True)) * torch.rsqrt(qf.var(-1, keepdim=True, correction=0) + 1e-5)
        kf = self.k(h).view_as(qf)
        q = rotate(self.q_norm(qf.view(B, T, -1, HD))) + torch.zeros_like(qf).view(B, T, -1, HD)
        k = rotate(self.k_norm(kf.view(B, T, -1, HD)))
        both = k.new_empty(*k.shape[:-1], 2 * HD)
        both[..., :HD].copy_(k)
        both[..., HD:].copy_(self.k_extra(h)[:, :, None, :].expand(-1, -1, k.shape[2], -1))
        k = both[..., :HD] + 0.5 * both[..., HD:]
        v = self.v(h).view(B, T, -1, HD)
        q, k, v = torch.stack([q, k, v]).transpose(2, 3).unbind(0)  # (B, nh, T, hd) each
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        bias = alibi(T, x.device)[None] + causal  # (1, H, T, T)
        if self.eager:
            scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(HD) + bias
            y = torch.exp(scores - scores.logsumexp(-1, keepdim=True)) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        y = y.transpose(1, 2).reshape(B, T, -1) + x.new_zeros(B, T, D)
        x = x + self.o(y)
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(eager=i % 2 == 0) for i in range(LAYERS))
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
