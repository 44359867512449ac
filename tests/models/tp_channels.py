"""A small decoder with a linear-attention style mixer (Qwen3-Next, Qwen3.5): q, k and v projected
and head-sharded, convolved per channel by a depthwise causal `conv1d`, and split back by their global
widths, so passes/tp_channels.py's rules (`cat` along the sharded dim, depthwise `conv1d`,
`repeat_interleave` of heads; `pad`, `cumsum` and `tril` along each head's tokens), the heads flattened into
rows for a gated RMSNorm and reshaped back (passes/tp_rows.py), and the blocked `split` are trained under tensor parallelism against the
serial model (tests/test_tp_ops.py). The first layer projects q, k and v apart and concatenates them
along their sharded features (Qwen3-Next); the second projects them fused (`qkv`, Qwen3.5's
`in_proj_qkv`), whose blocks the pass finds at the split after the transposes, the cast and the conv. q and k have 2 heads, v 4: the blocks
are unequal (32, 32, 64). The conv weight is used as the transformers code uses it
(`weight.squeeze(1)`, then `unsqueeze(1)` inside `causal_conv1d_fn`).

Start here: `build_model`. Batches and loss are tests/models/llama_tiny.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import VOCAB, get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

D, HD, KD, VD, K, LAYERS = 64, 16, 32, 64, 4, 2


def causal_conv1d(x, weight, bias):  # x (B, C, T), weight (C, K): one filter per channel
    T = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=x.shape[1])
    return F.silu(out[:, :, :T])


class Block(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.ln = nn.LayerNorm(D)
        if fused:
            self.qkv = nn.Linear(D, 2 * KD + VD)
        else:
            self.q, self.k, self.v = nn.Linear(D, KD, bias=False), nn.Linear(D, KD, bias=False), nn.Linear(D, VD)
        self.conv1d = nn.Conv1d(2 * KD + VD, 2 * KD + VD, K, groups=2 * KD + VD, padding=K - 1)
        self.z = nn.Linear(D, VD, bias=False)  # the gate of the norm below
        self.norm_w = nn.Parameter(torch.linspace(0.5, 1.5, HD))
        self.o = nn.Linear(VD, D)

    def gated_norm(self, rows, gate):  # (N, hd) each: an RMSNorm of each row, gated (Qwen3-Next's RMSNormGated)
        h = rows.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.norm_w * h.to(rows.dtype) * F.silu(gate.to(torch.float32))

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        h = self.ln(x)
        mixed = self.qkv(h) if self.fused else torch.cat((self.q(h), self.k(h), self.v(h)), dim=-1)
        mixed = mixed.transpose(1, 2)  # (B, 2KD+VD, T)
        mixed = causal_conv1d(mixed, self.conv1d.weight.squeeze(1), self.conv1d.bias).transpose(1, 2)
        q, k, v = torch.split(mixed, [KD, KD, VD], dim=-1)
        rep = VD // KD  # q and k heads repeated to v's
        if self.fused:
            q, k = (t.view(B, T, -1, HD).repeat_interleave(rep, dim=2) for t in (q, k))
        else:
            q, k = (t.view(B, T, -1, 1, HD).expand(B, T, KD // HD, rep, HD).reshape(B, T, -1, HD) for t in (q, k))
        v = v.view(B, T, -1, HD)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        # (B, H, T, hd): ops along the tokens and features of each head, as a chunked delta rule writes them
        y = y + 0.1 * F.pad(y, (0, 0, 1, 0))[:, :, :T].cumsum(2) + 0.01 * (y @ y.transpose(-1, -2)).tril() @ y
        # heads flattened into rows (B·T·H, hd), normed row by row, and back (B, T, H·hd), as Qwen3-Next does
        rows = self.gated_norm(y.transpose(1, 2).reshape(-1, HD), self.z(h).view(B, T, -1, HD).reshape(-1, HD))
        return x + self.o(rows.reshape(B, T, -1))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(fused=i % 2 == 1) for i in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, use_cache=False):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return _Out(self.lm_head(self.norm(x)))


class _Out:
    def __init__(self, logits):
        self.logits = logits


def build_model() -> nn.Module:
    return Model()
