"""examples/gpt.py with a learned position bias read by slicing (`self.pos_bias[:T]`), not through
`arange` positions: context parallelism cannot prove which rows a rank's tokens need, so it refuses."""

from __future__ import annotations

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


class PosBiasGPT(gpt.GPT):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.pos_bias = nn.Parameter(torch.zeros(cfg.block_size, cfg.n_embd))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.pos_bias[:T]  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return PosBiasGPT(CONFIG)
