"""FlashAttention-2 between flash_attn's unpad and pad gathers (`parc report --attention flash-unpad`, issue 27):
llm-foundry's attn_impl "flash" (MosaicML's large-scale MPT runs) unpads q, k and v with bert_padding.unpad_input,
runs flash_attn_varlen_func and pads the output back with pad_input. Priced as the flash kernel plus those gathers
and scatters as memory-bound kernels, and the padded output kept beside the kernel's own. Derived by hand from the
a100 preset's bandwidth; then the report: only attention's time and the kept activations change, by exactly that,
and the report says so. Analytic only (tracing on meta, no ranks): about a second."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import sized_report
from parc.analysis import compute, cost


def test_unpad_traffic_by_hand():
    """One attention of 16 rows (b·heads) at T 2048, head size 128, bf16, K and V at a quarter of the query heads
    (GQA, repeat 4). In elements of q (k = v = q/4, o = q): the forward gathers q, k, v (each read and written)
    and writes o's zeros, then reads and writes o: 2(q + k + v) + 3o; the backward writes zeros and scatters into
    them for each of q, k, v, and gathers o's gradient: 3(q + k + v) + 2o. At the a100 preset's 0.8 × 2,039 GB/s,
    with no launch overhead."""
    hw = replace(cost.hardware("a100"), op_overhead=0.0)
    q = o = 16 * 2048 * 128 * 2                  # bytes
    k = v = q / 4
    f, b = compute.unpad_seconds(hw, "bf16", 16, 2048, 128, 4)
    assert hw.mem_bw == pytest.approx(0.8 * 2039e9)
    assert f == pytest.approx((2 * (q + k + v) + 3 * o) / hw.mem_bw)
    assert b == pytest.approx((3 * (q + k + v) + 2 * o) / hw.mem_bw)
    # at no size: every kernel is a launch (the host runs ahead, so a kernel costs max(work, overhead)): five
    # data kernels and 16 on the mask forward (3 × sum, nonzero, max, cumsum, pad; the mask's ones_like), seven back
    tiny = replace(hw, op_overhead=5e-6)
    f, b = compute.unpad_seconds(tiny, "bf16", 1, 1, 1, 1)
    assert compute.UNPAD_INDEX_KERNELS == 16
    assert f == pytest.approx((5 + 16) * 5e-6) and b == pytest.approx(7 * 5e-6)


def test_stage_adds_the_traffic_to_the_flash_kernel():
    """stage_seconds under "flash-unpad": the flash kernel's seconds plus `unpad_seconds`, per attention call; a
    recomputed attention runs its forward's gathers again in the backward. Matmuls and other ops unchanged."""
    hw = cost.hardware("h100")
    ops = {"attn": [[32, 4096, 128, True, 0, False, 1, 3]]}
    f, b = compute.stage_seconds(ops, hw, "bf16", 1, attention="flash")
    uf, ub = compute.unpad_seconds(hw, "bf16", 32, 4096, 128, 1)
    assert compute.stage_seconds(ops, hw, "bf16", 1, attention="flash-unpad") == \
        pytest.approx((f + 3 * uf, b + 3 * ub))
    rec = {"attn": [[32, 4096, 128, True, 0, True, 1, 1]]}
    f, b = compute.stage_seconds(rec, hw, "bf16", 1, attention="flash")
    assert compute.stage_seconds(rec, hw, "bf16", 1, attention="flash-unpad") == \
        pytest.approx((f + uf, b + ub + uf))
    # heads split over tp: a rank gathers its own heads' share
    split = {"attn": [[32, 4096, 128, True, 3, False, 1, 1]]}
    f2, b2 = compute.stage_seconds(split, hw, "bf16", 2, attention="flash")
    uf2, ub2 = compute.unpad_seconds(hw, "bf16", 16, 4096, 128, 1)
    assert compute.stage_seconds(split, hw, "bf16", 2, attention="flash-unpad") == pytest.approx((f2 + uf2, b2 + ub2))
    other = {"mm": [[1, 4096, 4096, 4096, 0, 0, 1]], "mem": [["ew", 1e9, 0, 0, 1]]}
    assert compute.stage_seconds(other, hw, "bf16", 1, attention="flash-unpad") == \
        compute.stage_seconds(other, hw, "bf16", 1, attention="flash")



def test_report_prices_the_traffic_and_the_second_output(tmp_path, monkeypatch):
    """Through `parc report`: a 2-layer GPT at hidden 1024, 8 heads (head size 128), sequence 4096, dp 8 ZeRO-3 on
    one A100 node, micro-batch 2. The step's compute grows by exactly the two layers' unpad traffic; the kept
    activations by the padded output of each layer, 2 × 8 heads × 4096 × 128 in bf16 (one micro-batch in flight);
    the report names the kernel and what it leaves out."""
    monkeypatch.setenv("PARC_BENCH_GPT", "2,1024,8,50368,4096,tied")
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=8\ntopology nodes=1 gpus_per_node=8 preset=a100\nbatch global=16 micro=2\n"
                    "zero stage=3\nprecision bf16\n")

    flash, unpad = sized_report(plan), sized_report(plan, "--attention", "flash-unpad")
    uf, ub = compute.unpad_seconds(cost.hardware("a100"), "bf16", 16, 4096, 128, 1)
    grow = unpad["utilization"]["compute_seconds"] - flash["utilization"]["compute_seconds"]
    assert grow == pytest.approx(2 * (uf + ub), rel=1e-6)
    kept = [r["activations_kept_bytes"] for r in (flash["memory"]["per_pp_rank"][0], unpad["memory"]["per_pp_rank"][0])]
    assert kept[1] - kept[0] == 2 * 16 * 4096 * 128 * 2
    assert any("unpad_input and pad_input" in n and "host syncs" in n for n in unpad["notes"])
    assert any("another system's run" in n and "attention flash-unpad" in n for n in unpad["notes"])

