"""Four identical blocks whose compute takes a fixed wall time: balanced stages for measuring the bubble.

The bubble is a property of the schedule only if every forward and backward
takes the same time on every rank. Real matmuls do not on a shared 2-core
machine: four ranks contend for the cores, so a rank's "idle" time also
includes time spent waiting for a CPU. Each block therefore holds its compute
with `parctest::hold`, a custom op that sleeps a fixed time in forward and
twice as long in backward (the usual B = 2F; the backward is an op too, so a
compiled program keeps it) and uses no CPU while it does, and
the real work around it is tiny. The op is a graph node like any aten op: it is
traced, written into each stage's program and run there.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

WIDTH = 32
FORWARD_MS = 50.0  # long next to a P2P hop (~1-5 ms when the cores are contended)  # per block; backward holds 2 × this


@torch.library.custom_op("parctest::hold", mutates_args=())
def hold(x: torch.Tensor, ms: float) -> torch.Tensor:
    time.sleep(ms / 1000)
    return x.clone()


@hold.register_fake
def _(x, ms):
    return torch.empty_like(x)


@torch.library.custom_op("parctest::hold_backward", mutates_args=())
def hold_backward(grad: torch.Tensor, ms: float) -> torch.Tensor:
    time.sleep(2 * ms / 1000)
    return grad.clone()


@hold_backward.register_fake
def _(grad, ms):
    return torch.empty_like(grad)


def _hold_backward(ctx, grad):
    # an op, not a sleep written in the formula: AOTAutograd (`compile aot_eager|inductor`) traces a
    # backward formula once, at compile time, so a bare `time.sleep` here would run then and never again
    # (the compiled B took 0.8 ms, not 100: test_pipeline's bubble check failed compiled)
    return hold_backward(grad, ctx.ms), None


def _hold_setup(ctx, inputs, output):
    ctx.ms = inputs[1]


hold.register_autograd(_hold_backward, setup_context=_hold_setup)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hold(torch.relu(self.fc(x)), FORWARD_MS)  # (B, W)


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
