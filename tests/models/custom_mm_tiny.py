"""A tiny language model whose middle layer is an opaque custom op, called the way transformers calls its
grouped-MoE fallback (`transformers::grouped_mm_fallback`): `op(x.to(w.dtype), w)`, an op that needs both
operands in one dtype.

torch.export traces `x.to(w.dtype)` as `x.to(torch.float32)` (the trace is fp32); under `precision bf16` the
program's weight is bf16, autocast does not reach a custom op, and the op got fp32 and bf16 operands at step 0
(found by the zoo fuzz on granitemoe). passes/precision.py runs such ops in fp32 (tests/test_bf16_casts.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, DIM = 64, 8, 32


@torch.library.custom_op("parc_tests::same_dtype_mm", mutates_args=())
def same_dtype_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.dtype != w.dtype:
        raise RuntimeError(f"expected one dtype, got {x.dtype} and {w.dtype}")
    return torch.mm(x, w)


@same_dtype_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[1])


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad.to(x.dtype) @ w.t().to(x.dtype), (x.t() @ grad.to(x.dtype)).to(w.dtype)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


same_dtype_mm.register_autograd(_backward, setup_context=_setup)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.w = nn.Parameter(torch.randn(DIM, DIM) * DIM ** -0.5)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)                                     # (B, T, D)
        flat = h.reshape(-1, DIM)                               # (B·T, D)
        flat = same_dtype_mm(flat.to(self.w.dtype), self.w)     # as transformers' grouped_mm fallback
        return self.head(torch.relu(flat).reshape(h.shape))     # (B, T, V)


def build_model() -> nn.Module:
    return Model()


def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g)  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()           # (B, T), (B, T)


def loss_fn(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))
