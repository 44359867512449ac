"""FlashAttention written in Triton (`parc report --attention flash-triton`, issue 27: MosaicML's MPT runs used
llm-foundry's attn_impl "triton"): priced as the flash kernel at the attention table's efficiency divided by the
FlashAttention-2 paper's measured ratios (§4.1, A100: FlashAttention-2 "around 1.3-1.5× faster than FlashAttention
in Triton in the forward pass and around 2× faster in the backward pass"), 1.4 forward and 2 backward. Derived by
hand from the a100 preset's table; then the report: only attention changes, by exactly that difference, and the
report says so. Analytic only (tracing on meta, no ranks): about a second."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import sized_report
from parc.analysis import compute, cost


def test_triton_attention_by_hand():
    """One causal attention of 16 heads at T 8192, head size 128, recomputed: the a100 table's entry there is
    FlashAttention-2's 200 TFLOP/s forward + backward (of 312), the forward 4·bh·T²·hs / 2 FLOPs, the backward
    2.5× that; Triton's forward 1.4× and backward 2× slower, and the recompute runs Triton's forward again."""
    hw = replace(cost.hardware("a100"), op_overhead=0.0)
    ops = {"attn": [[16, 8192, 128, True, 0, True, 1]]}
    flops = 4 * 16 * 8192 ** 2 * 128 / 2
    rate = 312e12 * (200e12 / 312e12)            # the table's efficiency at (8192, 128), times the peak
    assert compute.attention_efficiency(hw, "bf16", 8192, 128, False) == pytest.approx(200 / 312)
    f, b = compute.stage_seconds(ops, hw, "bf16", 1, attention="flash")
    assert f == pytest.approx(flops / rate) and b == pytest.approx(2.5 * flops / rate + flops / rate)
    tf, tb = compute.stage_seconds(ops, hw, "bf16", 1, attention="flash-triton")
    assert compute.TRITON_FLASH_SLOWER == (1.4, 2.0)
    assert tf == pytest.approx(1.4 * flops / rate)
    assert tb == pytest.approx(2.0 * 2.5 * flops / rate + 1.4 * flops / rate)
    # matmuls and memory-bound ops are the same kernels under either attention
    other = {"mm": [[1, 4096, 4096, 4096, 0, 0, 1]], "mem": [["ew", 1e9, 0, 0, 1]]}
    assert compute.stage_seconds(other, hw, "bf16", 1, attention="flash-triton") == \
        compute.stage_seconds(other, hw, "bf16", 1, attention="flash")



def test_report_flag_prices_only_the_attention(tmp_path, monkeypatch):
    """Through `parc report`: a 2-layer GPT at hidden 1024, 8 heads (head size 128), sequence 4096, dp 8 on one
    A100 node. The step's compute grows by exactly (1.4 − 1)·forward + (2 − 1)·backward of the model's
    attention ops, priced from the same table; the report notes the kernel."""
    monkeypatch.setenv("PARC_BENCH_GPT", "2,1024,8,50368,4096,tied")
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=8\ntopology nodes=1 gpus_per_node=8 preset=a100\nbatch global=16 micro=2\n"
                    "zero stage=3\nprecision bf16\n")

    flash, triton = sized_report(plan), sized_report(plan, "--attention", "flash-triton")
    grow = triton["utilization"]["compute_seconds"] - flash["utilization"]["compute_seconds"]
    hw = cost.hardware("a100")
    # per micro-batch of 2 sequences on a rank: 2 layers × one attention of 2 × 8 heads; 1 micro-batch a step
    attn = {"attn": [[16, 4096, 128, True, 0, False, 2]]}
    f, b = compute.stage_seconds(attn, hw, "bf16", 1, attention="flash")
    tf, tb = compute.stage_seconds(attn, hw, "bf16", 1, attention="flash-triton")
    assert tf == pytest.approx(1.4 * f) and tb == pytest.approx(2.0 * b)
    assert grow == pytest.approx((tf - f) + (tb - b), rel=1e-6)
    assert any("FlashAttention in Triton" in n for n in triton["notes"])
    assert any("another system's run" in n and "attention flash-triton" in n for n in triton["notes"])


# ---------------------------------------------------------------- ZeRO-3's backward gathers under BACKWARD_POST


def test_backward_post_exposes_every_backward_gather_by_hand():
    """ZeRO-3, 4 micro-batches, 10 buckets: a step's gathers 8 s (2 a micro-batch: 1 forward, 1 backward),
    reduce-scatters 4 s (1 a micro-batch), a micro-batch's forward 3 s and backward 6 s. Prefetched (parc, FSDP's
    BACKWARD_PRE) everything fits its window and only one bucket's share of each waits: 4 × (1/10 + 2/10).
    BACKWARD_POST: the backward's gather waits whole, 4 × (1/10 + 1 + 1/10)."""
    pre = cost.zero_exposed(3, rs=4.0, ag=8.0, acc=4, units=10, fwd=3.0, bwd=6.0)
    post = cost.zero_exposed(3, rs=4.0, ag=8.0, acc=4, units=10, fwd=3.0, bwd=6.0, backward_prefetch=False)
    assert pre == pytest.approx(4 * (0.1 + 0.2))
    assert post == pytest.approx(4 * (0.1 + 1.0 + 0.1))
    # a backward too short for its reduce-scatter: the rest of it waits too, prefetched or not
    assert cost.zero_exposed(3, rs=4.0, ag=8.0, acc=4, units=10, fwd=3.0, bwd=0.4, backward_prefetch=False) == \
        pytest.approx(4 * (0.1 + 1.0 + 0.6))
    # stages 1-2 gather once a step, after the optimizer: no backward gather to prefetch
    assert cost.zero_exposed(2, rs=4.0, ag=8.0, acc=4, units=10, fwd=3.0, bwd=6.0, backward_prefetch=False) == \
        cost.zero_exposed(2, rs=4.0, ag=8.0, acc=4, units=10, fwd=3.0, bwd=6.0)


def test_report_zero_prefetch_post_adds_the_backward_gathers(tmp_path, monkeypatch):
    """Through `parc report`, ZeRO-3 over 16 A100s on 2 nodes: --zero-prefetch post grows the exposed dp time by
    the backward's gathers (half the step's all-gather seconds) less what the prefetched pricing already left
    exposed of them, and only that; the report says so."""
    monkeypatch.setenv("PARC_BENCH_GPT", "4,2048,16,50368,2048,tied")
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=16\ntopology nodes=2 gpus_per_node=8 preset=a100\nbatch global=32 micro=1\n"
                    "zero stage=3\nprecision bf16\n")

    pre, post = sized_report(plan), sized_report(plan, "--zero-prefetch", "post")
    assert pre["utilization"]["compute_seconds"] == post["utilization"]["compute_seconds"]
    ag = sum(r["seconds"] for r in pre["communication"]["rows"] if r["collective"] == "all-gather")
    grow = post["communication"]["exposed_parts"]["dp"] - pre["communication"]["exposed_parts"]["dp"]
    assert 0 < grow <= ag / 2 * (1 + 1e-9)
    # what is exposed no longer runs beside the compute (`cost.beside`): it stops slowing it
    s = cost.hardware("a100").overlap_slowdown
    beside = post["communication"]["beside_seconds"] - pre["communication"]["beside_seconds"]
    assert beside == pytest.approx(-grow * s / (1 + s))
    assert post["utilization"]["step_seconds"] - pre["utilization"]["step_seconds"] == pytest.approx(grow + beside)
    assert any("BACKWARD_POST" in n for n in post["notes"])
    assert any("ZeRO-3 backward prefetch post" in n for n in post["notes"])
