"""examples/gpt.py over 256-token windows: a long-ish sequence for context parallelism on CPU ranks.

examples/cp.par (its plan) splits each window over cp 2 (4 load-balanced chunks of 64 tokens, two per rank);
`GPT` is examples/gpt.py's, with learned position embeddings read through `arange` positions.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

import parc

# the repository's examples/, found next to the installed `parc` package, so a compiled copy finds it too
sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = replace(gpt.CONFIG, block_size=256, n_layer=2)
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step `step`: random 257-byte windows of the corpus, a pure function of the step."""
    return gpt.windows(step, batch_size, CONFIG.block_size)
