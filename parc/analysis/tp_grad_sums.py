"""The price of the gradient sums tensor parallelism inserts (passes/tp_grads.py), for `parc report`.

Start at `section`. A replicated value computed with on tp-sharded values gets only its slice's share of
the gradient on each tp rank; the compiler completes each such gradient and lists it in plan.json
(`programs.<name>.tp_grad_reductions`):

- "per step": a parameter all of whose uses are such (a q/k norm's weight on head-sharded values, a
  LayerNorm weight on a sequence slice): its accumulated fp32 gradient is all-reduced over tp once a
  step, all of them in one flat buffer (runtime/parallel/tensor_parallel.py), after the backward;
- "per micro-batch": Megatron's f before the op (an activation, or a parameter that also meets
  replicated values): an all-reduce of that value's gradient in every micro-batch's backward, in the
  compute dtype, on the critical path like tp's other collectives.

- a replicated value that enters a sharded region keeps this rank's chunk (`parc.split_allgather`: a norm's
  weight over a sharded hidden, a per-head mask, the repeated k and v of a layer kept whole for its few
  kv heads): its gradient is all-gathered over tp in every micro-batch's backward
  (`programs.<name>.tp_grad_gathers`).

A k/v layer with fewer kv heads than tp (`programs.<name>.tp_auto_replicated`) runs more than 1/tp of its
matmul on every rank: one kv head of its K in Megatron's kv-subset form (passes/tp_subset.py; its weight's
gradient is then a "per step" sum above), all K when kept whole (passes/tp_gqa.py). `replicated_compute`
prices the (heads_per_rank / K − 1/tp) of it the analytic model counts as split.

All are charged to the step, not overlapped. The numbers are those of the busiest pp rank's programs
(all tp ranks of a stage insert the same sums). The analytic report (--model and --plan, no compile)
does not run the pass, so it cannot see them: it says so.
"""

from __future__ import annotations

import dataclasses

from parc import mesh as meshlib
from parc.analysis.cost import _collective, on_step


def section(pj: dict, plan, hw, allreduce: str):
    """(rows, elements per step, elements per micro-batch) of the busiest pp rank; rows empty if none."""
    pp, tp = pj["mesh"]["pp"], plan.mesh.tp
    if tp == 1:
        return [], 0, 0
    per_rank: dict[int, list[int]] = {}
    for prog in pj["programs"].values():
        if prog.get("tp_rank", 0) != 0:
            continue
        sums = per_rank.setdefault(prog["stage"] % pp, [0, 0, 0, 0, 0])
        for r in prog.get("tp_grad_reductions", []):
            if r["how"] == "per step":
                sums[0] += r["numel"]
            else:
                sums[1] += r["numel"]
                sums[2] += 1
        for r in prog.get("tp_grad_gathers", []):
            sums[3] += r["numel"]
            sums[4] += 1
    if not per_rank:
        return [], 0, 0
    step_el, micro_el, fs, gathered, gs = max(per_rank.values(), key=lambda s: 4 * s[0] + 2 * s[1] + s[3])
    groups = meshlib.groups(plan.mesh, "tp")
    act_b = 4 if plan.precision == "fp32" else 2
    acc = plan.accumulation
    rows = []
    if step_el:
        rows.append(_collective("tp", "all-reduce", tp, step_el * 4, groups, hw, allreduce, calls=1))
    if micro_el:
        rows.append(_collective("tp", "all-reduce", tp, micro_el * act_b * acc, groups, hw, allreduce,
                                calls=fs * acc))
    if gathered:
        rows.append(_collective("tp", "all-gather", tp, gathered * act_b * acc, groups, hw, allreduce,
                                calls=gs * acc))
    return rows, step_el, micro_el


def replicated_compute(pj: dict, plan, hw) -> tuple[float, list[str]]:
    """(seconds per step, names) of the k/v layers with fewer kv heads than tp, on the busiest pp rank: each
    rank runs the (heads_per_rank / heads − 1/tp) of their forward and backward matmuls that a layer split by
    tp would not (heads_per_rank: 1 in the kv-subset form, every head when kept whole)."""
    pp, tp = pj["mesh"]["pp"], plan.mesh.tp
    flops: dict[int, float] = {}
    names: list[str] = []
    for prog in pj["programs"].values():
        if prog.get("tp_rank", 0) != 0:
            continue
        for r in prog.get("tp_auto_replicated", []):
            share = r.get("heads_per_rank", r["heads"]) / r["heads"] - 1 / tp
            flops[prog["stage"] % pp] = flops.get(prog["stage"] % pp, 0.0) + r["flops"] * share
            names.append(r["module"])
    if not flops:
        return 0.0, []
    peak = hw.flops.get(plan.precision, hw.flops["fp32"]) * hw.achievable
    return max(flops.values()) * plan.accumulation / peak, names


def charge(est, rows):
    """`est` with the sums' time on the step and their rows (named apart from tp's activation all-reduces)."""
    return on_step(est, [dataclasses.replace(c, collective=f"{c.collective} (partial gradients)") for c in rows],
                   "tp_seconds")


def charge_compute(est, seconds: float):
    """`est` with `seconds` more compute on the step (the matmuls of layers kept whole), MFU on the longer step."""
    step = est.step_seconds + seconds
    return dataclasses.replace(est, step_seconds=step, compute_seconds=est.compute_seconds + seconds,
                               mfu=est.mfu * est.step_seconds / step if step else 0.0)
