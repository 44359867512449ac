"""A calibrated CPU host in the cost model (issue 14, 4a): collectives priced per call as measured under
load, ZeRO's calls per bucket, per-kind op overheads and views, the optimizer's per-tensor loop, and
compute contention (parc/analysis/cost.py, compute.py, calibrate.py).

Hand-made presets where a figure can be worked out by hand; the tiny GPT (examples/gpt.py) where the
traced graph matters. The shipped GPU presets carry none of these fields, so their predictions are
unchanged (tests/test_cost_h200.py holds them).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from parc.analysis import compute, cost
from parc.grammar.parser import parse

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"

# (kind, n, bytes, compute between calls, seconds per call): two sizes at two gaps
ROWS = (("all-reduce", 4, 1000, 1e-3, 4e-3), ("all-reduce", 4, 11000, 1.2e-3, 6e-3),
        ("all-reduce", 4, 1000, 20e-3, 8e-3), ("all-reduce", 4, 11000, 19e-3, 10e-3),
        ("all-gather", 4, 1000, 1e-3, 2e-3), ("all-gather", 4, 11000, 1e-3, 3e-3),
        ("all-gather", 4, 1000, 21e-3, 3e-3), ("all-gather", 4, 11000, 21e-3, 4e-3),
        ("reduce-scatter", 4, 1000, 1e-3, 5e-3), ("reduce-scatter", 4, 11000, 1e-3, 5e-3))


def _cpu(**over) -> cost.Hardware:
    hw = replace(cost.hardware("h100"), gpus_per_node=1024, async_launch=False, collectives=ROWS, cores=4)
    return replace(hw, **over)


@pytest.fixture(scope="module")
def traced():
    from parc.trace import load_user_module, trace

    return trace(load_user_module(GPT), 2)


def _graph(traced, text):
    from parc.passes.pipeline_split import assign_stages

    plan = parse(text)
    assign_stages(traced, plan, plan.mesh.pp)
    return plan, cost.graph_stats(traced, plan)


# ---------------------------------------------------------------- measured collectives


def test_measured_call_by_size_and_gap():
    rows = [r[2:] for r in ROWS if r[0] == "all-reduce"]
    assert cost.measured_call(rows, 1000, 0.0) == pytest.approx(4e-3)          # below the shortest gap: its
    assert cost.measured_call(rows, 500, 0.0) == pytest.approx(4e-3)           # below the smallest size: the fixed part
    assert cost.measured_call(rows, 6000, 0.0) == pytest.approx(5e-3)          # halfway in size
    assert cost.measured_call(rows, 21000, 0.0) == pytest.approx(8e-3)         # on along the last slope
    # the two gap levels sit at their sizes' mean gap: 1.1 ms and 19.5 ms
    assert cost.measured_call(rows, 1000, 1.1e-3 + 9.2e-3) == pytest.approx(6e-3)   # halfway in gap
    assert cost.measured_call(rows, 1000, 1.0) == pytest.approx(8e-3)          # beyond the longest gap: its


def test_collective_priced_per_call_from_the_table():
    hw = _cpu()
    # 8 calls of 1000 bytes each: 8 × the measured call, not one call of 8000 bytes
    ag = cost._collective("dp", "all-gather", 4, 8000, [[0, 1, 2, 3]], hw, "ring", calls=8, gap=1e-3)
    assert ag.seconds == pytest.approx(8 * 2e-3)
    one = cost._collective("dp", "all-gather", 4, 8000, [[0, 1, 2, 3]], hw, "ring", calls=1, gap=1e-3)
    assert one.seconds == pytest.approx(2e-3 + 1e-3 * 7000 / 10000)
    # no row at this group size (or kind): the ring formula, as for every shipped preset
    pair = cost._collective("tp", "all-reduce", 2, 8000, [[0, 1]], hw, "ring", calls=2)
    plain = cost._collective("tp", "all-reduce", 2, 8000, [[0, 1]], replace(hw, collectives=()), "ring", calls=2)
    assert pair.seconds == pytest.approx(plain.seconds)
    assert not any(h.collectives or h.op_overheads or h.optimizer_per_tensor for h in cost.PRESETS.values())


def test_zero3_prices_a_call_per_bucket_per_micro_batch(traced):
    """runtime/parallel/zero.py gathers every bucket (one per layer or top-level module) in each micro-batch's
    forward and backward and reduce-scatters it in each backward: one collective call each."""
    from parc.passes import zero

    plan, stats = _graph(traced, "mesh dp=4\nbatch global=16 micro=2\nzero stage=3\noptimizer adamw\n")
    (s,) = stats["stages"]
    params = [p for p in traced.state if p.kind == "param" and p.requires_grad]
    table = zero.partition(traced.gm, traced.state, {}, 3, 4)
    assert s["zero_units"] == len(table["buckets"]) == 8     # wte, wpe, 4 blocks, ln_f, lm_head
    assert s["param_tensors"] == len(params)
    hw = _cpu()
    est = cost.estimate(plan, stats, hw)
    rs, ag = est.comms
    assert any(n.startswith("collectives: each call priced as calibrated") for n in est.notes)
    acc, per_call = 2, s["params_replicated"] * 4 / 8     # fp32: 4 bytes a parameter, 8 buckets
    # the step's compute over its 3 × acc × 8 calls: under the shortest measured gap
    assert est.compute_seconds / (3 * acc * 8) < 1e-3
    rows = {k: [r[2:] for r in ROWS if r[0] == k] for k in ("reduce-scatter", "all-gather")}
    assert rs.seconds == pytest.approx(acc * 8 * cost.measured_call(rows["reduce-scatter"], per_call, 0.0))
    assert ag.seconds == pytest.approx(2 * acc * 8 * cost.measured_call(rows["all-gather"], per_call, 0.0))
    # before: one call of the whole step's bytes; now 31 calls more, each its fixed part (the rows' intercept,
    # 2 ms − 1000 B × 1e-7 s/B)
    once = cost.measured_call(rows["all-gather"], 2 * acc * 8 * per_call, 0.0)
    assert ag.seconds - once == pytest.approx((2 * acc * 8 - 1) * 1.9e-3)


# ---------------------------------------------------------------- compute on a CPU


def test_per_kind_overheads_and_views():
    hw = _cpu(op_overheads=(("mm", 1e-5, 3e-5), ("attn", 2e-5, 5e-5), ("mem", 4e-6, 9e-6), ("view", 1e-6, 2e-6)),
              op_overhead=1.0, mem_bw=1e30, flops={"fp32": 1e30, "bf16": 1e30})
    ops = {"mm": [[1, 4, 4, 4, 0, 0, 2]], "attn": [[2, 4, 4, 1, 0, 0, 1]], "mem": [[64, 0, 1, 3]], "views": 5}
    f, b = compute.stage_seconds(ops, hw, "fp32", 1)
    # the work is nothing: each op its kind's overhead (not op_overhead), a recomputed op its forward again
    assert f == pytest.approx(2 * 1e-5 + 2e-5 + 3 * 4e-6 + 5 * 1e-6)
    assert b == pytest.approx(2 * 3e-5 + 5e-5 + 3 * (9e-6 + 4e-6) + 5 * 2e-6)
    # merged and scaled tables keep their views (the planner's per-layer groups)
    merged = compute.merge_ops([ops, ops])
    assert merged["views"] == 10 and compute.scale_ops(merged, 4)["views"] == 10


def test_views_counted_in_the_op_table(traced):
    _, stats = _graph(traced, "mesh dp=1\n")
    (s,) = stats["stages"]
    assert s["ops"]["views"] > 0   # q/k/v split, view and transpose, the reshape back, …


def test_optimizer_loops_over_tensors(traced):
    plan, stats = _graph(traced, "mesh dp=4\nbatch global=8 micro=2\noptimizer adamw\n")
    hw = _cpu(cores=8)   # no core sharing: the optimizer's time as it is
    a = cost.estimate(plan, stats, hw).optimizer_seconds
    b = cost.estimate(plan, stats, replace(hw, optimizer_per_tensor=1e-4)).optimizer_seconds
    assert b - a == pytest.approx(stats["stages"][0]["param_tensors"] * 1e-4)
    z = parse("mesh dp=4\nbatch global=8 micro=2\nzero stage=1\noptimizer adamw\n")
    za = cost.estimate(z, stats, hw).optimizer_seconds
    zb = cost.estimate(z, stats, replace(hw, optimizer_per_tensor=1e-4)).optimizer_seconds
    assert zb - za == pytest.approx(stats["stages"][0]["zero_units"] * 1e-4)   # one flat range per bucket


def test_contention_beyond_core_sharing(traced):
    plan, stats = _graph(traced, "mesh dp=4\nbatch global=8 micro=2\n")
    own = cost.estimate(plan, stats, _cpu(cores=4, contention=1.5)).compute_seconds   # 4 ranks, 4 cores
    shared = cost.estimate(plan, stats, _cpu(cores=2, contention=1.0)).compute_seconds
    contended = cost.estimate(plan, stats, _cpu(cores=2, contention=1.5)).compute_seconds
    assert shared == pytest.approx(2 * own)          # ranks / cores
    assert contended == pytest.approx(3 * own)       # × the measured contention, only when cores are shared
    # below 1 it is noise between calibrate's two probes: ranks sharing a core do not outrun their share of it
    assert cost.estimate(plan, stats, _cpu(cores=2, contention=0.86)).compute_seconds == pytest.approx(shared)


def test_in_step_scales_the_tables_and_adds_the_runtime_overhead(traced):
    """A calibrated `in_step` (calibrate_step.py): a step's forward, backward and optimizer are the tables'
    price times the factors measured in place; `step_overhead` adds the runtime's own time per micro-batch and
    per step. Neutral (the shipped presets' defaults), the estimate is the tables' price."""
    plan, stats = _graph(traced, "mesh dp=1\nbatch global=8 micro=2\noptimizer adamw\n")
    hw = _cpu(cores=8)
    (stage,) = stats["stages"]
    f, b = compute.stage_seconds(stage["ops"], hw, "fp32", 1)
    base = cost.estimate(plan, stats, hw)
    assert base.step_seconds - base.optimizer_seconds == pytest.approx(4 * (f + b))   # 4 micro-batches
    got = cost.estimate(plan, stats, replace(hw, in_step=(2.0, 3.0, 5.0), step_overhead=(1e-3, 2e-4)))
    assert got.step_seconds - got.optimizer_seconds == pytest.approx(4 * (2 * f + 3 * b + 2e-4))
    assert got.optimizer_seconds == pytest.approx(5 * base.optimizer_seconds + 1e-3)
    assert any(n.startswith("in a step (calibrated in place): forward ×2.00") for n in got.notes)
    assert not any(n.startswith("in a step") for n in base.notes)


def test_pipeline_posts_on_the_posters_timeline():
    """A calibrated `p2p_post`: each F and B of a pipeline stage pays one post (the executor batches a run of
    sends/receives per action), and the measured hop gives up the sender's post it held."""
    plan = parse("mesh pp=2\nbatch global=8 micro=1\npipeline schedule=1f1b\n")
    stats = {"stages": [dict.fromkeys(("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded",
                                       "act_replicated", "kept_bytes_sharded", "kept_bytes_replicated",
                                       "params_sharded", "params_replicated", "tp_bytes", "tp_ops",
                                       "recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated"), 0)
                        for _ in range(2)],
             "send_elements": [250], "param_count": 0, "tokens_per_sample": 8}
    for d in stats["stages"]:
        d["flops_replicated"] = 1e9
    hw = replace(cost.hardware("h100"), gpus_per_node=1024, async_launch=False,
                 collectives=(("send/recv", 2, 1000, 1e-3, 3e-3),))
    base = cost.estimate(plan, stats, hw)
    posted = cost.estimate(plan, stats, replace(hw, p2p_post=1e-3))
    from parc.passes.schedule import build_schedule
    from parc.passes.simulate import simulate

    f = 1e9 / (hw.flops["fp32"] * hw.achievable)
    sched = build_schedule("1f1b", 2, 8)
    assert base.step_seconds - base.optimizer_seconds == pytest.approx(
        simulate(sched, cost_f=f, cost_b=2 * f, cost_comm=3e-3).makespan)
    assert posted.step_seconds - posted.optimizer_seconds == pytest.approx(
        simulate(sched, cost_f=f + 1e-3, cost_b=2 * f + 1e-3, cost_comm=2e-3).makespan)
