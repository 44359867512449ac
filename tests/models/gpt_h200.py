"""examples/gpt.py's GPT at the sizes measured on one H200 (../shared/gpu/README.md): for tests/test_cost_h200.py.

PARC_TEST_GPT_SIZE picks "124m" (12 × 768, 12 heads) or "1.4b" (24 × 2048, 16 heads); vocab
50304, sequence 1024, untied head, as the GPU run's gpt_gpu.py. The model is only traced (on
meta), never run, so the batches are random token ids.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402,F401  (the convention's third function)

SIZES = {"124m": dict(n_layer=12, n_head=12, n_embd=768), "1.4b": dict(n_layer=24, n_head=16, n_embd=2048)}
CONFIG = GPTConfig(vocab_size=50304, block_size=1024, **SIZES[os.environ.get("PARC_TEST_GPT_SIZE", "124m")])


def build_model():
    return GPT(CONFIG)


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
