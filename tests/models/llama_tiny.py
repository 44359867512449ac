"""A tiny HF Llama with random weights, as a parc model file (see docs/model-convention.md).

Start here: `build_model`, `get_batch`, `loss_fn`. Nothing is downloaded: the model
is built from a `LlamaConfig`. It checks that parc traces a third-party model whose
module names (`model.layers.{i}.self_attn.q_proj`, ...) parc did not choose.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 256, 16

CONFIG = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="sdpa",  # traces under torch.export non-strict on meta
)


def build_model() -> nn.Module:
    return LlamaForCausalLM(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # CE from logits rather than `labels=`: HF shifts labels itself, and its loss
    # helper's reduction is not a plain mean over this batch's tokens.
    logits = model(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
