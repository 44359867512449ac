"""A linear layer called twice in one forward (a weight-shared refinement step): one parameter, two uses."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, CLASSES = 16, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(self.inp(x)))  # the first call
        h = torch.tanh(self.shared(h))  # the second call
        return self.head(h)


def build_model() -> nn.Module:
    return Net()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, WIDTH, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)
