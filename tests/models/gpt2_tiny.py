"""A tiny HF GPT-2 with random weights, as a parc model file (see docs/model-convention.md).

Start here: `build_model`, `get_batch`, `loss_fn`. Nothing is downloaded: the model
is built from a `GPT2Config`. GPT-2's projections are `transformers.pytorch_utils.Conv1D`:
a weight of shape (in, out) used as `addmm(b, x, w)`, i.e. the transpose of nn.Linear's
layout; its fused `c_attn` is (hidden, 3·hidden). Its lm_head is tied to `transformer.wte`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 256, 16

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")  # traces under torch.export non-strict on meta


def build_model() -> nn.Module:
    return GPT2LMHeadModel(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # CE from logits rather than `labels=`, as in tests/models/llama_tiny.py.
    logits = model(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
