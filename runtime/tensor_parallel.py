"""Step-time pieces of tensor parallelism: partial gradients and a tp-aware gradient norm.

Start here after `runtime/ops.py`. The compiled program's collectives make every
gradient right per micro-batch except one kind: under sequence parallelism a
replicated parameter used on a sequence slice (a LayerNorm weight) gets only its
slice's share on each tp rank. The compiler lists those parameters in plan.json
(`programs.<name>.tp_partial_grads`); `sum_partial_grads` all-reduces them over
tp once per step, in one flat buffer. `clip_grad_norm` counts a replicated
parameter once and sums the squares of sharded parameters across tp, so every tp
rank clips by the same norm as the serial model would.
"""

from __future__ import annotations

import torch

from parc.runtime import ops


def sum_partial_grads(params: list[torch.Tensor], axis: str = "tp") -> None:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = ops.all_reduce(flat, axis, "step")
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(sharded: list[torch.Tensor], replicated: list[torch.Tensor], max_norm: float,
                   tp: int, axis: str = "tp") -> torch.Tensor:
    """Clip in place to the global norm; returns that norm (the serial model's, up to rounding)."""
    def squares(ps):
        gs = [p.grad for p in ps if p.grad is not None]
        return sum((g.double().square().sum() for g in gs), torch.zeros((), dtype=torch.float64))

    sharded_sq = squares(sharded)
    if tp > 1:
        sharded_sq = ops.all_reduce(sharded_sq, axis, "step")
    norm = (sharded_sq + squares(replicated)).sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in sharded + replicated:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm


def clip_program_grads(params: dict[str, torch.Tensor], entry: dict, max_norm: float, tp: int) -> torch.Tensor:
    """`clip_grad_norm` for one program: its state entries say which params are tp shards."""
    sharded = {e["name"] for e in entry["state"] if e["shard"] is not None}
    return clip_grad_norm([p for n, p in params.items() if n in sharded],
                          [p for n, p in params.items() if n not in sharded], max_norm, tp)
