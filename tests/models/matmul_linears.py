"""A tiny MLP language model whose layers are written as matmuls, not nn.Linear:
`x @ w.t() + b` (aten.matmul + add) in `fc`, `torch.addmm(b, x2d, w.t())` in `proj`.
passes/tensor_parallel.py must shard these like linears (tests/test_tp_matmul.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HIDDEN, T = 64, 32, 64, 8


class MatmulLinear(nn.Module):
    """y = x @ w.t() + b, with w (out, in) like nn.Linear."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in) * n_in ** -0.5)
        self.b = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return x @ self.w.t() + self.b


class AddmmLinear(MatmulLinear):
    """The same layer as one addmm on the flattened tokens."""

    def forward(self, x):
        y = torch.addmm(self.b, x.reshape(-1, x.shape[-1]), self.w.t())  # (B·T, out)
        return y.reshape(*x.shape[:-1], -1)


class Scale(nn.Module):
    """A learned per-feature gain: its parameter meets an elementwise mul, which no tp rule shards."""

    def __init__(self, n: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.g


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = MatmulLinear(WIDTH, HIDDEN), AddmmLinear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = Scale(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)  # (B, T, WIDTH)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (B, T, VOCAB)


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, VOCAB, (batch_size, T), generator=g)
    return x, (x * 3 + 1) % VOCAB  # a learnable mapping


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), targets.reshape(-1))
