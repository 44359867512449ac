"""The model `parc calibrate` trains to time a step in place (calibrate_step.py), as a model file.

A small decoder in the Llama layout: RMS norms before attention and MLP, no biases, a SiLU-gated
MLP, learned positions, an untied head. It is not any example or test model: what calibrate
measures with it (how much slower ops run in a step than each in a loop of its own) should hold
for the user's model, not be fitted to one parc ships. It follows docs/model-convention.md, so it
is compiled and run by the same code as a user's model. The batches are random tokens, a pure
function of the step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, T, WIDTH, HEADS, LAYERS = 320, 48, 96, 4, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_1 = nn.RMSNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm_2 = nn.RMSNorm(WIDTH)
        self.gate = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, C = x.shape
        q, k, v = (t.view(B, S, HEADS, C // HEADS).transpose(1, 2) for t in self.qkv(self.norm_1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, C)
        x = x + self.out(y)
        h = self.norm_2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(T, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return Probe()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (batch_size, T + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
