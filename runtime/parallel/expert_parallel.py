"""Expert parallelism at run time: the token all-to-all, expert gradients, expert state.

Start at `alltoall_alltoall`, the op passes/expert_parallel.py writes into a program around
each MoE layer's experts. The rest serves the Trainer (runtime/train.py):

- `localize(entry, ep_rank)`: a program's state entries name the experts of ep rank 0
  (slot j ↔ expert j); ep rank r holds experts r·E/ep + j, listed per entry in `ep_fqns`.
- `ExpertBuckets`: the dense gradients are averaged over dp as always; an expert's gradient
  already sums the losses of its whole ep group (the all-to-all's backward brought them), so
  it is summed over the edp group (the ranks holding the same experts) and divided by dp.
- `ExpertZero` (ZeRO 1–2): the dense parameters partitioned over dp as without ep, the experts
  over their edp group (DeepSpeed's layout), each by its own `ZeroOptimizer`, driven as one.
- `ep_norm_piece`: without ZeRO, the experts' share of the global gradient norm, summed over ep.
- `gather_experts`: the full model's experts for `gathered_state`, from every ep rank (and tp rank).

Checkpoints (runtime/checkpoint/sharded.py) store each expert under its serial-model FQN, written by the
ranks of its ep coordinate; `ExpertZero.full_optimizer_state` / `load_full` serve them as
ZeroOptimizer's do.

Recording. `with traffic() as log:` appends `(phase, bytes)` for every all-to-all issued,
`bytes` being what this rank sends to the other ranks of its ep group (its own chunk stays);
`tests/test_moe.py` holds it to the analytic volume of docs/moe.md.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor

from parc.runtime import eager
from parc.runtime.parallel import ops
from parc.runtime.parallel.data_parallel import GradBuckets
from parc.runtime.optim_step import _fused
from parc.runtime.checkpoint.state import unshard
from parc.runtime.parallel.zero import ZeroOptimizer

_TRAFFIC: list | None = None


@contextmanager
def traffic():
    """Collect `(phase, bytes sent to other ranks)` of every expert all-to-all issued inside the block."""
    global _TRAFFIC
    outer, _TRAFFIC = _TRAFFIC, []
    try:
        yield _TRAFFIC
    finally:
        _TRAFFIC = outer


def all_to_all(x: Tensor, axis: str, phase: str) -> Tensor:
    """Chunk k of dim 0 goes to rank k of the axis group; chunk k of the result came from rank k."""
    g = ops.group(axis)
    n = dist.get_world_size(g)
    ops._note("all_to_all", axis, phase)
    if _TRAFFIC is not None:
        _TRAFFIC.append((phase, x.numel() * x.element_size() * (n - 1) // n))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), group=g)
    return out


def _axis_ctx(ctx, inputs, output):
    ctx.axis = inputs[1]


@eager.custom_op("parc::alltoall_alltoall")
def alltoall_alltoall(x: Tensor, axis: str) -> Tensor:
    """Token exchange of expert parallelism. x (E, cap, C): this rank's capacity slots of every
    expert. Forward: all-to-all over `axis` in ep equal chunks of dim 0 (the E/ep experts of each
    ep rank), so the result (ep·E/ep, cap, C) holds, chunk s, source rank s's slots of this rank's
    experts; applied to the experts' outputs it sends them home. Backward: the same all-to-all
    of the gradient (an equal-split all-to-all is its own transpose)."""
    return all_to_all(x, axis, "fwd")


@eager.custom_op("parc::alltoall_bwd")
def alltoall_bwd(g: Tensor, axis: str) -> Tensor:
    """The all-to-all's backward: the same exchange of the gradient, as an opaque op so that
    `compile` (runtime/compiled.py) traces a call to it instead of running torch.distributed."""
    return all_to_all(g, axis, "bwd")


for _op in (alltoall_alltoall, alltoall_bwd):
    _op.register_fake(lambda x, axis: torch.empty_like(x, memory_format=torch.contiguous_format))
    ops.mark_ordered(_op)  # every rank of the ep group issues its all-to-alls in the program's order
eager.register_autograd(alltoall_alltoall, lambda ctx, g: (eager.call("parc::alltoall_bwd", g, ctx.axis), None),
                        setup_context=_axis_ctx)  # and its eager twin (runtime/eager.py)


def localize(entry: dict, ep_rank: int) -> dict:
    """`entry` (a program of plan.json) with each expert state entry naming ep rank `ep_rank`'s expert."""
    if not entry.get("experts"):
        return entry
    state = [dict(e, fqn=e["ep_fqns"][ep_rank]) if "ep_fqns" in e else e for e in entry["state"]]
    return dict(entry, state=state)


class ExpertBuckets:
    """The dense buckets (over dp) and the expert buckets (over edp, divided by dp), driven as one."""

    def __init__(self, dense: GradBuckets, params: dict[str, Tensor], buckets: list[list[str]], ctx):
        self.dense = dense
        self.experts = GradBuckets(params, buckets, ctx.groups.get("edp"), len(ctx.group_ranks.get("edp", [0])),
                                   divisor=ctx.degree["dp"])

    def start_micro_batch(self, sync: bool) -> None:
        self.dense.start_micro_batch(sync)
        self.experts.start_micro_batch(sync)

    def finish(self) -> None:
        self.dense.finish()
        self.experts.finish()

    def zero(self) -> None:
        self.dense.zero()
        self.experts.zero()


def dense_params(params: dict[str, Tensor], entry: dict) -> dict[str, Tensor]:
    """`params` without the expert slots: what the dp group reduces and partitions."""
    experts = set(entry.get("experts") or ())
    return {n: p for n, p in params.items() if n not in experts}


class ExpertZero:
    """ZeRO 1–2 with expert parallelism: `dense` (a ZeroOptimizer over dp, of `dense_params`) and a
    second ZeroOptimizer of the expert slots cut over the edp group (plan.json `expert_zero`): the
    ranks holding the same experts split their optimizer state (and, stage 2, gradients) and
    reduce-scatter the experts' gradients among themselves, divided by dp (see `ExpertBuckets`).
    Every update is elementwise, so two optimizers update as one. Offers what the Trainer uses of
    a ZeroOptimizer; `grad_ranges` covers both, so a sum over dp counts each expert element once
    (its edp rank of its ep rank owns it) and each dense element once.
    Assumes: stage 1 or 2 (ZeRO-3 with ep is refused in parc/analysis/support.py)."""

    def __init__(self, dense: ZeroOptimizer, params: dict[str, Tensor], entry: dict, ctx, make_opt,
                 decay_of: dict[str, bool], compute_dtype, reduce_dtype):
        ranks = ctx.group_ranks.get("edp", [ctx.rank])
        experts = {n: params[n] for n in entry["experts"] if n in params}
        self.dense = dense
        self.experts = ZeroOptimizer(experts, entry["expert_zero"], ctx.groups.get("edp"), len(ranks),
                                     ranks.index(ctx.rank), make_opt, decay_of, compute_dtype=compute_dtype,
                                     reduce_dtype=reduce_dtype, divisor=ctx.degree["dp"])
        self.parts = (dense, self.experts)
        self.stage = dense.stage
        # one view of both optimizers' groups: schedule_lr.set_lr sets the lr of each; and whether they are
        # fused (both or neither: one make_opt over fp32 masters on one device), which says where a resume
        # puts their step counts (runtime/optim_step.py step_device)
        self.optimizer = SimpleNamespace(param_groups=dense.optimizer.param_groups +
                                         self.experts.optimizer.param_groups,
                                         _step_supports_amp_scaling=_fused(dense.optimizer))

    def start_micro_batch(self, sync: bool) -> None:
        for z in self.parts:
            z.start_micro_batch(sync)

    def finish(self) -> None:
        for z in self.parts:
            z.finish()

    def grad_ranges(self) -> dict[str, tuple[Tensor, int, int]]:
        return {**self.dense.grad_ranges(), **self.experts.grad_ranges()}

    def counts_in_norm(self) -> bool:
        """Every rank's ranges count in the norm: HSDP (a replicated shard) is refused with ep (parc/analysis/support.py)."""
        return self.dense.counts_in_norm()

    def master_grads(self) -> list[Tensor]:
        return self.dense.master_grads() + self.experts.master_grads()

    def step(self, found: Tensor | None = None) -> None:
        for z in self.parts:
            z.step(found)

    def zero(self) -> None:
        for z in self.parts:
            z.zero()

    @contextmanager
    def active(self):
        with ExitStack() as stack:
            for z in self.parts:
                stack.enter_context(z.active())
            yield

    def full_params(self) -> dict[str, Tensor]:
        """This rank's parameters whole, by placeholder name (its ep rank's experts: `gather_experts`)."""
        return {**self.dense.full_params(), **self.experts.full_params()}

    def full_grads(self) -> dict[str, Tensor]:
        """This rank's reduced gradients whole, by placeholder name (as `full_params`)."""
        return {**self.dense.full_grads(), **self.experts.full_grads()}

    def full_optimizer_state(self) -> tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]:
        """(per-parameter state whole, by placeholder name; scalar state), as ZeroOptimizer's: the dense
        ranges gathered over dp, then the experts' over edp (the same order on every rank). The two
        optimizers step together, so their scalars (Adam's `step`) are equal: the dense one's stand."""
        per, scalars = self.dense.full_optimizer_state()
        expert_per, expert_scalars = self.experts.full_optimizer_state()
        return {**per, **expert_per}, {**expert_scalars, **scalars}

    def load_full(self, params: dict[str, Tensor], optim: dict[str, dict[str, Tensor]],
                  scalars: dict[str, Tensor]) -> None:
        """Whole parameters and state by placeholder name; each part keeps its own names' ranges."""
        for z in self.parts:
            z.load_full(params, optim, scalars)

    @property
    def released_grad_bytes(self) -> int:
        """Both parts' gradient ranges the last step freed (runtime/parallel/zero.py `held`)."""
        return sum(z.released_grad_bytes for z in self.parts)

    def held(self) -> dict[str, list[Tensor]]:
        parts = [z.held() for z in self.parts]
        return {k: [t for h in parts for t in h[k]] for k in parts[0]}


def ep_norm_piece(grads: list[Tensor], ctx) -> Tensor:
    """Without ZeRO: a 0-dim tensor whose square is the sum of squares of the expert gradients of the
    whole ep group (each ep rank's `grads`, its experts'; edp replicas are equal after their sync, so
    they are not summed). `parc.runtime.parallel.grad_norm.global_norm` squares it with the dense pieces."""
    local = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for g in grads:
        local += g.detach().double().square().sum()
    sq = ops.all_reduce(local.float(), "ep", "step")  # one fp32 scalar, as global_norm sends per axis
    return sq.sqrt()


def gather_experts(entry: dict, state: list[Tensor], ctx) -> dict[str, Tensor]:
    """Every ep rank's experts by model FQN, on CPU (collective over the ep group)."""
    out = {}
    for e, t in zip(entry["state"], state):
        if "ep_fqns" not in e or e["kind"] != "param":
            continue
        parts = [torch.empty_like(t) for _ in e["ep_fqns"]]
        dist.all_gather(parts, t.detach().contiguous(), group=ctx.groups["ep"])
        out.update({fqn: _tp_whole(p, e["shard"], ctx).cpu() for fqn, p in zip(e["ep_fqns"], parts)})
    return out


def _tp_whole(t: Tensor, shard: dict | None, ctx) -> Tensor:
    """An expert's parameter whole from its tp shards (collective over the tp group; `t` itself if unsharded).
    The ep group of a rank holds its tp coordinate (parc/mesh.py), so `t` is shard `shard["index"]` of it."""
    if shard is None:
        return t
    parts = [torch.empty_like(t) for _ in range(shard["parts"])]
    dist.all_gather(parts, t.contiguous(), group=ctx.groups["tp"])
    return unshard(parts, shard)
