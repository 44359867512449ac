"""A tiny HF Phi-3 with grouped-query attention (4 query heads, 2 kv heads): its fused `qkv_proj` is
sliced into q, k and v of unequal widths (64, 32, 32), so a `column` rule shards each block by tp
(passes/tensor_parallel.py `_fused_blocks`; runtime/checkpoint/state.py `shard`).

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Phi3ForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)
from phi3_tiny import CONFIG as _MHA  # noqa: E402

CONFIG = _MHA.__class__(**{**_MHA.to_dict(), "num_key_value_heads": 2})


def build_model() -> nn.Module:
    return Phi3ForCausalLM(CONFIG)
