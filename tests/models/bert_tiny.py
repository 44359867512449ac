"""A tiny HF BERT used as a causal LM (`BertLMHeadModel`, is_decoder) with random weights, as a parc model file
(see docs/model-convention.md).

Start here: `build_model`, `get_batch`, `loss_fn`. Nothing is downloaded. BERT's block is post-LN and splits each
Megatron pair over sibling modules: `attention.self.query/key/value` → `attention.output.dense`, and
`intermediate.dense` → `output.dense`, each followed by its own LayerNorm over the residual sum. Its head is tied
to `bert.embeddings.word_embeddings`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import BertConfig, BertLMHeadModel

VOCAB, SEQ = 256, 16

CONFIG = BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                    vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, is_decoder=True, pad_token_id=0,
                    attn_implementation="sdpa")


def build_model() -> nn.Module:
    return BertLMHeadModel(CONFIG)


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(1, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1); 0 is the pad token
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
