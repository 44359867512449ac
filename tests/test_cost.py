"""The cost model (parc/analysis/cost.py), `parc report`, and the hardware checks of `parc check` (parc/analysis/review.py).

Arithmetic is tested on hand-made statistics where every figure can be worked out
by hand; the graph statistics and the report on the tiny GPT (examples/gpt.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from parc.analysis import cost
from parc.cli import main
from parc.grammar.parser import parse
from parc.passes.schedule import bubble_formula
from parc.analysis.review import review

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
PSI = 1_000_000  # parameters of the hand-made model


def _stats(stages: int = 1, psi: int = PSI, act: int = 0, sharded: bool = False) -> dict:
    """`stages` equal stages holding psi / stages parameters, all replicated (or all tp-sharded)."""
    one = dict.fromkeys(("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
                         "kept_bytes_sharded", "kept_bytes_replicated", "params_sharded", "params_replicated",
                         "tp_bytes", "tp_ops", "recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated"), 0)
    one["params_sharded" if sharded else "params_replicated"] = psi // stages
    one["kept_bytes_replicated"] = act
    one["flops_replicated"] = 1e12
    return {"stages": [dict(one) for _ in range(stages)], "send_elements": [1000] * (stages - 1),
            "param_count": psi, "tokens_per_sample": 8}


def _mem(plan_text: str, **kw) -> dict:
    plan = parse(plan_text)
    est = cost.estimate(plan, _stats(plan.mesh.pp, **kw), cost.hardware("h100"))
    return est.memory[0]


@pytest.mark.parametrize("text,per_param", [
    ("mesh dp=4\n", (4, 4, 8)),                                    # fp32: 4Ψ / 4Ψ / 8Ψ
    # bf16 (runtime/precision.py): fp32 masters 4Ψ + bf16 compute copy 2Ψ, fp32 grads, fp32 Adam
    ("mesh dp=4\nprecision bf16\n", (6, 4, 8)),
    # ZeRO-1: optimizer and fp32 masters ÷ dp, the whole bf16 copy kept (its flat buffer): 6 + 12/N
    ("mesh dp=4\nzero stage=1\nprecision bf16\n", (3, 4, 2)),
    ("mesh dp=4\nzero stage=2\nprecision bf16\n", (3, 1, 2)),      # ZeRO-2: grads too: 2 + 16/N
    ("mesh dp=4\nzero stage=3\nprecision bf16\n", (1, 1, 2)),      # ZeRO-3: masters too; bf16 gathered per layer
])
def test_memory_table(text, per_param):
    row = _mem(text)
    assert (row["params"], row["grads"], row["optimizer"]) == tuple(PSI * b for b in per_param)


def test_tp_shards_params_and_pp_splits_them():
    row = _mem("mesh tp=4 pp=2\nbatch global=8 micro=1\n", sharded=True)
    assert row["params_count"] == PSI / 2 / 4


def test_activations_scale_with_inflight_micro_batches():
    plan = parse("mesh pp=4\nbatch global=16 micro=1\npipeline schedule=1f1b\n")
    est = cost.estimate(plan, _stats(4, act=4000), cost.hardware("h100"))
    # 1F1B: pp rank r holds pp − r micro-batches' activations (4000 bytes each)
    assert [row["inflight"] for row in est.memory] == [4, 3, 2, 1]
    assert [row["activations"] for row in est.memory] == [4 * 4000, 3 * 4000, 2 * 4000, 4000]
    assert est.schedule_bubble == pytest.approx(bubble_formula("1f1b", 4, 16))
    assert est.bubble >= est.schedule_bubble  # P2P time can only add idle time


def test_dp_all_reduce_volume_and_node_split():
    # dp 16 over 2 nodes of 8: the ring crosses nodes; NCCL's parallel rings use all 8 NICs of a node
    # (one per GPU), so the group runs at 8 × the per-GPU network bandwidth, NVLink permitting
    plan = parse("mesh dp=16\ntopology nodes=2 gpus_per_node=8 inter=10GB/s\n")
    est = cost.estimate(plan, _stats(), cost.hardware("h100", plan.topology))
    (ar,) = est.comms
    size = PSI * 4
    assert ar.collective == "all-reduce" and ar.bytes == pytest.approx(2 * 15 / 16 * size)
    assert ar.inter == pytest.approx(ar.bytes * 2 / 16)  # 2 of the ring's 16 hops leave a node
    hop = (2 * 10e-6 + 14 * 5e-6) / 16                   # each step at its hop's latency: network or NVLink
    assert ar.seconds == pytest.approx(ar.bytes / (8 * 10e9) + 2 * 15 * hop)
    # a dp group with one GPU per node has that GPU's NIC only: the per-GPU network bandwidth
    across = parse("mesh dp=2 tp=8\ntopology nodes=2 gpus_per_node=8 inter=10GB/s\n")
    (ar2, _) = cost.estimate(across, _stats(sharded=True), cost.hardware("h100", across.topology)).comms
    assert ar2.axis == "dp" and ar2.seconds == pytest.approx(ar2.bytes / 10e9 + 2 * 10e-6)
    one_node = parse("mesh dp=8\ntopology nodes=1 gpus_per_node=8\n")
    (ar8,) = cost.estimate(one_node, _stats(), cost.hardware("h100", one_node.topology)).comms
    assert ar8.inter == 0 and ar8.intra == pytest.approx(2 * 7 / 8 * size)


def test_zero_collectives_keep_dp_volume():
    plain = cost.estimate(parse("mesh dp=8\n"), _stats(), cost.hardware("h100")).comms
    z1 = cost.estimate(parse("mesh dp=8\nzero stage=1\n"), _stats(), cost.hardware("h100")).comms
    z3 = cost.estimate(parse("mesh dp=8\nzero stage=3\n"), _stats(), cost.hardware("h100")).comms
    assert sum(c.bytes for c in z1) == pytest.approx(sum(c.bytes for c in plain))  # RS + AG = AR
    assert sum(c.bytes for c in z3) == pytest.approx(1.5 * sum(c.bytes for c in plain))  # ZeRO-3: 3Ψ


def test_step_time_and_mfu():
    plan = parse("mesh dp=2\nbatch global=4 micro=1\n")  # accumulation 2
    hw = cost.hardware("h100")
    est = cost.estimate(plan, _stats(), hw)
    compute = 2 * 3e12 / (hw.flops["fp32"] * hw.achievable)  # 2 micro-batches × (F + 2F)
    assert est.compute_seconds == pytest.approx(compute)
    # 4 MB of gradients fit one 25 MiB bucket, launched after the last backward: nothing overlaps it.
    # The optimizer step is memory-bound: AdamW 28 + clipping 12 + adding 1 extra micro-batch's fp32 gradient
    # into .grad (reads both, writes one: 12) bytes/param
    optimizer = PSI * (28 + 12 + 12) / hw.mem_bw + 4 * hw.op_overhead
    assert est.dp_exposed_seconds == pytest.approx(est.comms[0].seconds)
    assert est.optimizer_seconds == pytest.approx(optimizer)
    assert est.step_seconds == pytest.approx(compute + est.comms[0].seconds + optimizer)
    assert est.mfu == pytest.approx(3e12 * 2 * 2 / (est.step_seconds * 2 * hw.flops["fp32"]))


def test_unknown_preset():
    with pytest.raises(Exception, match="unknown hardware preset `b200`"):
        cost.hardware("b200")


# ---------------------------------------------------------------- graph statistics, report

@pytest.fixture(scope="module")
def traced():
    from parc.trace import load_user_module, trace

    return trace(load_user_module(GPT), 2)


def test_graph_stats_tiny_gpt(traced):
    from parc.passes.pipeline_split import assign_stages

    plan = parse('mesh tp=2\ntensor_parallel {\n "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
                 ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n}\n')
    assign_stages(traced, plan, 1)
    (s,) = cost.graph_stats(traced, plan)["stages"]
    assert s["params_sharded"] + s["params_replicated"] == traced.param_count
    # per layer (hidden 64): qkv 64·192+192, fc 64·256+256 column; attn.proj 64·64, mlp.proj 256·64 row weights
    per_layer = 64 * 192 + 192 + 64 * 256 + 256 + 64 * 64 + 256 * 64
    assert s["params_sharded"] == 4 * per_layer
    assert s["tp_ops"] == 4 * 4  # per layer: 2 column inputs (backward) + 2 row outputs (forward)
    # a linear's forward costs 2·tokens·in·out FLOPs: the four layers' matmuls are tp-sharded
    tokens = 2 * 32
    assert s["flops_sharded"] >= 4 * 2 * tokens * (64 * 192 + 64 * 256 + 64 * 64 + 256 * 64)


def test_report_analytic_and_json(tmp_path, capsys):
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=2 pp=2\ntopology nodes=1 gpus_per_node=4 preset=a100\nbatch global=16 micro=2\n"
                    "precision bf16\n")
    assert main(["report", "--model", str(GPT), "--plan", str(plan), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["source"] == "analytic" and rep["hardware"]["name"] == "A100-80GB"
    assert rep["memory"]["fits"] and rep["memory"]["verdict"].startswith("fits")
    assert [r["inflight"] for r in rep["memory"]["per_pp_rank"]] == [2, 1]
    assert {(c["axis"], c["collective"]) for c in rep["communication"]["rows"]} == \
        {("dp", "all-reduce"), ("pp", "send/recv")}
    assert rep["utilization"]["schedule_bubble"] == pytest.approx(bubble_formula("1f1b", 2, 4))
    assert 0 < rep["utilization"]["mfu"] < 0.5 and rep["utilization"]["tokens_per_step"] == 16 * 32
    assert main(["report", "--model", str(GPT), "--plan", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "1. Memory per rank" in out and "2. Communication" in out and "3. Utilization" in out
    # captured output is not a terminal, like a pipe: nothing is wrapped or cut at 80 columns
    assert "optimizer" in out and "…" not in out
    assert any(line.startswith("plan: ") and line.rstrip().endswith("recompute none") for line in out.splitlines())


def test_report_needs_an_input(capsys):
    assert main(["report"]) == 2
    assert "needs a compiled/ directory, or both --model and --plan" in capsys.readouterr().err


def test_report_refuses_a_plan_it_would_ignore(tmp_path, capsys):
    assert main(["report", str(tmp_path), "--plan", str(tmp_path / "p.par")]) == 2
    assert "--plan would be ignored" in capsys.readouterr().err


# ---------------------------------------------------------------- parc check additions

def test_memory_that_does_not_fit_is_an_error():
    plan = parse("mesh dp=1\ntopology preset=a100\nprecision bf16\n", file="p.par")
    diags = review(plan, stats=_stats(psi=10_000_000_000))  # 10B parameters × 16 bytes on one A100
    (d,) = [d for d in diags if "needs" in d.message]
    assert d.severity == "error" and "pp rank 0 needs params 55.9 + grads 37.3 + optimizer 74.5" in d.message  # bf16: masters + copy
    assert "> 80.0 GiB of a A100-80GB" in d.message
    assumed = review(parse("mesh dp=1\nprecision bf16\n"), stats=_stats(psi=10_000_000_000))
    assert len(assumed) == 1
    assert assumed[0].severity == "warning" and "assumed" in assumed[0].message


def test_tp_group_split_by_rank_order():
    plan = parse("mesh dp=2 pp=2 tp=4 order=dp,pp,tp\ntopology nodes=2 gpus_per_node=8\nbatch global=8 micro=1\n",
                 file="p.par")
    (d,) = review(plan)
    assert d.message == "4 tp groups cross nodes: ranks [0, 4, 8, 12] sit on nodes [0, 1] with gpus_per_node 8"
    assert (d.span.line, d.span.col) == (1, 27)
    assert review(parse("mesh dp=2 pp=2 tp=4\ntopology nodes=2 gpus_per_node=8\nbatch global=8 micro=1\n")) == []


def test_world_size_against_topology(tmp_path, capsys):
    """The topology is the cluster: a launch may use fewer of its devices, never more."""
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=4 tp=4\ntopology nodes=2 gpus_per_node=4\n")
    assert main(["check", str(plan), "--world-size", "16"]) == 2
    err = capsys.readouterr().err
    assert f"{plan}:2:1: error: world size 16 > topology nodes 2 × gpus_per_node 4 = 8 devices" in err
    plan.write_text("mesh dp=4 tp=4\ntopology nodes=4 gpus_per_node=8\n")
    assert main(["check", str(plan), "--world-size", "16"]) == 0
    assert "error" not in capsys.readouterr().err


def test_pipeline_bubble_warning(tmp_path, capsys):
    plan = tmp_path / "p.par"
    plan.write_text("mesh pp=4\nbatch global=2 micro=1\npipeline schedule=1f1b\n")
    assert main(["check", str(plan)]) == 0
    err = capsys.readouterr().err
    assert f"{plan}:1:9: warning: 1F1B with 2 micro-batches on pp 4 idles 60% of the step: " \
           "bubble (p−1)/(m+p−1) = 3/5" in err


def test_check_with_model_runs_the_memory_check(tmp_path, capsys):
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=2\ntopology nodes=1 gpus_per_node=2 preset=h100\n")
    assert main(["check", str(plan), "--model", str(GPT)]) == 0
    (d,) = review(parse(plan.read_text()), stats=_stats(psi=100_000_000_000))
    assert d.severity == "error" and d.message.endswith("GiB of a H100-80GB")


def test_groups_share_a_nodes_nics():
    """A node with fewer NICs than GPUs (BLOOM's Jean Zay: 4 per 8 GPUs) shares them among the axis's
    groups, which all run at once: a dp group with 2 ranks per node gets 2 × 4/8 links, not 2."""
    plan = parse("mesh dp=8 tp=4\ntopology nodes=4 gpus_per_node=8 inter=10GB/s\n")
    hw = cost.hardware("h100", plan.topology)
    ar = next(c for c in cost.estimate(plan, _stats(sharded=True), hw).comms if c.axis == "dp")
    shared = next(c for c in cost.estimate(plan, _stats(sharded=True), replace(hw, nics_per_node=4)).comms
                  if c.axis == "dp")
    steps = 2 * 7 * (hw.latency_inter + hw.latency_intra) / 2   # 2 ranks a node: half the ring's hops leave it
    assert ar.seconds == pytest.approx(ar.bytes / (2 * 10e9) + steps)        # a NIC per GPU: 2 links
    assert shared.seconds == pytest.approx(ar.bytes / (1 * 10e9) + steps)    # 2 × 4/8: one link's worth


def _tp_stats(tp_elements: int, backward: float) -> dict:
    """One stage of tp-sharded parameters whose row layer all-reduces `tp_elements` once a micro-batch."""
    stats = _stats(sharded=True)
    stats["stages"][0].update(tp_bytes=tp_elements, tp_ops=1, flops_sharded=backward, flops_replicated=0)
    return stats


def test_tp_across_nodes_runs_at_the_nodes_nics():
    """A tp group wider than a node is priced as any group across nodes (`cost._collective`): NCCL's rings
    cross each node boundary once per channel, one channel per NIC, so tp 16 over 2 nodes of 8 moves its
    ring volume at 8 NICs × inter (80 GB/s here), not NVLink's 370, and each ring step pays its hop's latency
    (2 of the ring's 16 hops leave a node); with 4 NICs a node, at 4 × inter. Inside one node, tp 8 runs at
    NVLink."""
    elements = 10 ** 7
    across = parse("mesh tp=16\ntopology nodes=2 gpus_per_node=8 inter=10GB/s\n")
    hw = cost.hardware("h100", across.topology)
    est = cost.estimate(across, _tp_stats(elements, 1e12), hw)
    (row,) = [c for c in est.comms if c.axis == "tp"]
    volume = 2 * 15 / 16 * elements * 4                      # fp32 activations, ring all-reduce
    assert row.bytes == pytest.approx(volume) and row.inter == pytest.approx(volume * 2 / 16)
    hop = (2 * hw.latency_inter + 14 * hw.latency_intra) / 16
    assert row.seconds == pytest.approx(volume / (8 * 10e9) + 2 * 15 * hop)
    four = cost.estimate(across, _tp_stats(elements, 1e12), replace(hw, nics_per_node=4))
    assert four.tp_seconds == pytest.approx(volume / (4 * 10e9) + 2 * 15 * hop)
    inside = parse("mesh dp=2 tp=8\ntopology nodes=2 gpus_per_node=8 inter=10GB/s\n")
    (row8,) = [c for c in cost.estimate(inside, _tp_stats(elements, 1e12), hw).comms if c.axis == "tp"]
    # on one node of H100s an all-reduce runs on NVLink SHARP, at its bus bandwidth (cost.H100_NVLS_ALLREDUCE)
    assert row8.inter == 0 and row8.seconds == pytest.approx(2 * 7 / 8 * elements * 4 / hw.intra_allreduce_bw
                                                             + 2 * 7 * hw.latency_intra)



def test_sequence_parallel_tp_runs_as_rings_not_on_nvlink_sharp():
    """On one node of H100s a tp all-reduce runs on NVLink SHARP (the h100's `intra_allreduce_bw`); with sequence
    parallelism the same volume moves as a reduce-scatter and an all-gather, rings at `intra_bw`."""
    elements = 10 ** 7
    seconds = {}
    for sp in (False, True):
        plan = parse("mesh tp=8\ntopology nodes=1 gpus_per_node=8\ntensor_parallel {\n  \"x\": column\n"
                     + ("  sequence_parallel\n" if sp else "") + "}\n")
        hw = cost.hardware("h100", plan.topology)
        rows = [c for c in cost.estimate(plan, _tp_stats(elements, 1e12), hw).comms if c.axis == "tp"]
        assert {c.collective for c in rows} == ({"reduce-scatter", "all-gather"} if sp else {"all-reduce"})
        seconds[sp] = sum(c.seconds for c in rows) - 2 * 7 * hw.latency_intra
    volume = 2 * 7 / 8 * elements * 4
    assert seconds[False] == pytest.approx(volume / hw.intra_allreduce_bw)
    assert seconds[True] == pytest.approx(volume / hw.intra_bw)

def test_dp_does_not_hide_under_tp_that_holds_the_nics():
    """dp 2 × tp 8 on nodes of 4: both axes' groups leave the node, and tp's all-reduces hold its NICs while
    they run, so dp's bucketed all-reduce overlaps the backward's compute only, not its tp seconds. On nodes
    of 8 tp runs over NVLink and dp may hide under the whole backward, tp included."""
    def exposed(nodes, per_node):
        plan = parse(f"mesh dp=2 tp=8\ntopology nodes={nodes} gpus_per_node={per_node} inter=10GB/s\n")
        stats = _tp_stats(4 * 10 ** 7, 5e10)   # compute well under tp's time
        stats["stages"][0]["params_sharded"] = 10 ** 8   # 12.5M a tp rank, 50 MB of fp32 gradients: 2 buckets
        est = cost.estimate(plan, stats, cost.hardware("h100", plan.topology))
        dp = sum(c.seconds for c in est.comms if c.axis == "dp")
        last = dp * 25 * 2 ** 20 / (10 ** 8 / 8 * 4)     # the last 25 MiB bucket waits for the backward's end
        return est, dp, last

    est, dp, last = exposed(4, 4)
    backward = est.stage_seconds[0][1]
    assert dp - (backward - est.tp_seconds / 2) > last      # the case where the rule decides
    assert est.dp_exposed_seconds == pytest.approx(dp - (backward - est.tp_seconds / 2))
    near, dp8, last8 = exposed(2, 8)
    assert near.dp_exposed_seconds == pytest.approx(max(dp8 - near.stage_seconds[0][1], last8))
    assert near.dp_exposed_seconds < est.dp_exposed_seconds
    assert any("hold the NICs dp's collectives need" in n for n in est.notes)     # the report says so
    assert not any("hold the NICs" in n for n in near.notes)
