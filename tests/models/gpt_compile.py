"""examples/gpt.py at 2 blocks with dropout 0.1: the model of the `compile` tests (tests/test_compile_inductor.py).

Small because torch.compile's time grows with the program (inductor takes minutes on a 4-block GPT
on a loaded 2-core CPU); dropout on, so the keyed dropout and attention ops go through the compiler
too; 2 blocks, so a pp=2 plan has one per stage.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = replace(gpt.CONFIG, n_layer=2, dropout=0.1)
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)
