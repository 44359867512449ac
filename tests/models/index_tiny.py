"""A small causal model that indexes with Python lists, as Falcon's "new decoder architecture" does.

What tests/test_forward_constants.py trains under dp and tp against the serial model
(docs/model-convention.md, "Tensors made in forward from data"): torch's indexing turns each list into
an index tensor, which torch.export lifts as a constant (`lifted_tensor_N`); parc/trace_constants.py makes
it from the list on CPU, so its value reaches every rank.
- `fused[:, :, [-2]]`, `fused[:, :, [-1]]`: Falcon's selection of k and v from a grouped fused projection;
- `y[..., PERM]`: a feature permutation by a list, after the row-parallel projection;
- `h[:, :, KEEP]`: a list of bools.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, SEQ, LAYERS = 16, 8, 6, 2
PERM = [3, 0, 1, 2, 7, 4, 5, 6]   # a permutation of the WIDTH features
KEEP = [True, False] * (WIDTH // 2)  # every other feature


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(WIDTH, 3 * WIDTH)   # fused (q, k, v)-like projection, left whole
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)    # column-parallel under tp
        self.proj = nn.Linear(4 * WIDTH, WIDTH)  # row-parallel under tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, W)
        B, T, _ = x.shape
        fused = self.mix(x).view(B, T, 3, WIDTH)
        gate, value = fused[:, :, [-2]], fused[:, :, [-1]]  # (B, T, 1, W) each, Falcon's `qkv[..., [-2], :]`
        x = x + (torch.sigmoid(gate) * value).squeeze(2) + fused[:, :, 0]
        y = self.proj(F.gelu(self.fc(x)))
        return x + y[..., PERM]


class IndexNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH // 2, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) → (B, T, V)
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h[:, :, KEEP])


def build_model() -> nn.Module:
    return IndexNet()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
