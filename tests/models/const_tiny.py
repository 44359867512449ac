"""A small causal model whose tensors are made in forward or kept outside parameters and buffers.

What tests/test_forward_constants.py trains under dp and tp against the serial model
(docs/model-convention.md, "Tensors that are not parameters"):
- a causal mask and positions made in forward from shapes (`ones(T, T).tril()`, `arange`);
- a per-feature scale made in forward from data (`torch.tensor([...], device=x.device)`),
  and a per-token bias from `x.new_tensor`;
- plain tensor attributes that are not buffers: one on the module, one in a list, one in a dict.
Three blocks, so parc traces two and replicates the third (parc/replicate.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, SEQ, LAYERS = 16, 8, 6, 3
FEATURE_SCALE = [0.5, 1.0, 2.0, 1.5, 0.75, 1.25, 1.0, 0.5]  # WIDTH values, made into a tensor in forward


class Block(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)
        self.tables = [torch.linspace(0.5, 1.5, WIDTH) + index]  # a list attribute: no FQN for export
        self.freqs = {"gain": torch.linspace(1.0, 0.5, WIDTH)}  # a dict attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, W)
        T = x.shape[1]
        mask = torch.ones(T, T, device=x.device).tril()  # from shapes: traced as ops
        mix = (mask / mask.sum(-1, keepdim=True)) @ x  # causal running mean, (B, T, W)
        scale = torch.tensor(FEATURE_SCALE, device=x.device)  # from data, in forward: (W,)
        h = (x + mix) * scale * self.tables[0].to(x.device)
        return x + self.proj(F.gelu(self.fc(h))) * self.freqs["gain"].to(x.device)


class ConstNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(i) for i in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.out_scale = torch.full((VOCAB,), 0.8)  # a plain tensor attribute, not a buffer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) → (B, T, V)
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device, dtype=torch.float32)  # from shapes
        h = self.embed(idx) * (1.0 + pos / T).unsqueeze(-1)
        h = h + h.new_tensor([0.1] * WIDTH)  # from data, on the activation's device
        for block in self.blocks:
            h = block(h)
        return self.head(h) * self.out_scale.to(h.device)


def build_model() -> nn.Module:
    return ConstNet()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
