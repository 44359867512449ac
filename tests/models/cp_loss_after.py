"""examples/gpt.py with a loss that is not linear in the mean: log(1 + mean), and a mean over targets the
model computes (bytes below 32 not trained, marked in `loss_fn`). Under context parallelism the pass cannot
leave each rank a share of such a loss: the mean is summed over cp before the log (`parc.cp_sum`), and the
count of targets too, as it is not a batch input's own values (passes/context_parallel.py `sum_shares`,
`token_count`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = gpt.CONFIG
build_model = gpt.build_model
get_batch = gpt.get_batch
# the mean divides by each micro-batch's count of targets, which differs between samples (and log1p is not
# linear): the serial reference runs one forward per micro-batch, as the plan's ranks do
# (runtime/serial_reference.py), not one over the whole global batch
PER_MICRO_BATCH = True


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)  # (B, T, vocab)
    kept = torch.where(targets < 32, -100, targets)  # control bytes are not trained
    mean = F.cross_entropy(logits.reshape(-1, logits.size(-1)), kept.reshape(-1), ignore_index=-100)
    return torch.log1p(mean)
