"""tests/models/llama_tiny.py with 4 decoder layers instead of 2 (see docs/model-convention.md).

Start here: `build_model`. With 4 layers, `parc.replicate` exports 2 of them and
copies the second for layers 2 and 3; tests/test_fast_trace.py checks that this
equals the full export of an HF model whose layer loop parc did not write
(`self.layers[: config.num_hidden_layers]`).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch.nn as nn
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tiny import CONFIG as TINY  # noqa: E402
from llama_tiny import get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = copy.deepcopy(TINY)
CONFIG.num_hidden_layers = 4


def build_model() -> nn.Module:
    return LlamaForCausalLM(CONFIG)
