"""examples/gpt.py with targets masked unevenly along the sequence (ignore_index -100): the first quarter of
every window and every byte after a space are not trained. Under cp 2 rank 0 holds chunks 0 and 3 of 4,
rank 1 chunks 1 and 2, so the ranks count different numbers of targets: the mean must divide by the whole
micro-batch's count, not each rank's. The cp pass counts them on the whole targets input
(passes/context_parallel.py `token_count`) and leaves each rank's loss its share (`Share`)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = gpt.CONFIG
build_model = gpt.build_model
loss_fn = gpt.loss_fn
# the mean divides by each micro-batch's count of targets, which differs between samples (and log1p is not
# linear): the serial reference runs one forward per micro-batch, as the plan's ranks do
# (runtime/serial_reference.py), not one over the whole global batch
PER_MICRO_BATCH = True


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, targets = gpt.windows(step, batch_size, CONFIG.block_size)
    targets = targets.clone()
    targets[:, : CONFIG.block_size // 4] = -100
    targets[idx == ord(" ")] = -100
    return idx, targets
