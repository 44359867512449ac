"""examples/gpt.py's GPT over long byte windows, for bench/cp_vs_torch.py: PARC_BENCH_LONG="seq,layers"
(default 2048,2). At 2048 tokens and width 64 the attention's T² work outweighs the rest of a layer, which is
what a context-parallel benchmark should time. The windows are examples/data/corpus.txt's, a pure function of
the step, as examples/gpt.py draws them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

import parc

# the repository's examples/, found next to the installed `parc` package, so a compiled copy finds it too
sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

_T, _L = (int(x) for x in os.environ.get("PARC_BENCH_LONG", "2048,2").split(","))
CONFIG = replace(gpt.CONFIG, block_size=_T, n_layer=_L)
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (T + 1)-byte windows of the corpus, shifted by one for the targets."""
    return gpt.windows(step, batch_size, CONFIG.block_size)
