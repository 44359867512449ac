"""examples/gpt.py with `tie_weights=True`: the lm head reuses the token embedding's weight.

Under a pipeline the embedding runs on the first stage and the head on the last,
so the one parameter is held by both and its gradients are summed between them.
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

CONFIG = replace(gpt.CONFIG, tie_weights=True)
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)
