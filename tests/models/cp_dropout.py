"""examples/gpt.py with dropout 0.1 on the embedding and the residual branches, none on the attention
probabilities (ring attention keys no dropout of its own: context parallelism refuses attention dropout):
the model of tests/test_cp_dropout.py.

The GPT itself is imported from the repository's examples/ (found next to the installed `parc` package, so
a compiled copy of this file finds it too).
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
    model = gpt.GPT(CONFIG)
    for block in model.blocks:
        block.attn.dropout = 0.0  # the attention's dropout_p; its resid_drop keeps 0.1
    return model
