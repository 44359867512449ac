"""examples/gpt.py at 2 layers of width 16: the model of the stored checkpoint in tests/golden/ckpt_v0
(tests/test_checkpoint_compat.py), small enough to keep its shards in the repository (≈ 15k parameters).

The GPT is imported from the repository's examples/ (found next to the installed `parc` package, so a
compiled copy of this file finds it too).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch.nn as nn

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

CONFIG = replace(gpt.CONFIG, n_layer=2, n_embd=16, n_head=2)  # block_size as get_batch cuts it
get_batch = gpt.get_batch
loss_fn = gpt.loss_fn


def build_model() -> nn.Module:
    return gpt.GPT(CONFIG)
