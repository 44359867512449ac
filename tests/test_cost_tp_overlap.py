"""`parc report --tp-overlap` (cost.System.tp_overlap): another system's tp collectives under its matmuls. Derived by
hand from the parts the estimate adds up: a stage's forward and backward seconds are its compute
(`compute.stage_seconds`) plus the tp collectives on its timeline; "gemm" takes each pass's collectives off up to
that pass's tp-split matmul seconds (`compute.tp_gemm_seconds`), "backward" the backward's (half of them under
sequence parallelism) up to the weight-gradient matmuls'; sequence parallelism's second all-gather of each column
input, in the backward, goes under the input-gradient matmuls in both. A small model's collectives outlast its matmuls (partly
exposed), a wide one's hide whole."""

from pathlib import Path

import pytest
from parc.analysis import compute, cost, report

ROOT = Path(__file__).resolve().parents[1]


def _estimates(tmp_path, monkeypatch, shape, sp):
    monkeypatch.setenv("PARC_BENCH_GPT", shape)
    path = tmp_path / "t.par"
    path.write_text("mesh dp=1 tp=2\ntopology nodes=1 gpus_per_node=2 preset=h100\nbatch global=4 micro=2\n"
                    "tensor_parallel {\n" + "".join(f'    "{p}" : {s}\n' for p, s in (
                        ("blocks.*.attn.qkv", "column"), ("blocks.*.attn.proj", "row"),
                        ("blocks.*.mlp.fc", "column"), ("blocks.*.mlp.proj", "row")))
                    + ("    sequence_parallel\n" if sp else "") + "}\nprecision bf16\n")
    plan, stats, _, _ = report._inputs(None, ROOT / "bench" / "gpt_sized.py", path)
    hw = cost.hardware("h100", plan.topology)
    return plan, stats, hw, {mode: cost.estimate(plan, stats, hw, tp_overlap=mode) for mode in cost.System.TP_OVERLAP}


@pytest.mark.parametrize("shape, hidden_whole", [("2,256,4,1000,64", False), ("2,4096,32,1000,2048", True)])
@pytest.mark.parametrize("sp", [False, True])
def test_each_mode_hides_what_its_matmuls_cover(tmp_path, monkeypatch, shape, hidden_whole, sp):
    plan, stats, hw, est = _estimates(tmp_path, monkeypatch, shape, sp)
    d = stats["stages"][0]
    f, b = compute.stage_seconds(d["ops"], hw, "bf16", 2)
    win_f, win_b, win_w, _ = compute.tp_gemm_seconds(d["ops"], hw, "bf16", 2)
    (fn, bn), = est["none"].stage_seconds
    tp_f, tp_b = fn - f, bn - b            # the collectives on the timeline without overlap
    assert tp_f > 0 and tp_b > 0 and win_w < win_b
    # the backward's share of the pairs is the forward's; with sequence parallelism the backward also gathers each
    # column input again (runtime/parallel/sequence_regather.py): the report's all-gather row less its
    # reduce-scatter row, a step's worth. parc starts all but the first ahead, under the backward's compute;
    # another system's run under the input-gradient matmuls
    rows = {c.collective: c for c in est["none"].comms if c.axis == "tp"}
    again = (rows["all-gather"].seconds - rows["reduce-scatter"].seconds) / plan.accumulation if sp else 0.0
    first = again / d["tp_ops_regathered"] if sp else 0.0
    assert again > 0 if sp else d["tp_ops_regathered"] == 0
    # what runs under compute slows it (`cost.beside`: the preset's overlap_slowdown of the seconds hidden)
    assert hw.overlap_slowdown > 0
    def slowed(hidden):
        return hidden * hw.overlap_slowdown / (1 + hw.overlap_slowdown)
    assert tp_b == pytest.approx(tp_f + first + max(0.0, again - first - b) + slowed(min(again - first, b)))
    hidden_again = max(0.0, again - (win_b - win_w))   # what the input-gradient matmuls cannot hold
    (fg, bg), = est["gemm"].stage_seconds
    assert fg == pytest.approx(f + max(0.0, tp_f - win_f) + slowed(min(tp_f, win_f)))
    assert bg == pytest.approx(b + max(0.0, tp_f - win_b) + hidden_again
                               + slowed(min(tp_f, win_b) + again - hidden_again))
    share = 0.5 if sp else 1.0
    (fb, bb), = est["backward"].stage_seconds
    assert fb == pytest.approx(fn)
    assert bb == pytest.approx(b + tp_f * (1 - share) + max(0.0, tp_f * share - win_w) + hidden_again
                               + slowed(min(tp_f * share, win_w) + again - hidden_again))
    # what the model's width decides: the narrow one's collectives outlast its matmuls, the wide one's do not
    assert (tp_f <= win_f and tp_f <= win_b and hidden_again == 0) == hidden_whole
    if not hidden_whole:
        assert fg > f + slowed(min(tp_f, win_f)) and bg > b
    acc = plan.accumulation
    assert est["gemm"].tp_seconds + est["gemm"].beside_seconds == pytest.approx(acc * ((fg - f) + (bg - b)))
    assert est["none"].step_seconds > est["backward"].step_seconds >= est["gemm"].step_seconds


def test_the_report_says_which_overlap_it_priced(tmp_path, monkeypatch):
    monkeypatch.setenv("PARC_BENCH_GPT", "2,256,4,1000,64")
    path = tmp_path / "t.par"
    path.write_text("mesh dp=1 tp=2\ntopology nodes=1 gpus_per_node=2 preset=h100\nbatch global=4 micro=2\n"
                    "precision bf16\n")
    rep = report.build(model=ROOT / "bench" / "gpt_sized.py", plan=path, system=cost.System(tp_overlap="gemm"))
    assert any("tp overlap gemm" in n for n in rep["notes"])


def test_a_recomputed_regions_second_gathers_wait_whole(tmp_path, monkeypatch):
    """Under recompute each block's column inputs are gathered again with its recomputed forward, not ahead
    (runtime/parallel/sequence_regather.py claims no save inside a checkpoint): no second gather is hidden."""
    monkeypatch.setenv("PARC_BENCH_GPT", "2,256,4,1000,64")
    path = tmp_path / "t.par"
    path.write_text("mesh dp=1 tp=2\ntopology nodes=1 gpus_per_node=2 preset=h100\nbatch global=4 micro=2\n"
                    "tensor_parallel {\n" + "".join(f'    "{p}" : {s}\n' for p, s in (
                        ("blocks.*.attn.qkv", "column"), ("blocks.*.attn.proj", "row"),
                        ("blocks.*.mlp.fc", "column"), ("blocks.*.mlp.proj", "row"))) +
                    '    sequence_parallel\n}\nrecompute "blocks.*"\nprecision bf16\n')
    plan, stats, _, _ = report._inputs(None, ROOT / "bench" / "gpt_sized.py", path)
    d = stats["stages"][0]
    assert d["tp_ops_regathered"] == 2 * 2 and d["tp_ops_regathered_ahead"] == 0  # 2 layers × qkv, fc
    hw = cost.hardware("h100", plan.topology)
    rerun = cost.estimate(plan, stats, hw)
    ahead = {**d, "tp_bytes_regathered_ahead": d["tp_bytes_regathered"],
             "tp_ops_regathered_ahead": d["tp_ops_regathered"]}
    hidden = cost.estimate(plan, {**stats, "stages": [ahead]}, hw)
    assert rerun.stage_seconds[0][1] > hidden.stage_seconds[0][1]  # gathered ahead, all but the first would hide
    assert rerun.stage_seconds[0][0] == hidden.stage_seconds[0][0]
