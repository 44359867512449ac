"""examples/gpt.py read per rank: `get_samples(indices)` instead of `get_batch` (runtime/data.py).

Sample i is byte window i of examples/gpt.py's text (deterministic, so a resumed run and the serial
reference see the same samples); `num_samples` makes the sampler shuffle per epoch. Every call is
logged in `REQUESTS` (the indices asked for), so a test can check that a rank asks only for its own
rows. `get_val_samples` is a disjoint held-out split (windows from the end of the text).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

build_model, loss_fn = gpt.build_model, gpt.loss_fn
T = gpt.CONFIG.block_size
num_samples = 40
num_val_samples = 16
REQUESTS: list[list[int]] = []


def _windows(starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    data = gpt._data()
    w = torch.stack([data[s:s + T + 1] for s in starts])  # (n, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def get_samples(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    REQUESTS.append(indices.tolist())
    return _windows([3 * T * i for i in indices.tolist()])


def get_val_samples(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    end = len(gpt._data()) - T - 1
    return _windows([end - 2 * T * i for i in indices.tolist()])
