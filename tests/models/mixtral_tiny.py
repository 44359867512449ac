"""A tiny HF Mixtral (sparse MoE feed-forward, 4 experts, top-2) with random weights, as a parc model file.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
tests/test_moe_hf.py compiles it at ep=2: HF's Mixtral routes tokens with data-dependent shapes
(each expert runs on the tokens that chose it), a form passes/expert_parallel.py does not spread.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import MixtralConfig, MixtralForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.0,
                       attn_implementation="sdpa")


def build_model() -> nn.Module:
    return MixtralForCausalLM(CONFIG)
