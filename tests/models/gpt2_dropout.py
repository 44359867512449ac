"""tests/models/gpt2_tiny.py with HF's default dropout 0.1 (embd, attn, resid): for tests/test_dropout.py.

SDPA attention (HF passes `dropout_p=attn_pdrop` in training); parc's tp pass does not shard the
eager attention's matmuls.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 256, 16

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                    bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")


def build_model() -> nn.Module:
    return GPT2LMHeadModel(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
