"""A small MLP whose first block's output is added back after the last block.

Cut into 4 stages (one block each), that skip connection leaves stage 0 and is
used on stage 3: it crosses two stages in between.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, CLASSES, FEATURES = 32, 8, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))  # (B, W)


class SkipNet(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = self.blocks[0](self.inp(x))  # (B, W): the skip starts here
        h = first
        for block in self.blocks[1:]:
            h = block(h)
        return self.head(h + first)  # (B, classes)


def build_model() -> nn.Module:
    return SkipNet()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, FEATURES, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)
