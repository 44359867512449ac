"""A tiny HF Qwen2 with random weights (q/k/v with biases, grouped-query attention), as a parc model file.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's
(found next to the installed `parc` package, so a compiled copy of this file finds them too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Qwen2Config, Qwen2ForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return Qwen2ForCausalLM(CONFIG)
