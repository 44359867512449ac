"""tests/models/gpt2_tiny.py with HF's default dropout 0.1 (embd, attn, resid): for tests/test_dropout.py.

SDPA attention (HF passes `dropout_p=attn_pdrop` in training); parc's tp pass does not shard the
eager attention's matmuls. Batches and loss are gpt2_tiny.py's (found next to the installed `parc`
package, so a compiled copy of this file finds them too).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from gpt2_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                    bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return GPT2LMHeadModel(CONFIG)
