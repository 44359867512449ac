"""examples/gpt.py with dropout 0.1 (embedding, attention, residual): for the tp dropout-stream tests.

The GPT itself is imported from the repository's examples/ (found next to the
installed `parc` package, so a compiled copy of this file finds it too).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = replace(gpt.CONFIG, dropout=0.1)
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)
