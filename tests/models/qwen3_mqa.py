"""A tiny HF Qwen3 with one kv head for four q heads and eager attention: at tp 2 under `column` rules each
rank computes the one kv head (Megatron's kv-subset form, passes/tp_subset.py), through Qwen3's per-head
`k_norm` (a weight of size head_dim that meets the kv head and the q heads alike), RoPE, `repeat_kv` and
eager attention's two matmuls, where the repeated k and v are narrowed to this rank's q heads.

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
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                     attention_dropout=0.0, attn_implementation="eager")


def build_model() -> nn.Module:
    return Qwen3ForCausalLM(CONFIG)
