"""A fused projection whose output is read through slices that overlap (`[0:72]`, `[56:128]`, `[128:192]`),
so they are not blocks it could be sharded by: a `column` rule on `attn.qkv` must be refused at a slice,
not trained on misaligned shards (tests/test_tp_zoo.py). Slices that tile the features are blocks, each
sharded on its own (tests/test_tp_ops.py's Phi-3).

Start here: `build_model`. Batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

D = 64


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.o = nn.Linear(D, D, bias=False)

    def forward(self, x):
        y = self.qkv(x)
        a, b, c = y[..., :72], y[..., 56:128], y[..., 128:]
        return self.o(a[..., :64] * b[..., 8:] + c)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.attn = Attn()
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        return _Out(self.lm_head(x + self.attn(x)))


class _Out:
    def __init__(self, logits):
        self.logits = logits


def build_model() -> nn.Module:
    return Model()
