"""Presets (issue 27, item 6): a preset file round-trips through `parc plan -o`, `parc check`, `parc compile` and
`parc report`; the hardware assumed when none is named is said first; implausible calibrations and an MFU above
100% are flagged. The search is examples/gpt.py on 4 ranks (a few seconds), the compile one tiny model."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from helpers import GPT

from parc import cli
from parc.analysis import cost, planner, preset_file, report


def _preset(path, **change) -> str:
    """A preset file as `parc calibrate` writes one: the H100's fields under another name, `change` applied."""
    fields = dict(dataclasses.asdict(cost.PRESETS["h100"]), name="my-h100", **change)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields))
    return str(path)


def test_plan_with_a_preset_file_parses_checks_compiles_and_reports(tmp_path, capsys, monkeypatch):
    """The written plan names the preset file relative to itself (another directory than the cwd's), and the
    compiled/ directory carries the file's figures, so it is priced alike after the file moves."""
    monkeypatch.chdir(tmp_path)
    _preset(tmp_path / "presets" / "mine.json")
    out = tmp_path / "out" / "plan.par"
    out.parent.mkdir()
    argv = ["plan", str(GPT), "--gpus", "4", "--global-batch", "8", "--precision", "fp32",
            "--preset", "presets/mine.json", "-o", "out/plan.par"]
    assert cli.main(argv) == 0
    said = capsys.readouterr().out
    assert "the winner" in said and "wrote out/plan.par" in said
    text = out.read_text()
    assert "preset=../presets/mine.json" in text and "predicted on my-h100" in text
    assert cli.main(["check", "out/plan.par", "--model", str(GPT), "--world-size", "4"]) == 0
    assert cli.main(["compile", str(GPT), "--plan", "out/plan.par", "-o", "compiled"]) == 0
    os.rename("presets", "moved")
    assert report.build(tmp_path / "compiled")["hardware"]["name"] == "my-h100"
    capsys.readouterr()
    assert cli.main(["report", "--model", str(GPT), "--plan", "out/plan.par"]) == 2
    err = capsys.readouterr().err
    assert "out/plan.par:4:17: error: topology preset `../presets/mine.json`" in err and "preset file out/../presets/mine.json" in err


def test_a_preset_must_be_a_name_or_a_json_file():
    from parc.errors import ParcError
    from parc.grammar.parser import parse

    assert parse("mesh dp=1\ntopology preset=a/b-1.json\n").topology.preset == "a/b-1.json"
    with pytest.raises(ParcError, match="must be a preset name .* or a preset file's path ending in .json"):
        parse("mesh dp=1\ntopology preset=a/b\n")


def test_no_preset_and_no_gpu_is_said_first(monkeypatch, capsys):
    monkeypatch.setattr(preset_file, "has_gpu", lambda: False)
    assert cli.main(["plan", str(GPT), "--gpus", "2", "--global-batch", "4", "--top", "1"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("warning: this machine has no GPU, and no preset was named") and "H100-80GB" in first
    assert "the plans are bf16 (--precision)" in first
    rep = report.build(model=GPT, plan=GPT.parent / "dp.par")
    assert rep["warnings"][0].startswith("this machine has no GPU")


def test_implausible_calibration_and_mfu_above_100_are_flagged(tmp_path):
    """A calibration on a busy machine (in-step ratios 0.02) and a preset pricing beyond its own peak (no
    tables, achievable 3): both said, and the MFU that comes out above 100% too."""
    busy = _preset(tmp_path / "busy.json", in_step=[0.02, 0.02, 1.0], matmul=[], attention=[], mem_times=[],
                   achievable=3.0, flops={"fp32": 1e8, "bf16": 1e8})  # a slow peak: compute is the step
    rep = report.build(model=GPT, plan=GPT.parent / "dp.par", preset=busy)
    w = rep["warnings"]
    assert any("in-step ratio of the forward 0.02 is outside 0.2–5" in x for x in w)
    assert any("achievable 3 is not a fraction of the peak" in x for x in w)
    assert rep["utilization"]["mfu"] > 1 and any(x.startswith("MFU ") and "> 100%" in x for x in w)
    quiet = report.build(model=GPT, plan=GPT.parent / "dp.par", preset=_preset(tmp_path / "quiet.json"))
    assert quiet["warnings"] == []


@pytest.mark.parametrize("plan_text, said", [
    ("mesh dp=2 pp=2\nbatch global=8 micro=1\npipeline schedule=interleaved_1f1b virtual=2\nzero stage=1\n",
     "zero stage=1 with virtual stages (2 per pp rank) is not supported"),
    ('mesh dp=2\nbatch global=4 micro=1\nzero stage=3\nrecompute "blocks.*"\n',
     "recompute with zero stage=3 is not supported"),
])
def test_report_says_compile_refuses_first(tmp_path, plan_text, said, monkeypatch):
    """Item 5: a plan `parc compile` refuses is still priced (what it would cost), but the report says first
    that compile refuses it, with compile's own message (compiler.plan_checks: one list of checks for both)."""
    from rich.console import Console

    from parc.compiler import compile_model
    from parc.errors import ParcError
    from parc.grammar.parser import load_plan

    path = tmp_path / "p.par"
    path.write_text("topology preset=h100 gpus_per_node=4\n" + plan_text)
    rep = report.build(model=GPT, plan=path)
    assert rep["refusals"] and rep["refusals"][0].startswith(said)
    console = Console(width=200, record=True)
    report.render(rep, console)
    assert console.export_text().startswith(f"compile refuses this: {said}")
    with pytest.raises(ParcError) as e:
        compile_model(GPT, load_plan(path), tmp_path / "out")
    assert e.value.diagnostics[0].message == rep["refusals"][0]
    ok = tmp_path / "ok.par"
    ok.write_text("topology preset=h100 gpus_per_node=4\nmesh dp=2\nbatch global=4 micro=1\n")
    assert report.build(model=GPT, plan=ok)["refusals"] == []


def test_the_planner_never_proposes_a_refused_plan(tiny_search):
    from parc.compiler import plan_refusals

    assert tiny_search.ranked and all(plan_refusals(c.plan) == [] for c in tiny_search.ranked)
    assert any("with virtual stages" in c.reason for c in tiny_search.dropped)


@pytest.fixture(scope="module")
def tiny_search():
    return planner.search(GPT, gpus=4, preset="h100", global_batch=8, precision="fp32", top=400)


def test_every_shipped_preset_is_a_name_a_plan_can_state():
    """`topology preset=` takes any shipped preset, and names the figures `--preset` prices."""
    from parc.grammar.parser import parse

    for key in cost.PRESETS:
        assert parse(f"mesh dp=1\ntopology preset={key}\n").topology.preset == key
        assert cost.hardware(key) is cost.PRESETS[key]


def test_h100_hbm2e_is_the_h100_with_slower_memory():
    """The 96 GB HBM2e H100 (torchtitan's benchmark GPUs): the same die and clocks, so matmuls, attention and the
    network are priced as the h100's; a memory-bound op moves its bytes at 0.8 × 2.4 TB/s instead of 3.35."""
    h100, hbm2e = cost.hardware("h100"), cost.hardware("h100_hbm2e")
    assert hbm2e.memory == 95 * cost.GiB and h100.memory == 80 * cost.GiB
    _same_die_other_memory(h100, hbm2e, 3.35e12, 2.4e12)


def _same_die_other_memory(big, other, big_hbm: float, other_hbm: float) -> None:
    """`other` is `big`'s die with other HBM: matmuls, attention and the network priced alike, a memory-bound op's
    bytes at 0.8 × its own HBM bandwidth."""
    from parc.analysis import compute

    fields = ("matmul", "attention", "flops", "matmul_sustained", "intra_bw", "inter_bw")
    assert [getattr(other, f) for f in fields] == [getattr(big, f) for f in fields]
    mm = {"mm": [[1, 4096, 4096, 4096, 0, 0, 1]]}
    assert compute.stage_seconds(mm, other, "bf16", 1) == compute.stage_seconds(mm, big, "bf16", 1)
    ew = {"mem": [["ew", 1e9, 0, 0, 1]]}
    fwd = compute.stage_seconds(ew, other, "bf16", 1)[0]
    assert fwd == pytest.approx(1e9 / (0.8 * other_hbm))
    assert fwd / compute.stage_seconds(ew, big, "bf16", 1)[0] == pytest.approx(big_hbm / other_hbm)


def _one_stage(params: int) -> dict:
    """Statistics of a one-stage model of `params` replicated parameters and nothing else (cost.graph_stats' keys)."""
    keys = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
            "kept_bytes_sharded", "kept_bytes_replicated", "params_sharded", "params_replicated", "tp_bytes",
            "tp_ops", "recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated")
    stage = dict.fromkeys(keys, 0) | {"params_replicated": params, "flops_replicated": 1e12}
    return {"stages": [stage], "send_elements": [], "param_count": params, "tokens_per_sample": 8}


def test_a100_40gb_is_the_a100_with_half_the_memory_and_slower_hbm():
    """The A100 40GB (MosaicML's A100 40GB table): the 80GB part's die, clocks and network, so its matmul, attention
    and network figures; 40 GiB of HBM2 at 1,555 GB/s, so memory-bound ops move their bytes at 0.8 × 1.555 TB/s
    and a plan that fits an a100 can fail on it."""
    from parc.analysis import presets
    from parc.analysis.review import review
    from parc.grammar.parser import parse

    a100, small = cost.hardware("a100"), cost.hardware("a100_40gb")
    assert small.memory == 40 * cost.GiB and a100.memory == 80 * cost.GiB
    _same_die_other_memory(a100, small, 2.039e12, 1.555e12)
    # why the tables are kept: no entry is bandwidth-bound on the slower memory. The most demanding is FlashAttention-2's
    # T = 512, head size 128, forward at 110 TFLOP/s: 2·512²·128 FLOPs over Q, K, V, O once (4·512·128 bf16 elements)
    # = 128 FLOP a byte, so 110e12 / 128 = 0.86 TB/s of the 1.244 an elementwise kernel reaches: 0.69
    demand = presets.bandwidth_demand(presets.TABLES["a100_40gb"], 312e12)
    assert demand == pytest.approx(110e12 / 128 / (0.8 * 1.555e12)) and demand < 1
    # capacity: 3e9 parameters in bf16 on one GPU, 6 + 4 + 8 bytes each (fp32 master and bf16 copy, fp32 grads, Adam):
    # 16.8 + 11.2 + 22.4 = 50.3 GiB, inside an a100's 80 GiB, beyond the 40GB part's 40
    stats = _one_stage(3_000_000_000)
    assert not [d for d in review(parse("mesh dp=1\ntopology preset=a100\nprecision bf16\n", file="p.par"),
                                  stats=stats) if d.severity == "error"]
    (d,) = [d for d in review(parse("mesh dp=1\ntopology preset=a100_40gb\nprecision bf16\n", file="p.par"),
                              stats=stats) if d.severity == "error"]
    assert "pp rank 0 needs params 16.8 + grads 11.2 + optimizer 22.4" in d.message
    assert "> 40.0 GiB of a A100-40GB" in d.message


def test_nvlink_is_priced_as_nccl_reaches_it():
    """NVLink on H100s at NCCL's achieved bandwidth, not its line rate: NCCL's maintainer (NVIDIA/nccl-tests#212)
    puts it at ~370 of 450 GB/s for ring collectives, and an all-reduce on one node on NVLink SHARP at ~480 GB/s
    of bus bandwidth on 8 GPUs. The A100s, with no such figure, keep the line rate and no NVLS. A plan's own
    `topology intra=` is the figure every collective on a node runs at."""
    from parc.grammar.parser import parse

    for name, ring, nvls in (("a100", 300e9, 0.0), ("a100_40gb", 300e9, 0.0), ("h100", 370e9, 480e9),
                             ("h100_hbm2e", 370e9, 480e9), ("h200", 370e9, 480e9)):
        hw = cost.hardware(name)
        assert (hw.intra_bw, hw.intra_allreduce_bw) == (ring, nvls), name
    h100 = cost.hardware("h100")
    node = [list(range(8))]
    size = 1e9
    gather = cost._collective("tp", "all-gather", 8, size, node, h100, "ring")
    assert gather.seconds == pytest.approx(7 / 8 * size / 370e9 + 14 * h100.latency_intra)
    reduce = cost._collective("tp", "all-reduce", 8, size, node, h100, "ring")
    assert reduce.seconds == pytest.approx(2 * 7 / 8 * size / 480e9 + 14 * h100.latency_intra)
    # sequence parallelism's reduce-scatter and all-gather, priced as one all-reduce of their volume, are rings
    pair = cost._collective("tp", "all-reduce", 8, size, node, h100, "ring", nvls=False)
    assert pair.seconds == pytest.approx(2 * 7 / 8 * size / 370e9 + 14 * h100.latency_intra)
    a100 = cost.hardware("a100")
    assert cost._collective("tp", "all-reduce", 8, size, node, a100, "ring").seconds == \
        pytest.approx(2 * 7 / 8 * size / 300e9 + 14 * a100.latency_intra)
    stated = cost.hardware("h100", parse("mesh tp=8\ntopology nodes=1 gpus_per_node=8 intra=900GB/s\n").topology)
    assert stated.intra_bw == 900e9 and stated.intra_allreduce_bw == 0.0
    assert cost._collective("tp", "all-reduce", 8, size, node, stated, "ring").seconds == \
        pytest.approx(2 * 7 / 8 * size / 900e9 + 14 * stated.latency_intra)
