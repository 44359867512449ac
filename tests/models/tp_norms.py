"""A small decoder whose norms and mixers run on tensor-parallel shards in the ways current model code
writes them, so each rule of passes/tp_norms.py (and the cat, split and conv1d rules beside it) is
trained under tensor parallelism against the serial model (tests/test_tp_ops.py):

- `q_ln`: an nn.LayerNorm (weight and bias) over the full width of column-sharded q, as OLMo-style
  q/k norms over the projected width are: its mean and variance are sums over tp;
- `k_rms`: an nn.RMSNorm (`aten.rms_norm`) over the full width of column-sharded k;
- `v_rms`: `F.rms_norm` over each head of head-sharded v, with no weight (a norm over unsharded dims);
- `F.layer_norm` with no weight over the sharded MLP hidden, then `torch.native_layer_norm` with a weight
  and bias (`mid_w`, `mid_b`), its mean statistic used too;
- `q_heads`: one nn.LayerNorm per head applied to `q.split(1, dim=1)` and concatenated back (StableLM's
  `qk_layernorm`), on head-sharded q: each rank runs its own heads' norms (passes/tp_pieces.py).

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

D, HEADS, HD, LAYERS = 64, 4, 16, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.q_ln = nn.LayerNorm(D)
        self.k_rms = nn.RMSNorm(D, eps=1e-5)
        self.q_heads = nn.ModuleList(nn.LayerNorm(HD) for _ in range(HEADS))
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.mid_w, self.mid_b = nn.Parameter(torch.linspace(0.5, 1.5, 4 * D)), nn.Parameter(torch.zeros(4 * D))

    def forward(self, x):  # (B, T, D)
        B, T, _ = x.shape
        h = self.ln(x)
        q = self.q_ln(self.q(h)).view(B, T, -1, HD).transpose(1, 2)  # (B, nh, T, hd)
        q = torch.cat([norm(one) for norm, one in zip(self.q_heads, torch.split(q, 1, dim=1))], dim=1)
        k = self.k_rms(self.k(h)).view(B, T, -1, HD).transpose(1, 2)
        v = F.rms_norm(self.v(h).view(B, T, -1, HD), (HD,)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        u = F.gelu(self.up(self.ln(x)))
        u, mean, _ = torch.native_layer_norm(F.layer_norm(u, (4 * D,)), (4 * D,), self.mid_w, self.mid_b, 1e-5)
        return x + self.down(u + 0.1 * mean)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
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
