"""The per-operation compute model, `parc calibrate`'s preset files, and the pipeline, communication
and memory fixes of issue 14 (parc/analysis/compute.py, calibrate.py, cost.py).

Hand-made statistics where a figure can be worked out by hand; the tiny GPT (examples/gpt.py)
where the traced graph matters. The H200 figures are in tests/test_cost_h200.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from parc.analysis import compute, cost
from parc.cli import main
from parc.grammar.parser import parse
from parc.passes.schedule import build_schedule
from parc.passes.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
TP = ('tensor_parallel {\n "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
      ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n "lm_head" : vocab\n}\n')


def _stats(flops: list[float], psi: int = 1_000_000, send: int = 1000) -> dict:
    keys = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
            "kept_bytes_sharded", "kept_bytes_replicated", "params_sharded", "params_replicated", "tp_bytes",
            "tp_ops", "recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated")
    stages = []
    for f in flops:
        d = dict.fromkeys(keys, 0)
        d.update(flops_replicated=f, params_replicated=psi // len(flops))
        stages.append(d)
    return {"stages": stages, "send_elements": [send] * (len(flops) - 1), "param_count": psi, "tokens_per_sample": 8}


# ---------------------------------------------------------------- compute model


def test_matmul_time_from_the_table():
    hw = replace(cost.hardware("h100"), matmul=(("bf16", 1024, 1024, 1024, 0.25), ("bf16", 8192, 8192, 8192, 0.8)),
                 op_overhead=0.0, mem_bw=1e12, matmul_sustained=0.0)
    ops = {"mm": [[1, 8192, 8192, 8192, 0, 0, 2]]}   # two big matmuls: at the big entry's 80%
    f, b = compute.stage_seconds(ops, hw, "bf16", 1)
    one = 2 * 8192 ** 3 / (989e12 * 0.8)
    assert f == pytest.approx(2 * one) and b == pytest.approx(4 * one)  # backward: dX and dW, same shapes
    small = compute.stage_seconds({"mm": [[1, 1024, 1024, 1024, 0, 0, 1]]}, hw, "bf16", 1)[0]
    assert small == pytest.approx(2 * 1024 ** 3 / (989e12 * 0.25))
    # column-sharded under tp 4: n / 4, looked up at its own (smaller) shape
    sharded = compute.stage_seconds({"mm": [[1, 8192, 8192, 8192, 1, 0, 1]]}, hw, "bf16", 4)[0]
    assert one / 4 < sharded < one
    # memory-bound: bytes over bandwidth, the backward twice; a GPU hides the launch behind the work
    mem = compute.stage_seconds({"mem": [["ew", 1e9, 0, 0, 3]]}, hw, "bf16", 1)
    assert mem == pytest.approx((3e-3, 6e-3))
    launch = replace(hw, op_overhead=1e-3)
    assert compute.stage_seconds({"mem": [["ew", 1e6, 0, 0, 1]]}, launch, "bf16", 1)[0] == pytest.approx(1e-3)
    cpu = replace(launch, async_launch=False)   # a CPU pays dispatch and work one after the other
    assert compute.stage_seconds({"mem": [["ew", 1e6, 0, 0, 1]]}, cpu, "bf16", 1)[0] == pytest.approx(1e-3 + 1e-6)
    # a row of four, stored before kinds existed: elementwise
    assert compute.stage_seconds({"mem": [[1e9, 0, 0, 3]]}, hw, "bf16", 1) == pytest.approx(mem)


def test_batched_matmul_fills_the_gpu_with_all_its_instances():
    """A batched matmul (attention's QKᵀ over b·heads, a bmm) launches the tiles of all its instances at once, so
    it fills the SMs as one matmul of b·m rows does: its efficiency is the table's at (b·m, n, k), not at one
    instance's (m, n, k) (the table's shapes are of single matmuls, XLA's b = 1 entries)."""
    hw = replace(cost.hardware("h100"), matmul=(("bf16", 1024, 1024, 128, 0.25), ("bf16", 8192, 1024, 128, 0.6)),
                 op_overhead=0.0, mem_bw=1e12, matmul_sustained=0.0)
    f, b = compute.stage_seconds({"mm": [[8, 1024, 1024, 128, 0, 0, 1]]}, hw, "bf16", 1)
    flops = 2 * 8 * 1024 * 1024 * 128
    assert f == pytest.approx(flops / (989e12 * 0.6))
    alone = compute.stage_seconds({"mm": [[1, 1024, 1024, 128, 0, 0, 1]]}, hw, "bf16", 1)[0]
    assert alone == pytest.approx(flops / 8 / (989e12 * 0.25))   # one instance: the small entry
    # the backward's two matmuls per instance, dX (m, k, n) and dW (n, k, m), are batched alike
    assert b == pytest.approx(compute.stage_seconds({"mm": [[1, 8 * 1024, 128, 1024, 0, 0, 1]]}, hw, "bf16", 1)[0]
                              + compute.stage_seconds({"mm": [[1, 8 * 1024, 128, 1024, 0, 0, 1]]}, hw, "bf16", 1)[0])


def test_memory_bound_kinds_without_measured_times():
    """The shipped GPU presets measure no kinds: every kind is bytes over bandwidth, as before kinds existed, and
    a linear's bias (in cuBLAS's epilogue) costs nothing."""
    hw = cost.hardware("h200")
    assert not hw.mem_times
    ew = compute.stage_seconds({"mem": [["ew", 1e8, 0, 0, 1]]}, hw, "bf16", 1)
    for kind in compute.KINDS:
        got = compute.stage_seconds({"mem": [[kind, 1e8, 0, 0, 1]]}, hw, "bf16", 1)
        assert got == (pytest.approx((0.0, 0.0)) if kind == "bias" else pytest.approx(ew))


def test_memory_bound_kinds_by_aten_name():
    from types import SimpleNamespace as Node

    def kind(target, *args, **kwargs):
        return compute.mem_kind(Node(target=target, args=("x", *args), kwargs=kwargs))
    assert kind("aten.gelu.default") == "gelu" and kind("aten.gelu.default", approximate="tanh") == "gelu_tanh"
    assert kind("aten.gelu.default", "tanh") == "gelu_tanh"
    assert kind("aten._log_softmax.default", -1, False) == "softmax"
    assert kind("aten.native_layer_norm.default") == "layer_norm"
    assert kind("aten.exp.default") == kind("aten.sigmoid.default") == "act"   # timed as a tanh
    assert kind("aten.add.Tensor") == kind("aten.mul.Tensor") == kind("aten.expand.default") == "ew"
    assert kind("aten.nll_loss_forward.default") == "ew" and kind("aten.nll_loss.default") == "cross_entropy"
    assert set(compute.KINDS) >= {compute.mem_kind(Node(target=f"aten.{n}.default", args=(), kwargs={}))
                                  for n in compute._KINDS}


def test_memory_bound_time_from_the_measured_rows():
    """A calibrated preset's times per kind: read off its rows at the op's bytes, linear between two sizes, the
    smallest's below, the largest's seconds per byte beyond; a kind without rows takes `ew`'s."""
    rows = (("gelu", 1000, 1e-5, 3e-5), ("gelu", 3000, 2e-5, 7e-5), ("ew", 1000, 1e-6, 2e-6), ("ew", 2000, 2e-6, 4e-6))
    hw = replace(cost.hardware("h200"), mem_times=rows)

    def one(kind, nbytes, rec=0, tp=1, sharded=0):
        return compute.stage_seconds({"mem": [[kind, nbytes, sharded, rec, 1]]}, hw, "fp32", tp)
    assert one("gelu", 10) == pytest.approx((1e-5, 3e-5))            # no work: what dispatch costs
    assert one("gelu", 2000) == pytest.approx((1.5e-5, 5e-5))        # halfway
    assert one("gelu", 6000) == pytest.approx((4e-5, 14e-5))         # twice the largest
    assert one("layer_norm", 1500) == pytest.approx((1.5e-6, 3e-6))  # no rows of its own: ew's
    assert one("gelu", 2000, rec=1) == pytest.approx((1.5e-5, 6.5e-5))   # recomputed: its forward again
    assert one("gelu", 4000, tp=2, sharded=1) == one("gelu", 2000)   # 1/tp of the bytes per rank
    # a GELU is timed, not counted as bytes: dearer than an add of the same bytes on this (CPU-like) preset
    assert one("gelu", 2000)[1] > 10 * one("ew", 2000)[1]


@pytest.fixture(scope="module")
def traced():
    from parc.trace import load_user_module, trace

    return trace(load_user_module(GPT), 2)


def _graph(traced, text):
    from parc.passes.pipeline_split import assign_stages

    plan = parse(text)
    virtual = plan.pipeline.virtual if plan.pipeline is not None and plan.mesh.pp > 1 else 1
    assign_stages(traced, plan, plan.mesh.pp * virtual)
    return plan, cost.graph_stats(traced, plan)


def test_op_table_of_the_tiny_gpt(traced):
    plan, stats = _graph(traced, "mesh tp=2\n" + TP)
    (s,) = stats["stages"]
    mm = {(b, m, n, k): (split, count) for b, m, n, k, split, rec, count in s["ops"]["mm"]}
    tokens = 2 * 32
    assert mm[(1, tokens, 192, 64)] == (1, 4)      # qkv: column, n split, one per layer
    assert mm[(1, tokens, 64, 256)] == (2, 4)      # mlp.proj: row, k split
    assert mm[(1, tokens, 256, 64)] == (1, 5)      # mlp.fc (column, 4 layers) and lm_head (vocab): 64 → 256
    (attn,) = s["ops"]["attn"]
    assert attn == [2 * 4, 32, 16, 1, 3, 0, 1, 4]  # b·heads, T, head size, causal, heads split, no kv repeat, 4 layers
    # memory-bound ops by kind: count per kind, and a bias per linear that has one (1/tp in a column layer)
    kinds: dict = {}
    for kind, nbytes, sharded, rec, count in s["ops"]["mem"]:
        kinds[kind] = kinds.get(kind, 0) + count
    # ew: the 9 adds and the positions' arange
    assert kinds == {"embedding": 2, "ew": 10, "layer_norm": 9, "gelu": 4, "cross_entropy": 1, "bias": 16}
    bias = {(nbytes, sharded): count for kind, nbytes, sharded, rec, count in s["ops"]["mem"] if kind == "bias"}
    assert bias[(2 * tokens * 192 * 4 + 192 * 4, 1)] == 4   # qkv: column, its output and bias 1/tp per rank
    assert bias[(2 * tokens * 64 * 4 + 64 * 4, 0)] == 8     # attn.proj, mlp.proj: row, added to the whole output
    # the logits the loss reads, for the transient peak of their gradient
    assert s["logits_elements_sharded"] == tokens * 256 and s["logits_elements_replicated"] == 0
    json.dumps(stats)  # plan.json stores it


# ---------------------------------------------------------------- pipeline


def test_each_stage_its_own_cost():
    """stage_times: every stage at its own F/B, not the slowest one's (issue 14, 2)."""
    plan = parse("mesh pp=2\nbatch global=8 micro=1\npipeline schedule=1f1b\n")
    hw = cost.hardware("h100")
    est = cost.estimate(plan, _stats([1e12, 3e12]), hw)
    peak = hw.flops["fp32"] * hw.achievable
    f, b = [1e12 / peak, 3e12 / peak], [2e12 / peak, 6e12 / peak]
    sched = build_schedule("1f1b", 2, 8)
    p2p = est.comms[0].seconds / (2 * 8)  # the step's send/recv row: 2 sends per micro-batch
    assert est.step_seconds - est.optimizer_seconds == pytest.approx(
        simulate(sched, cost_f=f, cost_b=b, cost_comm=p2p).makespan, rel=1e-3)
    slowest = simulate(build_schedule("1f1b", 2, 8), cost_f=f[1], cost_b=b[1], cost_comm=p2p).makespan
    assert est.step_seconds - est.optimizer_seconds < slowest
    assert est.compute_seconds == pytest.approx(8 * (f[1] + b[1]))  # the busiest rank's


def test_interleaved_sends_placed_for_the_stage_costs():
    """A slow last chunk: the unit-cost placement of sends idles ranks; the estimate takes the placement
    for the real costs when the simulator finds it faster (issue 14, 2)."""
    plan = parse("mesh pp=2\nbatch global=8 micro=1\npipeline schedule=interleaved_1f1b virtual=2\n")
    hw = cost.hardware("h100")
    est = cost.estimate(plan, _stats([1.5e12, 1e12, 1e12, 3e12]), hw)
    peak = hw.flops["fp32"] * hw.achievable
    f = [x / peak for x in (1.5e12, 1e12, 1e12, 3e12)]
    b = [2 * x for x in f]
    unit = simulate(build_schedule("interleaved_1f1b", 2, 8, 2), cost_f=f, cost_b=b).makespan
    assert est.step_seconds - est.optimizer_seconds < unit


def test_virtual_stages_count_in_compute():
    plan = parse("mesh pp=2\nbatch global=4 micro=1\npipeline schedule=interleaved_1f1b virtual=2\n")
    hw = cost.hardware("h100")
    est = cost.estimate(plan, _stats([1e12] * 4), hw)
    per = 3e12 / (hw.flops["fp32"] * hw.achievable)
    assert est.compute_seconds == pytest.approx(4 * 2 * per)   # 4 micro-batches × 2 stages per rank


def test_p2p_under_tp_without_sp():
    plan = parse("mesh pp=2 tp=4\nbatch global=8 micro=1\n")
    stats = _stats([1e12, 1e12], send=1_000_000)
    plain = [c for c in cost.estimate(plan, stats, cost.hardware("h100")).comms if c.axis == "pp"][0]
    split = [c for c in cost.estimate(plan, stats, cost.hardware("h100"), p2p_scatter_gather=True).comms
             if c.axis == "pp"][0]
    assert plain.bytes == 2 * 8 * 1_000_000 * 4           # every tp rank sends the whole value (the runtime)
    assert split.bytes == pytest.approx(plain.bytes / 4)   # Megatron's scatter/gather: 1/tp each


# ---------------------------------------------------------------- communication


def test_dp_all_reduce_overlaps_backward():
    """Plain dp's bucket all-reduces overlap the last backward, all but the last 25 MiB bucket."""
    psi = 1_000_000_000
    plan = parse("mesh dp=8\nbatch global=8 micro=1\n")
    hw = cost.hardware("h100")
    est = cost.estimate(plan, _stats([1e15], psi=psi), hw)
    (ar,) = est.comms
    backward = 2e15 / (hw.flops["fp32"] * hw.achievable)
    assert est.dp_exposed_seconds == pytest.approx(max(ar.seconds - backward, ar.seconds * 25 * 2 ** 20 / (4 * psi)))
    z1 = cost.estimate(parse("mesh dp=8\nbatch global=8 micro=1\nzero stage=1\n"), _stats([1e15], psi=psi), hw)
    # statistics without `zero_units`: one bucket, which waits alone (cost.zero_exposed): nothing hidden
    assert z1.dp_exposed_seconds == pytest.approx(sum(c.seconds for c in z1.comms))


def test_zero3_gathers_every_micro_batch():
    """runtime/parallel/zero.py: ZeRO-2/3 reduce-scatter in every micro-batch, ZeRO-3 gathers in F and B."""
    hw = cost.hardware("h100")
    psi = 1_000_000
    z3 = cost.estimate(parse("mesh dp=4\nbatch global=16 micro=1\nzero stage=3\n"), _stats([1e12], psi=psi), hw)
    rs, ag = z3.comms
    assert rs.bytes == pytest.approx(3 / 4 * psi * 4 * 4)          # 4 micro-batches
    assert ag.bytes == pytest.approx(3 / 4 * psi * 4 * 2 * 4)      # forward and backward, 4 micro-batches


def test_report_communication_share_is_a_share(capsys):
    """issue 16: examples/pp.par reported communication at 143.4% of the step."""
    assert main(["report", "--model", str(GPT), "--plan", str(ROOT / "examples" / "pp.par"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    comm, util = rep["communication"], rep["utilization"]
    assert 0 <= comm["share_of_step"] <= 1 and comm["exposed_seconds"] <= util["step_seconds"]
    assert any("overlap" in n for n in rep["notes"]) and any("compute: per operation" in n for n in rep["notes"])


# ---------------------------------------------------------------- memory


def test_zero3_bf16_weights_not_kept_per_micro_batch(traced):
    _, z1 = _graph(traced, "mesh dp=2\nzero stage=1\nprecision bf16\n")
    _, z3 = _graph(traced, "mesh dp=2\nzero stage=3\nprecision bf16\n")
    k1, k3 = z1["stages"][0], z3["stages"][0]
    # The bf16 layout (runtime/precision.py, docs/precision.md) makes each weight's compute copy once per
    # step and counts it as state (2 bytes a parameter, cost._bytes_per_param), never as an activation:
    # no weight is kept per micro-batch in flight under any ZeRO stage, so ZeRO-3's activations are
    # ZeRO-1's (before the fix, ZeRO-3 added a bf16 copy of every weight per micro-batch)
    assert not any(k.startswith("weight_casts") for k in (*k1, *k3))
    assert k3["kept_bytes_replicated"] == k1["kept_bytes_replicated"]
    assert k3["kept_bytes_sharded"] == k1["kept_bytes_sharded"]


def test_transient_logits_gradient_in_the_verdict(traced):
    plan, stats = _graph(traced, "mesh dp=1\nprecision bf16\n")
    row = cost.estimate(plan, stats, cost.hardware("h100")).memory[0]
    assert row["transient"] == 2 * 32 * 256 * (4 + 2)   # fp32 gradient of the logits + its bf16 cast
    assert row["activations"] >= row["activations_kept"] + row["transient"]


# ---------------------------------------------------------------- preset files


def _preset(tmp_path, **over) -> Path:
    data = {"name": "cpu:test", "memory": 8e9, "flops": {"fp32": 1e10, "bf16": 1e10}, "intra_bw": 1e9,
            "inter_bw": 1e9, "mem_bw": 5e9, "matmul": [["fp32", 64, 64, 64, 0.3], ["fp32", 1024, 1024, 1024, 1.0]],
            "attention": [["fp32", 32, 16, 0.2, 0.1]], "op_overhead": 2e-5, "async_launch": False, "cores": 2,
            "gpus_per_node": 64}
    data.update(over)
    path = tmp_path / "preset.json"
    path.write_text(json.dumps(data))
    return path


def test_preset_file_everywhere_a_name_is(tmp_path, capsys):
    preset = _preset(tmp_path)
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=4\nbatch global=8 micro=2\n")
    assert main(["report", "--model", str(GPT), "--plan", str(plan), "--preset", str(preset), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["hardware"]["name"] == "cpu:test"
    assert any("4 ranks share 2 cores" in n for n in rep["notes"])
    assert main(["check", str(plan), "--model", str(GPT), "--preset", str(preset)]) == 0


def test_bad_preset_file_is_one_line(tmp_path, capsys):
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=2\n")
    bad = _preset(tmp_path, speed=3)
    assert main(["report", "--model", str(GPT), "--plan", str(plan), "--preset", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown field(s) speed" in err and "Traceback" not in err
    assert main(["report", "--model", str(GPT), "--plan", str(plan), "--preset", str(tmp_path / "no.json")]) == 2
    assert "preset file" in capsys.readouterr().err


def test_calibrate_writes_a_loadable_preset(tmp_path, monkeypatch):
    """A short sweep on this CPU (two shapes; the gloo probe's two processes are left out for time)."""
    from parc.analysis import calibrate

    monkeypatch.setattr(calibrate, "CPU_SHAPES", [(64, 64, 64), (256, 256, 256)])
    monkeypatch.setattr(calibrate, "CPU_ATTN", [(32, 16)])
    monkeypatch.setattr(calibrate, "CPU_MEM_SIZES", (64, 4096))
    table = [("all-reduce", 2, 1024, 1e-3, 2e-3), ("all-reduce", 2, 1024, 2e-2, 4e-3)]
    monkeypatch.setattr(calibrate, "_gloo", lambda world: {"latency": 1e-4, "call": 2e-4, "bw": 1e9, "table": table,
                                                          "probe": 2 * calibrate._probe_alone(), "post": 5e-4})
    # the step in place is tests/test_calibrate_step.py's (a spawned process training a probe model)
    monkeypatch.setattr(calibrate, "_in_step", lambda preset, log: {"in_step": [2.0, 1.0, 1.5],
                                                                     "step_overhead": [1e-3, 2e-4]})
    out = tmp_path / "cpu.json"
    data = calibrate.calibrate("cpu", out, ranks=4, log=lambda *_: None)
    hw = cost.hardware(str(out))
    assert hw.name == data["name"] and not hw.async_launch and hw.cores >= 1
    assert max(e for *_, e in hw.matmul) == pytest.approx(1.0)   # efficiencies against the best measured
    assert hw.mem_bw > 0 and hw.op_overhead > 0 and len(hw.attention) == 1
    assert (hw.latency_intra, hw.collective_overhead) == (1e-4, 2e-4)   # per ring step, per call
    assert hw.collectives == tuple(table) and hw.optimizer_per_tensor > 0 and hw.p2p_post == 5e-4
    assert {r[0] for r in hw.op_overheads} == {"mm", "attn", "view"}
    assert all(f > 0 and b >= 0 for _, f, b in hw.op_overheads)
    # every kind of memory-bound op compute.py prices, at each size, forward and backward
    sizes = {k: [n for kk, n, *_ in hw.mem_times if kk == k] for k in compute.KINDS}
    assert len(hw.mem_times) == 2 * len(compute.KINDS) and all(a < b for a, b in sizes.values())   # 64, 4096 elements
    assert all(f > 0 and b >= 0 for *_, f, b in hw.mem_times)
    assert hw.contention > 0   # the probe at 4 ranks over (ranks / cores) × alone
    assert hw.in_step == (2.0, 1.0, 1.5) and hw.step_overhead == (1e-3, 2e-4)   # read back as tuples


def test_materialized_attention_writes_its_scores():
    """A system before FlashAttention (Megatron-LM 2021, BLOOM's Megatron-DeepSpeed) multiplies over the whole
    T × T square and moves the scores through memory: softmax, its backward, the dropout's mask."""
    hw = replace(cost.hardware("a100"), matmul=(("bf16", 1024, 1024, 1024, 0.5),), mem_bw=1e12, op_overhead=0.0)
    bh, t, hs = 8, 2048, 128
    row = {"attn": [[bh, t, hs, 1, 0, 0, 1]]}
    flash = compute.stage_seconds(row, hw, "bf16", 1)
    plain = compute.stage_seconds(row, hw, "bf16", 1, attention="materialized")
    dropped = compute.stage_seconds(row, hw, "bf16", 1, attention="materialized", attention_dropout=True)
    mm = 2 * bh * t * t * hs / (312e12 * 0.5)          # one of QKᵀ, PV at the table's one efficiency
    scores = bh * t * t
    assert plain[0] == pytest.approx(2 * mm + 2 * 2 * scores / 1e12)   # softmax reads and writes them (bf16)
    assert plain[1] == pytest.approx(4 * mm + 3 * 2 * scores / 1e12)   # dQ, dK, dP, dV; softmax backward
    assert dropped[0] - plain[0] == pytest.approx(5 * scores / 1e12)   # read, write, a one-byte mask
    assert dropped[1] - plain[1] == pytest.approx(5 * scores / 1e12)
    assert plain[0] > flash[0] and plain[1] > flash[1]
    # through the estimate: recomputed attention runs its forward again inside the backward
    rec = {"attn": [[bh, t, hs, 1, 0, 1, 1]]}
    assert compute.stage_seconds(rec, hw, "bf16", 1, attention="materialized")[1] == pytest.approx(sum(plain))


def test_zero1_accumulates_whole_gradients():
    """ZeRO-1 reduce-scatters once a step, so every micro-batch's whole gradient is added up first (only
    ZeRO-2/3 accumulate their shard); under bf16 each micro-batch's 16-bit gradient goes into fp32."""
    psi, dp, acc = 8_000_000, 4, 8
    hw = cost.hardware("h100")
    stats = _stats([1e9], psi=psi)
    text = f"mesh dp={dp}\nbatch global={dp * acc} micro=1\nprecision bf16\nzero stage="
    z1 = cost.estimate(parse(text + "1\n"), stats, hw).optimizer_seconds
    z2 = cost.estimate(parse(text + "2\n"), stats, hw).optimizer_seconds
    # optimizer, clipping, casts on the shard (28 + 12 + 6); accumulation: first micro-batch 2 + 4, then 2 + 4 + 4
    step = psi / dp * (28 + 12 + 6) / hw.mem_bw + 4 * hw.op_overhead
    assert z1 == pytest.approx(step + psi * (6 + 10 * (acc - 1)) / hw.mem_bw)
    assert z2 == pytest.approx(step + psi / dp * (6 + 10 * (acc - 1)) / hw.mem_bw)


def test_recompute_runs_the_forward_all_reduces_again(traced):
    """A recomputed block runs its forward again in the backward, its row layers' all-reduces too (parc's
    runtime and Megatron's full recompute alike); under `compile` the checkpoint policy keeps their
    outputs, so nothing is communicated again."""
    _, plain = _graph(traced, "mesh tp=2\n" + TP)
    _, rec = _graph(traced, "mesh tp=2\n" + TP + 'recompute "blocks.*"\n')
    _, kept = _graph(traced, "mesh tp=2\n" + TP + 'recompute "blocks.*"\ncompile inductor\n')
    (p,), (r,), (k,) = plain["stages"], rec["stages"], kept["stages"]
    assert p["tp_ops_recomputed"] == 0 and k["tp_ops_recomputed"] == 0
    assert r["tp_ops_recomputed"] == 2 * 4                       # attn.proj and mlp.proj of 4 blocks
    assert r["tp_bytes_recomputed"] == 2 * 4 * 2 * 32 * 64       # each all-reduces its (B, T, C) output
    plan = parse("mesh tp=2\n" + TP + 'recompute "blocks.*"\n')
    hw = cost.hardware("h100")
    base = dict(r, tp_ops_recomputed=0, tp_bytes_recomputed=0)
    again = cost.estimate(plan, rec, hw)
    once = cost.estimate(plan, dict(rec, stages=[base]), hw)
    assert again.tp_seconds > once.tp_seconds and again.step_seconds > once.step_seconds


def test_no_matmul_above_the_sustained_figure():
    """The tables time matmuls in short bursts at the boost clock; a large matmul in a training step runs
    at the clock the board's power allows, so the GH100 presets price none above H200's sustained 708.5
    TFLOP/s (presets.py), while a small one keeps its table figure."""
    hw = cost.hardware("h200")
    assert hw.matmul_sustained == pytest.approx(708.5 / 989)
    assert compute.matmul_efficiency(hw, "bf16", 6144, 17920, 2816) == pytest.approx(708.5 / 989)  # 792 burst
    assert compute.matmul_efficiency(hw, "bf16", 256, 512, 256) == pytest.approx(11.5 / 989)
    assert compute.matmul_efficiency(replace(hw, matmul_sustained=0.0), "bf16", 6144, 17920, 2816) == \
        pytest.approx(792.1 / 989)
    assert cost.hardware("a100").matmul_sustained == 0.0   # not measured: the table as it is
