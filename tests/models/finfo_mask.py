"""A tiny decoder whose attention masks with `torch.finfo(scores.dtype).min` and whose MLP clamps to
`torch.finfo(x.dtype).max`, as most attention code and T5-style fp16 guards do (transformers' doge, found by
the zoo sweep under tp2_bf16).

torch.export traces both as float32's extremes (±3.4028e38), which bf16 cannot hold: under `precision bf16`
`masked_fill` and `clamp` of a bf16 tensor stopped at step 0 (`value cannot be converted to type
c10::BFloat16 without overflow`). passes/precision.py `extremes` reads the extreme from the operand's dtype at
run time, as this eager model does (tests/test_bf16_casts.py). Module names follow HF Llama's, so
tests/helpers.py `llama_tp_rules` shard it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 8, 32, 4, 2


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        q, k, v = (p(h).view(B, T, -1, DIM // HEADS).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = q @ k.transpose(-1, -2) * (DIM // HEADS) ** -0.5                      # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)            # the traced -3.4028e38
        out = torch.softmax(scores, dim=-1) @ v                                        # (B, H, T, hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        big = torch.finfo(x.dtype).max                                                 # the traced 3.4028e38
        return x.clamp(min=-big, max=big)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.self_attn, self.mlp = Attention(), MLP()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Decoder()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()           # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
