"""A Llama at a size from PARC_BENCH_LLAMA="layers,dim,heads,kv_heads,ffn,vocab,seq": for bench/published.py.

The architecture torchtitan trains (torchtitan/models/llama3/model, the Llama 2 and 3 of Meta's papers):
RMSNorm before attention and before the MLP, rotary positions on q and k, grouped-query attention with the
kv heads repeated to the query heads before the attention kernel (torchtitan's `repeat_kv`: a copy), a SwiGLU
MLP w2(silu(w1 x) · w3 x), no biases, an untied output layer. Module names follow torchtitan's
(`layers.N.attention.wq`, `layers.N.feed_forward.w1`), so its parallel plans read the same here.

RMSNorm: torchtitan's `norm_type = "rmsnorm"` (unfused, in fp32: each op its own kernel), or, with a field
`fused` after the seven in PARC_BENCH_LLAMA, its `fused_rmsnorm` (a Triton kernel: here one custom op, which the
cost model prices as one memory-bound op over its input and output bytes, and which keeps only its input for the
backward).

Rotary and SwiGLU: torchtitan's ops, each its own kernel; or, with a field `fused_ops`, one kernel each, as
Megatron-core on Transformer Engine runs them under `apply_rope_fusion` (TE's fused RoPE: q or k read once,
written once; its backward the same on the gradient) and `bias_activation_fusion` with a SwiGLU (Megatron's fused
bias-SwiGLU: the gate and up projections read once, the product written once, only those two inputs kept for the
backward), and as torch.compile generates them. The cost model prices each as one memory-bound op over its input
and output bytes and counts a custom op's inputs as kept, so the fused rotary's input (q or k before it) is counted
though TE keeps only the angle tables: an over-count of two of a layer's smaller activations.

Nemotron-4 (NVIDIA's NeMo recipes: nemotron4-15b-synth.yaml, nemotron4-340b-synth.yaml), with three more fields:
`layernorm`, Megatron's LayerNorm in place of RMSNorm (`normalization: layernorm1p`: the scale stored centred on
zero and applied as 1 + γ; with `fused`, Transformer Engine's one-kernel LayerNorm), `relu2`, the MLP
w2(relu(w1 x)²) with no gate (`activation: squared-relu`, no w3; `bias_activation_fusion: false`, so the relu and
the square are a kernel each, as Megatron-core's `squared_relu` runs them), and `half_rotary`, rotary positions on
the first half of each head's dims (`rotary_percentage: 0.5`; the fused kernel still reads and writes the whole of
q or k).

Only ever traced on meta, so the batches are random token ids. Rotary embedding is written with cos/sin
(torchtitan multiplies complex numbers): the same bytes through memory-bound ops, no complex dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

_SPEC = os.environ.get("PARC_BENCH_LLAMA", "32,4096,32,8,14336,128256,8192").split(",")
_L, _D, _NH, _KV, _FFN, _V, _T = (int(x) for x in _SPEC[:7])
# fields after the seven: "fused", torchtitan's `norm_type = "fused_rmsnorm"` (a Triton kernel: one read of x, one
# write of the output; its backward reads x and the gradient and writes one), else its unfused `rmsnorm` in fp32;
# "fused_ops", rotary and SwiGLU as one kernel each (Transformer Engine's and Megatron-core's fusions, above);
# Nemotron-4's "layernorm", "relu2" and "half_rotary" (above)
_FIELDS, _KNOWN = set(_SPEC[7:]), {"fused", "fused_ops", "layernorm", "relu2", "half_rotary"}
if _FIELDS - _KNOWN:
    raise ValueError(f"PARC_BENCH_LLAMA: unknown fields {sorted(_FIELDS - _KNOWN)} ({', '.join(sorted(_KNOWN))})")
_FUSED_NORM, _FUSED_OPS = "fused" in _FIELDS, "fused_ops" in _FIELDS
_LAYERNORM, _RELU2, _HALF_ROTARY = "layernorm" in _FIELDS, "relu2" in _FIELDS, "half_rotary" in _FIELDS


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torchtitan's RMSNorm: fp32 inside, x's dtype out."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Megatron's layernorm1p: LayerNorm (fp32 inside, x's dtype out) scaled by 1 + γ, γ stored centred on zero."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps).type_as(x) * (1 + weight)


@torch.library.custom_op("parc_bench::fused_rms_norm", mutates_args=())
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One kernel's RMSNorm, as torchtitan's fused_rmsnorm computes it."""
    return _rms_norm(x, weight, eps)


@torch.library.custom_op("parc_bench::fused_layer_norm", mutates_args=())
def fused_layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One kernel's layernorm1p (Transformer Engine's LayerNorm with zero-centred gamma)."""
    return _layer_norm(x, weight, eps)


def _fused_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)   # the input only, as the fused kernels keep it
    ctx.eps = eps


def _fused_norm(op, norm) -> None:
    """`op`'s fake (its output like its input) and its autograd: the backward runs `norm` again on the saved
    input and differentiates it."""
    op.register_fake(lambda x, weight, eps: torch.empty_like(x))

    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(norm(x_, w_, ctx.eps), (x_, w_), grad)
        return gx, gw, None

    op.register_autograd(backward, setup_context=_fused_norm_setup)


_fused_norm(fused_rms_norm, _rms_norm)
_fused_norm(fused_layer_norm, _layer_norm)


class RMSNorm(nn.Module):
    """RMSNorm, or with the `layernorm` field Nemotron's layernorm1p (its weight zero: a scale of one)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim) if _LAYERNORM else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _LAYERNORM:
            return fused_layer_norm(x, self.weight, self.eps) if _FUSED_NORM else _layer_norm(x, self.weight, self.eps)
        if _FUSED_NORM:
            return fused_rms_norm(x, self.weight, self.eps)
        return _rms_norm(x, self.weight, self.eps)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions: each pair of x's first 2·cos.shape[-1] dims turned by its position's angle, the rest as
    they are (all of them but under `half_rotary`). x: (B, T, nh, hs)."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
    # fp32 products (the table is fp32), cast back as torchtitan's `.type_as(xq)` does
    turned = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)
    return turned if rot == x.shape[-1] else torch.cat((turned, x[..., rot:]), dim=-1)


@torch.library.custom_op("parc_bench::fused_rope", mutates_args=())
def fused_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One kernel's rotary (Transformer Engine's fused RoPE)."""
    return _turn(x, cos, sin)


@fused_rope.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return fused_rope(grad, cos, -sin), None, None   # the turn back: one kernel on the gradient


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])   # the angle tables only


fused_rope.register_autograd(_rope_backward, setup_context=_rope_setup)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return fused_rope(x, cos, sin) if _FUSED_OPS else _turn(x, cos, sin)


@torch.library.custom_op("parc_bench::fused_swiglu", mutates_args=())
def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """One kernel's SwiGLU product silu(gate) · up (Megatron's fused bias-SwiGLU, no bias)."""
    return F.silu(gate) * up


@fused_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


def _swiglu_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    with torch.enable_grad():
        g_, u_ = gate.detach().requires_grad_(), up.detach().requires_grad_()
        return torch.autograd.grad(F.silu(g_) * u_, (g_, u_), grad)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)   # the two inputs only, as the fused kernel keeps them


fused_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


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
        q = self.wq(x).view(B, T, -1, self.hs)   # (B, T, nh, hs): -1 follows a column-sharded width
        k = self.wk(x).view(B, T, -1, self.hs)   # (B, T, nkv, hs)
        v = self.wv(x).view(B, T, -1, self.hs)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)      # torchtitan's repeat_kv: kv heads copied to the query heads
        v = v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)   # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(_D, _FFN, bias=False)
        if not _RELU2:
            self.w3 = nn.Linear(_D, _FFN, bias=False)
        self.w2 = nn.Linear(_FFN, _D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _RELU2:   # Megatron-core's squared_relu, torch.pow(F.relu(x), 2): two kernels
            return self.w2(torch.pow(F.relu(self.w1(x)), 2))
        if _FUSED_OPS:
            return self.w2(fused_swiglu(self.w1(x), self.w3(x)))
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
        rot = hs // 2 if _HALF_ROTARY else hs                                                   # dims turned
        inv = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, device=idx.device).float() / rot))  # (rot/2,)
        angles = torch.arange(T, device=idx.device).float()[:, None] * inv[None, :]           # (T, rot/2)
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]             # (1, T, 1, rot/2)
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
