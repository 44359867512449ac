"""Grouped-query attention written three ways, with 4 q heads and 2 kv heads (tests/test_tp_ops.py, at tp 4):
`repeat_interleave` of the kv heads and HF's `repeat_kv` (a new dim after the heads, expanded, merged), which
both give q head i kv head i // 2 (each rank computes one kv head: passes/tp_subset.py), and tiling (a new
dim before the heads: q head i gets kv head i % 2), which no rank can compute from one kv head, so the pass
keeps k and v whole (passes/tp_gqa.py).

Start here: `build_model(forms)`; tests/models/gqa_tiled.py builds the tiled variant.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH, H, K, D = 64, 8, 32, 4, 2, 8


def repeat_heads(k: torch.Tensor, form: str) -> torch.Tensor:
    """(B, K, T, D) → (B, H, T, D)."""
    B, _, T, _ = k.shape
    if form == "interleave":
        return k.repeat_interleave(H // K, dim=1)
    if form == "kv_major":  # HF's repeat_kv
        return k[:, :, None].expand(B, K, H // K, T, D).reshape(B, H, T, D)
    return k[:, None].expand(B, H // K, K, T, D).reshape(B, H, T, D)  # tiled


class Attention(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.q = nn.Linear(WIDTH, H * D, bias=False)
        self.k = nn.Linear(WIDTH, K * D, bias=False)  # a key bias has no gradient (softmax is shift-invariant)
        self.v = nn.Linear(WIDTH, K * D)  # its bias: sliced with the weight's rows
        self.o = nn.Linear(H * D, WIDTH, bias=False)

    def forward(self, x):  # (B, T, C)
        B, T, _ = x.shape
        q = self.q(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = repeat_heads(self.k(x).view(B, T, K, D).transpose(1, 2), self.form)
        v = repeat_heads(self.v(x).view(B, T, K, D).transpose(1, 2), self.form)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, H * D))


class Model(nn.Module):
    def __init__(self, forms):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Attention(f) for f in forms)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_model(forms=("interleave", "kv_major")) -> nn.Module:
    return Model(forms)


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_fn(model, idx, targets):
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), targets.reshape(-1))
