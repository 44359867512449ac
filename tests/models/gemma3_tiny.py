"""A tiny HF Gemma 3 (text) with random weights: q/k norms computed in float32 and cast back with
`type_as`, tied embeddings, sliding-window and global layers, grouped-query attention.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model() -> nn.Module:
    return Gemma3ForCausalLM(CONFIG)
