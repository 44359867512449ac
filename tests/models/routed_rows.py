"""A tiny model with a size that depends on the data, as a parc model file (docs/model-convention.md).

Start here: `build_model`, `get_batch`, `loss_fn`. Each block is a pre-LN MLP, then a router that sends the
tokens its gate scores above zero through one more linear: `h[keep]` has as many rows as the data selects, which
torch.export traces as an unbacked size (u0, in [0, B·T]), the shape of token-dropping MoE layers (JetMoE's).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, WIDTH = 64, 8, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc, self.proj = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.gate, self.routed = nn.Linear(WIDTH, 1), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, W)
        h = x + self.proj(F.gelu(self.fc(self.ln(x))))
        keep = self.gate(h).squeeze(-1) > 0             # (B, T) bool: which tokens this block routes
        out = h.clone()
        out[keep] = h[keep] + self.routed(h[keep])      # (u0, W): u0 tokens, chosen by the data
        return out


class Model(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
