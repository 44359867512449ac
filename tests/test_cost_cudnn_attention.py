"""cuDNN's fused attention (`parc report --attention cudnn`, issue 27: NVIDIA's NeMo recipes set NVTE_FUSED_ATTN=1,
Transformer Engine's FusedAttention): the H100 presets carry a table for it, the FlashAttention-2 table times
cuDNN's speed over FlashAttention-2's as the FlashAttention-3 paper measured the two side by side on an H100 (Fig. 5,
forward, causal); a preset without that measurement (the A100s) prices it as flash and says so. Derived by hand from
the figure's numbers; then the report: only attention changes. Analytic only: about two seconds."""

from __future__ import annotations

import pytest
from helpers import sized_report
from parc.analysis import compute, cost


def test_the_h100_table_is_flash_times_the_measured_ratio():
    """Two entries by hand. The FlashAttention-2 table (FlashAttention-2 paper, forward + backward) at T 8192, head
    size 128 is 335 TFLOP/s of 989; the FlashAttention-3 paper's figure has FlashAttention-2 at 333 and cuDNN at 529
    there. At T 512, head size 64: 150 in the table, 180 and 225 in the figure. Forward and backward alike (the
    figure is of the forward). The H100's siblings (the HBM2e part, the H200: one die) share the table; the A100s
    have none."""
    hw = cost.hardware("h100")
    assert compute.attention_efficiency(hw, "bf16", 8192, 128, False, "cudnn") == pytest.approx(335 / 989 * 529 / 333)
    assert compute.attention_efficiency(hw, "bf16", 8192, 128, True, "cudnn") == pytest.approx(335 / 989 * 529 / 333)
    assert compute.attention_efficiency(hw, "bf16", 512, 64, False, "cudnn") == pytest.approx(150 / 989 * 225 / 180)
    assert compute.attention_efficiency(hw, "bf16", 8192, 128, False) == pytest.approx(335 / 989)   # flash: as it was
    for name in ("h100_hbm2e", "h200"):
        assert cost.hardware(name).attention_cudnn == hw.attention_cudnn
    for name in ("a100", "a100_40gb"):
        a100 = cost.hardware(name)
        assert a100.attention_cudnn == ()
        assert compute.attention_efficiency(a100, "bf16", 4096, 128, True, "cudnn") == \
            compute.attention_efficiency(a100, "bf16", 4096, 128, True)


def test_stage_prices_only_the_attention_faster():
    """One causal attention at a tabled point (T 8192, head size 128), recomputed: every second of it scales by
    FlashAttention-2's 333 over cuDNN's 529 TFLOP/s, launch overhead aside; matmuls and memory-bound ops unchanged."""
    from dataclasses import replace

    hw = replace(cost.hardware("h100"), op_overhead=0.0)
    ops = {"attn": [[32, 8192, 128, True, 0, True, 1, 2]]}
    f, b = compute.stage_seconds(ops, hw, "bf16", 1, attention="flash")
    cf, cb = compute.stage_seconds(ops, hw, "bf16", 1, attention="cudnn")
    assert (cf, cb) == pytest.approx((f * 333 / 529, b * 333 / 529))
    other = {"mm": [[1, 4096, 4096, 4096, 0, 0, 1]], "mem": [["ew", 1e9, 0, 0, 1]]}
    assert compute.stage_seconds(other, hw, "bf16", 1, attention="cudnn") == \
        compute.stage_seconds(other, hw, "bf16", 1, attention="flash")


def test_report_prices_it_where_measured_and_says_so(tmp_path, monkeypatch):
    """Through `parc report`: a 2-layer GPT at hidden 1024, 8 heads (head size 128), sequence 4096, dp 8 on one
    node, micro-batch 2. On the h100 preset the step's compute shrinks by exactly the attention's difference between
    the two tables; on the a100 nothing changes, and each report says which it did."""
    monkeypatch.setenv("PARC_BENCH_GPT", "2,1024,8,50368,4096,tied")
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=8\ntopology nodes=1 gpus_per_node=8\nbatch global=16 micro=2\nprecision bf16\n")

    attn = {"attn": [[16, 4096, 128, True, 0, False, 2]]}   # per micro-batch on a rank: 2 layers of 2 × 8 heads
    for preset in ("h100", "a100"):
        flash = sized_report(plan, "--preset", preset)
        fused = sized_report(plan, "--preset", preset, "--attention", "cudnn")
        hw = cost.hardware(preset)
        want = sum(compute.stage_seconds(attn, hw, "bf16", 1, attention="cudnn")) - \
            sum(compute.stage_seconds(attn, hw, "bf16", 1, attention="flash"))
        shrink = fused["utilization"]["compute_seconds"] - flash["utilization"]["compute_seconds"]
        assert shrink == pytest.approx(want, rel=1e-6, abs=1e-12)
        assert any("another system's run" in n and "attention cudnn" in n for n in fused["notes"])
        said = "the preset's cuDNN table" if preset == "h100" else "priced as flash: this preset has no measurement"
        assert any("cuDNN's fused kernel" in n and said in n for n in fused["notes"])
    assert want == 0.0 and shrink == pytest.approx(0.0, abs=1e-12)   # the a100, last
