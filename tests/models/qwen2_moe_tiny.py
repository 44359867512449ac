"""A tiny HF Qwen2-MoE with random weights: top-2 routing over 4 experts and a shared expert, in
transformers' own experts code, which counts tokens per expert with `torch.histc` on int32 ids when
the device is neither CPU nor MPS (as on the meta device parc traces on; passes/portable.py).

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                        num_experts_per_tok=2, attention_dropout=0.0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return Qwen2MoeForCausalLM(CONFIG)
