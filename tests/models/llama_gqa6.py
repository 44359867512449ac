"""A tiny HF Llama with 6 q heads and 2 kv heads: at tp 3 a rank's q heads (2) straddle the kv heads' groups
(3 each), so no rank can compute one kv head alone; the pass keeps k and v whole on every rank
(passes/tp_gqa.py) and each rank keeps its q heads' share of the repeated k and v at attention.

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

CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                     attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return LlamaForCausalLM(CONFIG)
