"""A tiny HF StableLM with `qk_layernorm=True`: one LayerNorm per head on q and on k, applied to
`torch.split(states, 1, dim=1)` and concatenated back (transformers' `StableLmLayerNormPerHead`). At tp 2
each rank holds half the heads and runs only their norms (passes/tp_pieces.py).

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import StableLmConfig, StableLmForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = StableLmConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        qk_layernorm=True, attention_dropout=0.0, hidden_dropout=0.0,
                        attn_implementation="sdpa")


def build_model() -> nn.Module:
    return StableLmForCausalLM(CONFIG)
