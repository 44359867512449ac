"""examples/gpt.py with 8 layers: enough for pp 4 × virtual 2 = 8 interleaved stages.

The GPT is imported from the repository's examples/ (found next to the
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

CONFIG = replace(gpt.CONFIG, n_layer=8)
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)
