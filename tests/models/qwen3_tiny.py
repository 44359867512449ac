"""A tiny HF Qwen3 with random weights: per-head RMSNorm on q and k (`q_norm`, `k_norm`, weights of size
head_dim) applied to head-sharded values under tensor parallelism, and grouped-query attention.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Qwen3Config, Qwen3ForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                     attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return Qwen3ForCausalLM(CONFIG)
