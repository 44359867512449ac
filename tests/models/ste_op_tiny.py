"""tests/models/ste_tiny.py's straight-through estimator as a custom op, the form parc carries.

`torch.library.custom_op` makes `round_ste` one opaque op: torch.export keeps it as one node
(`torch.ops.parc_tests.round_ste.default` in the generated program), and autograd runs the
backward registered with `register_autograd`, on every rank as in the serial model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from ste_tiny import CLASSES, FEATURES, WIDTH, get_batch, loss_fn  # noqa: E402,F401  (the same data and loss)


@torch.library.custom_op("parc_tests::round_ste", mutates_args=())
def round_ste(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 4) / 4


@round_ste.register_fake
def _(x: torch.Tensor) -> torch.Tensor:  # shapes for tracing on meta
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad  # straight through


round_ste.register_autograd(_backward)


class QuantMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, F) → (B, classes)
        return self.head(torch.tanh(round_ste(self.fc(x))))


def build_model() -> nn.Module:
    return QuantMLP()
