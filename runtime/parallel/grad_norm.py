"""The global gradient norm, for clipping: one function for every mix of dp, pp, tp and ZeRO.

Start here for `clip ...` in a plan. Serial clipping scales every gradient by
max_norm / ‖g‖ where ‖g‖ is over the whole model. Spread over a mesh, each
element of g sits on several ranks or in pieces, so each rank adds the squares
of exactly the elements it *owns*, and the owners' sums are added over the axes
along which ownership is split:

  what                                   owned by                      summed over
  tp shard (column/row/vocab)            every tp rank (its piece)     tp
  tp-replicated param (LayerNorm, bias)  tp rank 0 only                —
  a pipeline stage's params              its pp rank                   pp
  tied param (embedding = lm head)       the first pp rank holding it  —
  ZeRO range of a flat bucket            its dp rank                   dp
  ZeRO range under context parallelism   its dp × cp rank              dp, cp
  plain dp replica (no ZeRO)             every dp rank, identically    — (not summed)

`owned_pieces` and `ZeroOptimizer.grad_ranges` say what a rank owns;
`clip_` sums, reduces and scales. Each rank sums its squares in float64, so the
norm barely depends on how the mesh cut the sum (~1e-7 relative, from the fp32
all-reduce).
"""

from __future__ import annotations

import torch

from parc.runtime.parallel import ops


def global_norm(owned: list[torch.Tensor], ctx, axes: tuple[str, ...]) -> torch.Tensor:
    """‖g‖₂ of the whole model: squares of `owned` summed here, then over each mesh axis in `axes`."""
    local = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for g in owned:
        local += g.detach().double().square().sum()
    # one fp32 scalar on the wire per axis (what DDP-style clipping sends); the float64 local sum
    # keeps a many-tensor sum exact, and fp32 keeps the total to ~1e-7 relative
    sq = local.float()
    for axis in axes:
        if ctx.degree.get(axis, 1) > 1:  # through runtime/parallel/ops.py: recorded (`ops.record`) like every collective
            sq = ops.all_reduce(sq, axis, "step")
    return sq.sqrt()


def clip_(owned: list[torch.Tensor], grads: list[torch.Tensor], max_norm: float, ctx,
          axes: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale `grads` (everything this rank updates) in place by min(1, max_norm / ‖g‖); return (‖g‖, that
    coefficient), both 0-dim tensors on the device."""
    norm = global_norm(owned, ctx, axes)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # torch.nn.utils.clip_grad_norm_'s formula
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm, coef


def nonfinite(loss: torch.Tensor, grads: list[torch.Tensor], ctx) -> torch.Tensor:
    """1.0 if any rank's `loss` or any element of any rank's `grads` is nan/inf, else 0.0: a 0-dim fp32 tensor
    on the device (`--on-nonfinite skip`, runtime/optim_step.py `step_unless`).

    Each rank counts its own non-finite tensors; one scalar all-reduce per mesh axis adds the counts. Nothing
    is read on the host: the optimizer step takes the flag as a tensor. (Reading the norm instead would miss
    plans without `clip=`, and the loss lives on the last pp stage only.)
    """
    bad = (~torch.isfinite(loss.detach())).float().sum()
    for g in grads:
        bad = bad + (~torch.isfinite(g)).any().float()
    # cp (context parallelism): under ZeRO each dp × cp rank holds its own gradient ranges, so the flag is
    # summed over cp too (without ZeRO the cp ranks' reduced gradients are equal: it costs one scalar)
    for axis in ("dp", "cp", "tp", "pp"):
        if ctx.degree.get(axis, 1) > 1:
            bad = ops.all_reduce(bad, axis, "step")
    return (bad > 0).float()


def counted(entry: dict, ctx, tied_elsewhere: set[str]) -> set[str]:
    """Placeholder names whose gradient this rank counts: tp shards, replicated ones on tp rank 0,
    minus tied copies another pp rank counts."""
    tp_rank = ctx.coord["tp"]
    return {e["name"] for e in entry["state"]
            if (e["shard"] is not None or tp_rank == 0) and e["name"] not in tied_elsewhere}


def owned_pieces(params: dict[str, torch.Tensor], names: set[str]) -> list[torch.Tensor]:
    """Without ZeRO: the whole gradient of each counted parameter (dp replicas are equal after sync)."""
    return [p.grad for n, p in params.items() if n in names and p.grad is not None]


def tied_elsewhere(plan_json: dict, pp_coord: int, entry: dict) -> set[str]:
    """Placeholder names of tied copies that another pp rank counts in the norm."""
    fqns = {t["fqn"] for t in plan_json.get("tied", []) if t["pp_ranks"][0] != pp_coord}
    return {e["name"] for e in entry["state"] if e["fqn"] in fqns}
