"""examples/gpt.py with a sliding-window mask built from `arange` positions (each query sees its 8 latest
keys): a constant of the program, but not the causal triangle, so context parallelism refuses it at the
attention's line rather than run the ring with the wrong mask."""

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
WINDOW = 8


class WindowAttention(gpt.Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        hs = C // self.n_head
        q, k, v = (t.view(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        pos = torch.arange(T, device=x.device)
        gap = pos[:, None] - pos[None, :]  # (T, T): query − key
        mask = (gap >= 0) & (gap < WINDOW)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def build_model() -> nn.Module:
    model = gpt.GPT(CONFIG)
    for block in model.blocks:
        block.attn = WindowAttention(CONFIG)
    return model
