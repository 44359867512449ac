"""GPT-3 175B (96 layers, hidden 12288, 96 heads, vocab 51200, sequence 2048) as a parc model file.

Start here: `CONFIG`; the model is examples/gpt.py's `GPT`. parc only ever builds
this on meta (bench/compile_gpt3.py), so its batches are random token ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402
from gpt import loss_fn  # noqa: E402,F401  (the convention's third function, unchanged)

CONFIG = GPTConfig(vocab_size=51200, block_size=2048, n_layer=96, n_head=96, n_embd=12288)


def build_model() -> nn.Module:
    return GPT(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)
