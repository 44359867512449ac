"""A tiny language model owning parameters its forward never reads, as transformers' deepseek_v4 does (its
attention compressor's `kv_norm` and `position_bias` are read only at sequences longer than the compressor's
window, and its `gate_proj` output is then dropped).

Each block has a submodule it never calls (`unused`), a projection whose output it drops (`dropped`), and a
parameter only block 0 reads (`first_only`); the model has one more it never reads (`spare`). In the serial
model their gradients stay None and the optimizer leaves them as they are. A pipeline stage took only the
parameters its nodes read, so these belonged to no stage: the pipeline run trained, saved and gathered a model
without them (the zoo's `parallel run lacks parameters […compressor…]` under pp2 and 3d).
passes/pipeline_split.py `unused_owners` gives each to one stage (tests/test_unused_params.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, DIM, LAYERS = 64, 8, 32, 2


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)                # never called
        self.dropped = nn.Linear(DIM, DIM)               # called, its output dropped
        self.first_only = nn.Parameter(torch.ones(DIM))  # read by block 0 only

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.dropped(h)
        x = self.norm(h)
        if self.index == 0:
            x = x * self.first_only
        return h + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))
        self.spare = nn.Parameter(torch.zeros(DIM))      # never read
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()           # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
