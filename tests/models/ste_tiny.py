"""A quantizing MLP with a straight-through estimator written as a custom `torch.autograd.Function`.

Forward rounds the hidden activations to quarters, `round(h * 4) / 4`; backward passes the
incoming gradient through unchanged. torch.export inlines the Function's forward, whose own
derivative is zero almost everywhere, so a program trained from the trace would not be this
model: parc refuses it at the `.apply` call (parc/trace_guards.py, tests/test_autograd_function.py).
tests/models/ste_op_tiny.py is the same model written as a custom op, which parc carries.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATURES, WIDTH, CLASSES = 8, 16, 4


class RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad  # straight through


class QuantMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, F) → (B, classes)
        h = RoundSTE.apply(self.fc(x))
        return self.head(torch.tanh(h))


def build_model() -> nn.Module:
    return QuantMLP()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, FEATURES, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)
