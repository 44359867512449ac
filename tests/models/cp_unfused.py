"""examples/gpt.py with its attention written out (q @ kᵀ, a causal mask, softmax, @ v): context
parallelism rewrites only F.scaled_dot_product_attention, so it must refuse this one at its line."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = gpt.CONFIG
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


class UnfusedAttention(gpt.Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, nh, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        y = att.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def build_model() -> nn.Module:
    model = gpt.GPT(CONFIG)
    for block in model.blocks:
        block.attn = UnfusedAttention(CONFIG)
    return model
