"""examples/gpt.py with grouped-query attention through SDPA's `enable_gqa` (4 query heads, 2 kv heads)
and non-causal attention: context parallelism repeats each kv head for its query heads before the ring."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = gpt.CONFIG
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn
KV_HEADS = 2


class GQAAttention(gpt.Attention):
    def __init__(self, cfg):
        super().__init__(cfg)
        hs = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * KV_HEADS * hs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).split([C, KV_HEADS * hs, KV_HEADS * hs], dim=2)
        q = q.view(B, T, -1, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        v = v.view(B, T, -1, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


def build_model() -> nn.Module:
    model = gpt.GPT(CONFIG)
    for block in model.blocks:
        block.attn = GQAAttention(CONFIG)
    model.apply(model._init_weights)
    return model
