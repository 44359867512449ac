"""A tiny HF Llama with multi-query attention (one kv head for four query heads): at tp 2 the kv heads
cannot be split, so the plan shards q and leaves k and v whole (`replicate`); each rank keeps its own
heads of the repeated k and v (passes/tp_layouts.py `_sdpa`).

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                     attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return LlamaForCausalLM(CONFIG)
