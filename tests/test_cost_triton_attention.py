"""FlashAttention written in Triton (`parc report --attention flash-triton`, issue 27: MosaicML's MPT runs used
llm-foundry's attn_impl "triton"): priced as the flash kernel at the attention table's efficiency divided by the
FlashAttention-2 paper's measured ratios (§4.1, A100: FlashAttention-2 "around 1.3-1.5× faster than FlashAttention
in Triton in the forward pass and around 2× faster in the backward pass"), 1.4 forward and 2 backward. Derived by
hand from the a100 preset's table; then the report: only attention changes, by exactly that difference, and the
report says so. Analytic only (tracing on meta, no ranks): about a second."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from parc import cli
from parc.analysis import compute, cost, report

ROOT = Path(__file__).resolve().parents[1]
SIZED = ROOT / "bench" / "gpt_sized.py"


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

    def rep(*flags):
        return report.build_from_args(cli.parser().parse_args(["report", "--model", str(SIZED), "--plan",
                                                               str(plan), *flags]))
    flash, triton = rep(), rep("--attention", "flash-triton")
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
