"""examples/gpt.py with rotary positions applied to interleaved pairs, as Meta's Llama and torchtitan turn them
(each pair (x[2i], x[2i+1]) rotated, the result re-interleaved by `stack(..., -1).flatten(-2)`), angles from
`arange` positions in the forward: context parallelism must keep the stack split along the sequence. Grouped-
query attention written out as torchtitan's `repeat_kv` was (2 kv heads, each `repeat_interleave`d to its 2
query heads along the heads dim), and the loss flattens (batch, sequence) with `flatten(0, 1)`, as its does."""

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
KV_HEADS = 2


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, nh, hs): each pair of its last dim turned by its position's angle, re-interleaved."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class RotaryAttention(gpt.Attention):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.qkv = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * KV_HEADS * (cfg.n_embd // cfg.n_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).split([C, KV_HEADS * hs, KV_HEADS * hs], dim=2)
        pos = torch.arange(T, device=x.device).float()
        inv = 1.0 / 10000 ** (torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs)
        angle = pos[:, None] * inv[None, :]                      # (T, hs / 2)
        cos, sin = angle.cos()[None, :, None, :], angle.sin()[None, :, None, :]
        rep = self.n_head // KV_HEADS
        q = _rotate(q.view(B, T, self.n_head, hs), cos, sin).transpose(1, 2)
        k = _rotate(k.view(B, T, KV_HEADS, hs), cos, sin).repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v.view(B, T, KV_HEADS, hs).repeat_interleave(rep, dim=2).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def build_model() -> nn.Module:
    model = gpt.GPT(CONFIG)
    for block in model.blocks:
        block.attn = RotaryAttention(CONFIG)
    model.apply(model._init_weights)
    return model


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten(0, 1))
