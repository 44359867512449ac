"""`parc report` prices ZeRO's collectives as runtime/parallel/zero.py overlaps them ("Overlap"), in the
dtype they move, and counts the working set it keeps in flight (issue 25, item 2).

Hand-made statistics where the seconds can be worked out by hand (FLOPs at the preset's efficiency,
ring formulas); examples/gpt.py through `report.build` for the bytes and the memory rows.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from parc.analysis import cost, report
from parc.grammar.parser import parse
from parc.trace import load_user_module
from helpers import GPT

H100 = cost.hardware("h100")
UNITS = 10


def _stats(flops: float, psi: int) -> dict:
    """One stage: `flops` forward FLOPs per micro-batch, `psi` replicated parameters in UNITS buckets."""
    keys = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
            "kept_bytes_sharded", "kept_bytes_replicated", "params_sharded", "params_replicated", "tp_bytes",
            "tp_ops", "recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated")
    d = dict.fromkeys(keys, 0)
    d.update(flops_replicated=flops, params_replicated=psi, zero_units=UNITS, zero_unit_max=psi // UNITS)
    return {"stages": [d], "send_elements": [], "param_count": psi, "tokens_per_sample": 8}


def _ring(n: int, size: float, calls: int) -> float:
    """Seconds of `calls` ring reduce-scatters or all-gathers of `size` bytes in all, one node (NVLink): each
    call walks its ring's n − 1 steps, each step paying NVLink's latency."""
    return (n - 1) / n * size / H100.intra_bw + (n - 1) * calls * H100.latency_intra


def _windows(flops: float, stage: int = 1, psi: int = 0) -> tuple[float, float]:
    """One micro-batch's forward and backward at the preset's efficiency (compute.fallback); under ZeRO-2/3 the
    backward also lays the whole bf16 gradient out for its reduce-scatter: cat (2 read + 2 written), fp32 cast
    (2 + 4), the divide by dp (4 + 4): 18 bytes a parameter over the memory bandwidth."""
    f = flops / (H100.flops["bf16"] * H100.achievable)
    return f, 2 * f + (18 * psi / H100.mem_bw if stage >= 2 else 0.0)


def _hide(seconds: float, window: float) -> float:
    return max(seconds - window, seconds / UNITS)


@pytest.mark.parametrize("flops", [1e12, 1e14])   # communication longer than compute, then shorter
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_exposed_seconds_by_hand(stage, flops):
    dp, acc, psi = 8, 4, 2_000_000_000
    plan = parse(f"mesh dp={dp}\nbatch global={dp * acc} micro=1\nzero stage={stage}\nprecision bf16\n")
    est = cost.estimate(plan, _stats(flops, psi), H100)
    rs, ag = est.comms
    f, b = _windows(flops, stage, psi)
    # bytes: the reduce-scatter moves fp32 (runtime: `reduce_dtype` None), the gathers the bf16 compute copy
    sends = acc if stage >= 2 else 1
    gathers = 2 * acc if stage == 3 else 1
    assert rs.bytes == pytest.approx((dp - 1) / dp * psi * 4 * sends)
    assert ag.bytes == pytest.approx((dp - 1) / dp * psi * 2 * gathers)
    assert rs.seconds == pytest.approx(_ring(dp, psi * 4 * sends, sends * UNITS))
    assert ag.seconds == pytest.approx(_ring(dp, psi * 2 * gathers, gathers * UNITS))
    if stage == 1:    # one reduce-scatter under the last backward; the gather under the next forward
        want = _hide(rs.seconds, b) + _hide(ag.seconds, f)
    elif stage == 2:  # a reduce-scatter under each micro-batch's backward
        want = acc * _hide(rs.seconds / acc, b) + _hide(ag.seconds, f)
    else:             # per micro-batch: a gather under forward; a gather and a reduce-scatter under backward
        g = ag.seconds / (2 * acc)
        want = acc * (_hide(g, f) + _hide(g + rs.seconds / acc, b))
    assert est.dp_exposed_seconds == pytest.approx(want)
    assert est.dp_exposed_seconds < rs.seconds + ag.seconds          # something is hidden
    # and what is hidden slows the compute it runs under (`cost.beside`: the preset's overlap_slowdown)
    s = H100.overlap_slowdown
    beside = (rs.seconds + ag.seconds - want) * s / (1 + s)
    assert s > 0 and est.beside_seconds == pytest.approx(beside)
    assert est.step_seconds == pytest.approx(acc * (f + b) + want + beside + est.optimizer_seconds)
    assert any(n.startswith(cost.BESIDE) and f"{beside:.3g} s" in n for n in est.notes)
    # a device whose compute does not slow beside a collective (a preset file's `overlap_slowdown` 0, as `parc
    # calibrate` writes on a CPU, where gloo's measured calls carry their own): hidden traffic is free again
    free = cost.estimate(plan, _stats(flops, psi), replace(H100, overlap_slowdown=0.0))
    assert free.beside_seconds == 0 and not any(n.startswith(cost.BESIDE) for n in free.notes)
    assert free.step_seconds == pytest.approx(est.step_seconds - beside)


def test_compiled_zero1_overlaps_its_gathers_as_eager_does():
    """Under `compile` the program waits for each post-step gather before its layer, as eager does (the wait op
    declares that it writes the weights: runtime/parallel/zero.py `zero_wait_gather_into`): priced alike."""
    dp, psi, flops = 8, 2_000_000_000, 1e14
    eager = cost.estimate(parse(f"mesh dp={dp}\nbatch global={dp} micro=1\nzero stage=1\n"), _stats(flops, psi), H100)
    compiled = cost.estimate(parse(f"mesh dp={dp}\nbatch global={dp} micro=1\nzero stage=1\ncompile aot_eager\n"),
                             _stats(flops, psi), H100)
    ag = eager.comms[1].seconds
    assert ag > 0 and compiled.dp_exposed_seconds == pytest.approx(eager.dp_exposed_seconds)


def test_reduce_bf16_halves_the_reduce_scatter_only():
    """`reduce=bf16`: the reduce-scatter moves bf16 (2 bytes), as runtime/parallel/zero.py `_reduce_scatter`."""
    dp, acc, psi = 8, 2, 1_000_000
    text = f"mesh dp={dp}\nbatch global={dp * acc} micro=1\nzero stage=2\nprecision bf16"
    fp32 = cost.estimate(parse(text + "\n"), _stats(1e12, psi), H100).comms
    bf16 = cost.estimate(parse(text + " reduce=bf16\n"), _stats(1e12, psi), H100).comms
    assert bf16[0].bytes == pytest.approx(fp32[0].bytes / 2) == pytest.approx((dp - 1) / dp * psi * 2 * acc)
    assert bf16[1].bytes == fp32[1].bytes


def _largest_block() -> int:
    """examples/gpt.py's largest ZeRO bucket, counted from the model: one transformer block."""
    model = load_user_module(GPT).build_model()
    return max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks)


@pytest.mark.parametrize("stage", [2, 3])
def test_report_rows_for_zero_by_hand(tmp_path, stage):
    """examples/gpt.py, dp 4, accumulation 2, bf16: communication rows and the in-flight memory by hand."""
    dp, acc = 4, 2
    path = tmp_path / "z.par"
    path.write_text(f"mesh dp={dp}\nbatch global={2 * dp * acc} micro=2\nzero stage={stage}\nprecision bf16\n")
    rep = report.build(model=GPT, plan=path)
    psi = rep["memory"]["per_pp_rank"][0]["params_count"]
    assert psi == sum(p.numel() for p in load_user_module(GPT).build_model().parameters())
    rows = {r["collective"]: r for r in rep["communication"]["rows"]}
    sends, gathers = acc, (2 * acc if stage == 3 else 1)
    assert rows["reduce-scatter"]["bytes_per_rank"] == round((dp - 1) / dp * psi * 4 * sends)
    assert rows["all-gather"]["bytes_per_rank"] == round((dp - 1) / dp * psi * 2 * gathers)
    block = _largest_block()
    row = rep["memory"]["per_pp_rank"][0]
    # one fp32 bucket gradient being reduce-scattered (runtime/parallel/zero.py REDUCE_SCATTERS_IN_FLIGHT);
    # ZeRO-3 also two gathered bf16 layers
    assert row["zero_working_bytes"] == block * 4 + (2 * block * 2 if stage == 3 else 0)
    assert row["total_bytes"] == pytest.approx(sum(row[f"{k}_bytes"] for k in
                                                   ("params", "grads", "optimizer", "activations", "zero_working")),
                                               abs=2)
    note = next(n for n in rep["notes"] if n.startswith("communication:"))
    assert f"ZeRO-{stage}'s reduce-scatters overlap" in note
    assert rep["communication"]["exposed_seconds"] < rows["reduce-scatter"]["seconds"] + rows["all-gather"]["seconds"]


@pytest.mark.parametrize("grad_b, wire_b, low_acc, want", [
    (2, 4, False, 2 * 2 + (2 + 4) + 2 * 4),          # bf16, fp32 reduction (the default): 18
    (2, 2, False, 2 * 2 + (2 + 4) + 2 * 4 + (4 + 2)),  # `reduce=bf16`: cast back for the wire: 24
    (2, 2, True, 2 * 2 + 2 * 2),                      # `accumulate=bf16` (ZeRO-2): no fp32 copy: 8
    (4, 4, False, 2 * 4 + 2 * 4),                     # fp32: the cat and the divide: 16
])
def test_zero_gradient_layout_bytes_by_hand(grad_b, wire_b, low_acc, want):
    """ZeRO-2/3's copies of a micro-batch's whole gradient before its reduce-scatter (runtime/parallel/zero.py
    `_flat_grad`, `_reduce_scatter`): each op's bytes read and written, over the preset's memory bandwidth, on
    every parameter of the stage, not on the rank's shard."""
    from parc.analysis import compute

    psi = 1_000_000_000
    seconds = compute.zero_grad_seconds(H100, psi, grad_b, wire_b, low_acc)
    assert seconds == pytest.approx(want * psi / H100.mem_bw)


def test_zero3_backward_pays_the_gradient_layout_of_every_micro_batch():
    """Through `cost.estimate`: ZeRO-3's compute holds 18 bytes a parameter a micro-batch beyond the fallback's
    FLOPs (dp 1: no collectives; the copy into the shard stands in for the divide)."""
    psi, acc = 2_000_000_000, 4
    plan = parse(f"mesh dp=1\nbatch global={acc} micro=1\nzero stage=3\nprecision bf16\n")
    est = cost.estimate(plan, _stats(1e14, psi), H100)
    f, b = _windows(1e14)
    assert est.compute_seconds == pytest.approx(acc * (f + b + 18 * psi / H100.mem_bw))
