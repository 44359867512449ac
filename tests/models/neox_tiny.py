"""A tiny HF GPT-NeoX with random weights (a fused per-head `query_key_value`, parallel residual), as a
parc model file.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's
(found next to the installed `parc` package, so a compiled copy of this file finds them too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, hidden_dropout=0.0,
                       attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return GPTNeoXForCausalLM(CONFIG)
