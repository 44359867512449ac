"""Context parallelism (mesh cp > 1) in the cost model: what `parc report` prices for a cp plan.

Start at `estimate`. A cp rank runs every op of the serial micro-batch on its T / cp tokens (the causal
load balancing of runtime/parallel/ring_attention.py gives each rank 1/cp of a causal attention's work
too), and holds the same parameters as the other cp ranks of its sample group. So the plan is priced as

- the same model on a mesh whose dp is dp × cp (`localize`): gradients are reduced over the dp × cp
  ranks (the `dp_cp` groups, with their real ranks, so intra/inter-node pricing sees where they sit) and
  ZeRO's state is cut over them (passes/zero.py), and
- one micro-batch's statistics divided by cp: FLOPs, activations kept, transient and recomputed bytes,
  matmul rows (their token dim m), attention rows (their batch × heads: T²/cp of the work at length T)
  and memory-bound traffic — activations / cp;

plus the cp traffic itself (`comms`), per rank per step, each attention of each micro-batch:

  ring:        forward  (cp−1) hops × K, V blocks                          b·h·(T/cp)·hs fp32 each
               backward (cp−1) hops × K, V, dK, dV blocks (each block's dK, dV summed on its way home:
               its owner keeps its own share, so cp − 1 transfers a block)
               (recomputed layers run the forward ring again in their backward)
  all-to-all:  forward 4 (q, k, v scattered by head, the output back), backward 7 (q, k, v and the output's
               gradient again, dQ, dK, dV back), each moving (cp−1)/cp of a b·h·(T/cp)·hs tensor
  all-gather:  another system's context parallelism (`parc report --cp-attention allgather`; Llama 3's, Dubey et
               al. 2024 §3.3.2: "we first all-gather the key (K) and value (V) tensors, and then compute attention
               output for the local query (Q) tensor chunk"): forward K and V all-gathered, backward K and V
               gathered again and dK, dV reduce-scattered, each (cp−1)/cp of a whole sequence's K (or V) of the
               rank's kv heads, b·h·T·hs / kv repeat (GQA's heads before their repetition, compute.kv_repeat),
               in the activations' dtype
  te-ring:     another system's ring (`parc report --cp-attention te-ring`: Transformer Engine's context
               parallelism with cp_comm_type "p2p", Megatron-core's and NeMo's default): the ring's hops and
               blocks, of the kv heads before GQA repeats them, in the activations' dtype, each hop posted
               before the block beside it computes

charged to the step, not overlapped: exact for the backward ring and the all-to-alls (they wait), an upper
bound for the forward ring, whose next hop is posted before the block computes. te-ring's hops are charged
only where they outlast the attention they run under: cp − 1 of every cp blocks of the rank's attention,
forward and backward (recomputed forwards included), pooled over the step (exact when hops and blocks are
alike).
"""

from __future__ import annotations

import math
from dataclasses import replace

from parc import mesh as meshlib
from parc.analysis import compute, cost, experts

RING_BYTES = 4  # the ring sends its K/V blocks and dK/dV accumulators in fp32 (ring_attention.py)
# statistics of one micro-batch that scale with its tokens (the rest: parameters, counts of tensors)
PER_TOKEN = ("flops", "act", "kept_bytes", "recompute_peak_bytes", "logits_elements", "tp_bytes")


def localize(plan, stats: dict) -> tuple[object, dict]:
    """(the plan as dp × cp data-parallel ranks, one cp rank's statistics): see the module docstring."""
    return as_data_parallel(plan), local_stats(stats, plan.mesh.cp)


def as_data_parallel(plan):
    """`plan` with its dp × cp ranks as dp, cp 1, the accumulation kept (the dp it was derived from is not dp');
    HSDP's `zero shard=K` becomes K · cp, the ranks its shard groups hold (parc/mesh.py `zero_groups`)."""
    m = plan.mesh
    batch = replace(plan.batch, accumulation=plan.accumulation)
    zero = replace(plan.zero, shard=plan.zero.shard * m.cp) if plan.zero.shard else plan.zero
    return replace(plan, mesh=replace(m, dp=m.dp * m.cp, cp=1), batch=batch, zero=zero)


def local_stats(stats: dict, cp: int) -> dict:
    """One cp rank's statistics of a micro-batch: the per-token counts and op rows over cp (`localize`)."""
    local: dict = {}   # id of a stage → its local stage: stages that are one dict (the planner's equal
    # stages, planner._Stats) stay one, so the cost model's memo of stage costs, by identity, prices them once
    for d in stats["stages"]:
        if id(d) not in local:
            local[id(d)] = _stage(d, cp)
    stages = [local[id(d)] for d in stats["stages"]]
    return dict(stats, stages=stages, send_elements=[e / cp for e in stats.get("send_elements") or []])


def _stage(d: dict, cp: int) -> dict:
    out = {k: (v / cp if k.startswith(PER_TOKEN) and isinstance(v, (int, float)) else v) for k, v in d.items()}
    ops = d.get("ops")
    if ops:
        ops = dict(ops)
        ops["mm"] = [[b, mm / cp, *rest] for b, mm, *rest in ops.get("mm", ())]
        ops["attn"] = [[bh / cp, *rest] for bh, *rest in ops.get("attn", ())]
        ops["mem"] = [[kind, nbytes / cp, *rest] for kind, nbytes, *rest in ops.get("mem", ())]
        out["ops"] = ops
    return out


def comms(plan, stats: dict, hw, allreduce: str, groups: list[list[int]] | None = None, system: str = "parc",
          local: dict | None = None, attention: str = "flash") -> tuple[list[cost.Comm], float, float]:
    """(the cp rows (module docstring), per rank per step, of the pp rank with the most attention traffic, the
    seconds of them the step waits for, the seconds those hidden under the attention add to it: `cost.beside`),
    from the serial statistics: with virtual stages a pp rank runs the
    chunks i ≡ its rank (mod pp). `groups`: the cp groups to price over (the planner passes one of each
    placement), else every cp group of the mesh. `system`: "parc" (the plan's method), or another system's
    context parallelism, "allgather" or "te-ring"; te-ring's hops hide under that rank's attention in `local`
    (one cp rank's statistics), timed with the `attention` kernel."""
    m, cp = plan.mesh, plan.mesh.cp
    ring = plan.context_parallel.method == "ring" if system == "parc" else system == "te-ring"
    act_b = 4 if plan.precision == "fp32" else 2
    acc = plan.accumulation
    per_stage = []
    for d in stats["stages"]:  # in stage order: chunk i runs on pp rank i mod pp
        volume, calls = 0.0, 0
        for bh, t, hs, causal, split, rec, repeat, count in compute.attn_rows(d.get("ops") or {}):
            block = bh / (m.tp if split and m.tp > 1 else 1) * (t / cp) * hs  # elements of one local K (or V)
            again = 2 if rec else 1  # a recomputed layer runs its forward communication again
            if system == "allgather":  # the whole sequence's K and V of the rank's kv heads: forward 2, backward 2 + 2
                volume += count * acc * (2 * again + 4) * block * cp / repeat * act_b
                calls += count * acc * (2 * again + 4)
            elif ring:  # forward (cp−1)·2 blocks; backward (cp−1)·4 (K, V and the dK, dV sums): parc's of the
                # repeated heads in fp32, Transformer Engine's of the kv heads in the activations' dtype
                size = RING_BYTES if system == "parc" else act_b / repeat
                volume += count * acc * ((cp - 1) * 2 * again + (cp - 1) * 4) * block * size
                calls += count * acc * (cp - 1) * (again + 1)
            else:  # 4 all-to-alls forward, 7 backward, each sending (cp−1)/cp of a block
                volume += count * acc * (4 * again + 7) * block * act_b
                calls += count * acc * (4 * again + 7)
        per_stage.append((volume, calls))
    per_rank = [(sum(v for v, _ in per_stage[r::m.pp]), sum(c for _, c in per_stage[r::m.pp]), r)
                for r in range(min(m.pp, len(per_stage)))]
    volume, calls, busiest = max(per_rank, default=(0.0, 0, 0))
    if not calls:
        return [], 0.0
    groups = groups or meshlib.groups(m, "cp")
    if system == "allgather":  # `volume` the gathered sizes: the collective prices their (cp−1)/cp
        rows = [cost._collective("cp", "all-gather", cp, volume, groups, hw, allreduce,
                                 latency_steps=calls * (cp - 1), calls=calls)]
    elif ring:
        rows = [cost._collective("cp", "send/recv", 2, volume, groups, hw, allreduce, latency_steps=calls,
                                 calls=calls)]
    else:
        row = cost._collective("cp", "all-gather", cp, volume, groups, hw, allreduce, latency_steps=calls * (cp - 1),
                               calls=calls)  # all-gather's (cp−1)/cp of the volume: what an all-to-all sends
        rows = [replace(row, collective="all-to-all")]
    waited = sum(r.seconds for r in rows)
    if system == "te-ring" and local is not None:
        dtype = "fp32" if plan.precision == "fp32" else "bf16"
        under = 0.0   # the busiest rank's attention a step, forward and backward, cp − 1 of every cp blocks
        for d in local["stages"][busiest::m.pp]:
            if compute.has_model(hw, d):
                f, b = compute.stage_seconds({"attn": (d.get("ops") or {}).get("attn", ())}, hw, dtype, m.tp,
                                             attention)
                under += acc * (f + b) * (cp - 1) / cp
        # what the attention hides slows it (`cost.beside`)
        waited, slowed = max(0.0, waited - under), cost.beside(hw, min(waited, under))
        return rows, waited, slowed
    return rows, waited, 0.0


def groups_of(mesh, lazily: bool = False) -> dict[str, list[list[int]]]:
    """The groups a cp plan is priced over: "dp" the dp × cp ranks that reduce gradients together, "cp" the rings.
    `lazily`: each mesh axis's as `meshlib.iter_groups` yields them (for a caller that keeps a few)."""
    axis = meshlib.iter_groups if lazily else meshlib.groups
    return {"dp": meshlib.dp_cp_groups(mesh), **{a: axis(mesh, a) for a in ("pp", "tp", "cp")}}


def estimate_plan(plan, stats: dict, hw, *, allreduce: str = "ring", params_per_rank=None, cp_attention: str = "parc",
                  **options) -> cost.Estimate:
    """The cost model's estimate of any plan from the serial model's statistics: a cp plan's through `estimate`
    (each rank on T/cp tokens), another's through `cost.estimate`; without `params_per_rank` (an artifact's),
    an ep rank holds its own experts (`experts.params_per_rank`). What `parc report` prices and `parc check`
    measures memory by, so the two cannot disagree on whether a plan fits."""
    if params_per_rank is None and stats.get("experts") is not None:
        params_per_rank = experts.params_per_rank(stats["experts"], plan.mesh.ep)
    if plan.mesh.cp > 1:
        return estimate(plan, stats, hw, allreduce=allreduce, params_per_rank=params_per_rank,
                        cp_attention=cp_attention, **options)
    return cost.estimate(plan, stats, hw, allreduce=allreduce, params_per_rank=params_per_rank, **options)


def estimate(plan, stats: dict, hw, *, allreduce: str = "ring", params_per_rank=None, groups: dict | None = None,
             local: dict | None = None, cp_attention: str = "parc", **options) -> cost.Estimate:
    """The cost model's estimate of a cp plan (module docstring): the dp × cp pricing, the cp rows on the step.
    `groups`: `groups_of(plan.mesh)`, or one group of each placement of them (a planner's). `local`:
    `local_stats(stats, cp)` when the caller keeps it (a planner's, so that its memo sees the same dicts).
    `options`: cost.estimate's own (another system's run: `report.System.estimate_options`; `schedules`)."""
    priced, local = (as_data_parallel(plan), local) if local is not None else localize(plan, stats)
    m = plan.mesh
    groups = groups or groups_of(m)
    est = cost.estimate(priced, local, hw, allreduce=allreduce, params_per_rank=params_per_rank,
                        groups={a: groups[a] for a in ("dp", "pp", "tp")}, **options)
    if math.isinf(est.step_seconds):   # over `memory_limit`: memory only, nothing timed
        return est
    est = replace(est, comms=[replace(c, axis="dp×cp") if c.axis == "dp" else c for c in est.comms])
    rows, waited, slowed = comms(plan, stats, hw, allreduce, groups["cp"], system=cp_attention, local=local,
                                 attention=options.get("attention", "flash"))
    est = cost.on_step(est, rows, "cp_seconds", exposed=waited) if rows else est
    if slowed:   # on the step beside the ring's exposed part, as `cost.estimate` adds what its own hidden traffic costs
        beside = est.beside_seconds + slowed
        est = replace(est, step_seconds=est.step_seconds + slowed, beside_seconds=beside,
                      mfu=est.mfu * est.step_seconds / (est.step_seconds + slowed),
                      notes=[n for n in est.notes if not n.startswith(cost.BESIDE)] + [cost.beside_note(hw, beside)])
    ring = plan.context_parallel.method == "ring" and cp_attention == "parc"
    method = {"allgather": "all-gather, another system's", "te-ring": "Transformer Engine's ring, another system's"
              }.get(cp_attention, plan.context_parallel.method)
    est.notes.append(
        f"context parallelism cp {m.cp} ({method}): each rank computes and keeps the "
        f"activations of T/{m.cp} tokens of every sample; gradients reduce over dp {m.dp} × cp {m.cp} = "
        f"{m.dp * m.cp} ranks (ZeRO shards over them); "
        + ("K and V all-gathered per attention forward, gathered again and their gradients reduce-scattered "
           "backward, at their kv heads (before GQA's repetition), are charged to the step, not overlapped"
           if cp_attention == "allgather" else
           "the ring's K/V blocks ((cp−1) hops forward, (cp−1) hops of K/V and dK/dV backward) at their kv heads "
           "(before GQA's repetition) in the activations' dtype run under the attention's blocks (cp−1 of every "
           "cp); what they outlast is charged to the step" if cp_attention == "te-ring" else
           "the ring's K/V blocks ((cp−1) hops forward, (cp−1) hops of K/V and dK/dV backward, fp32) are charged to "
           "the step, not overlapped (an upper bound for the forward ring, whose hops are posted before each block "
           "computes)" if ring else "4 all-to-alls per attention forward and 7 backward are charged to the step, "
           "not overlapped"))
    return est
