"""tests/models/gqa_forms.py with its first layer's kv heads tiled (q head i uses kv head i % 2): the pass keeps
k and v whole (passes/tp_gqa.py). Start here: `build_model`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
import gqa_forms  # noqa: E402
from gqa_forms import get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)


def build_model() -> nn.Module:
    return gqa_forms.build_model(("tiled", "interleave"))
