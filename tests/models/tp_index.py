"""A small MLP model whose column output (features sharded under tp) is indexed along the tokens, an
unsharded dim: `index_select`, `select`, `gather` (its index, whole on every rank, keeps this rank's features)
and `bmm` contracting the sharded features (a partial product, summed over tp). tests/test_tp_ops.py trains it
one step against serial, per tensor.

Start here: `build_model`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, D = 64, 8, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        u = F.gelu(self.up(self.ln(x)))  # (B, T, 4D), features sharded
        back = torch.arange(T - 1, -1, -1, device=x.device)  # the tokens reversed
        u = u + 0.25 * u.index_select(1, back) + 0.25 * u.select(1, 0)[:, None]
        u = u + 0.25 * u.gather(1, back[None, :, None].expand(B, T, u.shape[-1]))
        total = torch.bmm(u, torch.ones(B, u.shape[-1], 1, device=x.device))  # (B, T, 1): over the features
        return x + self.down(u * torch.sigmoid(0.01 * total))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_fn(model, idx, targets):
    return F.cross_entropy(model(idx).reshape(-1, VOCAB), targets.reshape(-1))
