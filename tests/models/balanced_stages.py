"""Four identical, compute-heavy blocks: balanced pipeline stages for measuring the bubble.

Each block is a few (B, W) × (W, W) matmuls, enough real compute that a stage's
forward takes milliseconds and communication of one (B, W) activation is small
next to it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

WIDTH, DEPTH = 256, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = torch.relu(fc(x))
        return x  # (B, W)


class Balanced(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_model() -> nn.Module:
    return Balanced()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, WIDTH, generator=g), torch.randn(batch_size, WIDTH, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()
