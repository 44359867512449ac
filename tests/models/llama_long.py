"""A Llama 3 8B-shaped model (32 layers, width 4096, 32 query heads over 8 kv heads, SwiGLU 14336, vocabulary
128256) at a 128k-token context (T = 131072): the planner's context-parallel case. Only ever traced on meta.

bench/llama_sized.py's architecture with HF's rotary (`rotate_half`: halves swapped and concatenated, what
transformers' Llama does and context parallelism is proven on) in place of torchtitan's interleaved pairs.
PARC_LONG_LLAMA="layers,dim,heads,kv_heads,ffn,vocab,seq" scales it (the suite's quick cases).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

_L, _D, _NH, _KV, _FFN, _V, _T = (int(x) for x in
                                   os.environ.get("PARC_LONG_LLAMA", "32,4096,32,8,14336,128256,131072").split(","))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary: x · cos + rotate_half(x) · sin. x: (B, nh, T, hs); cos, sin: (1, 1, T, hs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hs = _D // _NH
        self.wq = nn.Linear(_D, _NH * self.hs, bias=False)
        self.wk = nn.Linear(_D, _KV * self.hs, bias=False)
        self.wv = nn.Linear(_D, _KV * self.hs, bias=False)
        self.wo = nn.Linear(_NH * self.hs, _D, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.hs).transpose(1, 2)   # (B, nh, T, hs)
        k = self.wk(x).view(B, T, -1, self.hs).transpose(1, 2)   # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, -1, self.hs).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)   # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(_D, _FFN, bias=False)
        self.w3 = nn.Linear(_D, _FFN, bias=False)
        self.w2 = nn.Linear(_FFN, _D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(_D)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(_D)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(_V, _D)
        self.layers = nn.ModuleList(Layer() for _ in range(_L))
        self.norm = RMSNorm(_D)
        self.output = nn.Linear(_D, _V, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        hs = _D // _NH
        inv = 1.0 / (500000.0 ** (torch.arange(0, hs, 2, device=idx.device).float() / hs))   # (hs/2,)
        angles = torch.arange(T, device=idx.device).float()[:, None] * inv[None, :]           # (T, hs/2)
        emb = torch.cat((angles, angles), dim=-1)                                              # (T, hs)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]                               # (1, 1, T, hs)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def build_model():
    return Llama()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, _V, (batch_size, _T + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def loss_fn(model, idx, targets):
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
