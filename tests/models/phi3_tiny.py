"""A tiny HF Phi-3 with random weights (fused `qkv_proj` and `gate_up_proj`, sliced rather than split), as a
parc model file.

Start here: `build_model`. Nothing is downloaded; batches and loss are tests/models/llama_tiny.py's
(found next to the installed `parc` package, so a compiled copy of this file finds them too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import Phi3Config, Phi3ForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                    original_max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return Phi3ForCausalLM(CONFIG)
