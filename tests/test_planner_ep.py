"""`parc plan` searches expert parallelism (parc/analysis/plan_experts.py) on examples/moe.py, 4 GPUs.

The planner finds the model's expert ModuleLists with the expert_parallel pass's own matcher, adds
ep ∈ {2, 4} (dividing dp and the 4 experts) to every candidate with dp > 1, drops those parc refuses
(support.check's own messages), and prices the rest: 1/ep of the experts' state in memory, the
all-to-all's time on the step. The best ep candidate, written as a plan, passes `parc check --model`,
and `parc report` of that file (analytic, traced at the plan's micro-batch) shows the very all-to-all
row the planner priced (examples/moe.py's capacity, 1.25 × 2 × 16 tokens / 4 experts = 10 slots a
sample, scales exactly with the micro-batch).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import ROOT

from parc import cli
from parc.analysis import planner, report

MOE = ROOT / "examples" / "moe.py"


@pytest.fixture(scope="module")
def searched():
    return planner.search(MOE, gpus=4, preset="h100", global_batch=16, precision="fp32")


def _ep_row(comms) -> dict:
    (row,) = [c for c in comms if c.axis == "ep"]
    return row


def test_ep_candidates_found_priced_and_refused_by_support(searched):
    eps = [c for c in searched.ranked if c.plan.mesh.ep > 1]
    assert {c.plan.mesh.ep for c in eps} == {2, 4}
    assert all(c.plan.expert_parallel.patterns == ("blocks.*.moe.experts",) for c in eps)
    # what support.check refuses with ep is dropped with its message, not ranked
    reasons = [c.reason for c in searched.dropped if c.plan.mesh.ep > 1]
    assert any("expert parallelism (mesh ep 2) with zero stage=1" in r for r in reasons)
    # ZeRO with ep is proven at tp 1 only; pipelined ep is not a candidate (plan_experts.variants)
    assert all(c.plan.mesh.pp == 1 and (c.plan.zero.stage == 0 or c.plan.mesh.tp == 1) for c in eps)
    for c in eps:  # the all-to-all is on the step, and nothing overlaps it
        row = _ep_row(c.est.comms)
        assert row.bytes > 0 and c.est.ep_seconds == row.seconds > 0
        assert c.est.exposed_comm_seconds >= row.seconds
    # the same plan without ep holds every expert: more memory per rank
    best = eps[0]
    twin = next(c for c in searched.ranked if c.plan == replace(best.plan, mesh=replace(best.plan.mesh, ep=1),
                                                                expert_parallel=replace(best.plan.expert_parallel,
                                                                                        patterns=())))
    assert best.peak < twin.peak
    assert best.est.memory[0]["params_count"] < twin.est.memory[0]["params_count"]


def test_best_ep_plan_checks_and_reports_the_priced_volume(searched, tmp_path, capsys):
    best = next(c for c in searched.ranked if c.plan.mesh.ep > 1)
    out = tmp_path / "moe_ep.par"
    planner.write(replace(searched, ranked=[best]), out, "tests/test_planner_ep.py")
    text = out.read_text()
    assert f"ep={best.plan.mesh.ep}" in text and "expert_parallel" in text
    assert cli.main(["check", str(out), "--model", str(MOE), "--world-size", "4"]) == 0
    assert "ok" in capsys.readouterr().out
    rep = report.build(model=MOE, plan=out)
    (row,) = [r for r in rep["communication"]["rows"] if r["axis"] == "ep"]
    priced = _ep_row(best.est.comms)
    assert (row["bytes_per_rank"], row["intra_bytes"]) == (round(priced.bytes), round(priced.intra))
    # one GPU per node: every ep peer is on another node, so the whole volume goes inter-node, slower
    spread = tmp_path / "moe_ep_nodes.par"
    spread.write_text(text.replace("topology preset=h100 gpus_per_node=4", "topology preset=h100 nodes=4 gpus_per_node=1"))
    (far,) = [r for r in report.build(model=MOE, plan=spread)["communication"]["rows"] if r["axis"] == "ep"]
    assert (far["inter_bytes"], far["intra_bytes"]) == (row["bytes_per_rank"], 0) and far["seconds"] > row["seconds"]
