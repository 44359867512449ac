"""Step-time piece of tensor parallelism: partial gradients.

Start here after `runtime/parallel/ops.py`. The compiled program's collectives make every
gradient right per micro-batch except one kind: a replicated parameter whose every
use computes on sharded values (a LayerNorm weight on a sequence slice, a per-head
q/k norm's weight on head-sharded values) gets only its slice's share on each tp
rank (passes/tp_grads.py proves which). The compiler lists those parameters in plan.json
(`programs.<name>.tp_partial_grads`); `sum_partial_grads` all-reduces them over
tp once per step, in one flat buffer. Clipping is `parc.runtime.parallel.grad_norm`, shared
by every parallelism.
"""

from __future__ import annotations

import torch

from parc.runtime.parallel import ops


def sum_partial_grads(params: list[torch.Tensor], axis: str = "tp") -> None:
    sum_over_axis([p.grad for p in params if p.grad is not None], axis)


def sum_over_axis(tensors: list[torch.Tensor], axis: str = "tp") -> None:
    """All-reduce `tensors` in place over `axis`, as one flat buffer (ZeRO passes its gradient ranges)."""
    if not tensors:
        return
    flat = torch.cat([g.reshape(-1) for g in tensors])
    flat = ops.all_reduce(flat, axis, "step")
    offset = 0
    for g in tensors:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
