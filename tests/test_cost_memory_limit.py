"""`cost.estimate(..., memory_limit=)`: a plan whose fullest rank needs more than the limit comes back with its
memory rows, exactly the full estimate's, and nothing timed (its pipeline schedule neither built nor simulated:
the planner's drop of a plan that does not fit); a plan within the limit gets the full estimate unchanged."""

from pathlib import Path

import pytest
from parc.analysis import cost, report
from parc.analysis.schedules import Schedules

ROOT = Path(__file__).resolve().parents[1]
PLAN = """mesh dp=1 pp=4
topology nodes=1 gpus_per_node=4 preset=a100
batch global=32 micro=1
pipeline schedule={schedule}{virtual}
precision bf16
"""


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb_h1", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_over_the_limit_memory_only_within_it_the_full_estimate(tmp_path, monkeypatch, schedule, virtual):
    monkeypatch.setenv("PARC_BENCH_GPT", "8,256,4,1000,64")
    path = tmp_path / "t.par"
    path.write_text(PLAN.format(schedule=schedule, virtual=f" virtual={virtual}" if virtual > 1 else ""))
    plan, stats, _, _ = report._inputs(None, ROOT / "bench" / "gpt_sized.py", path)
    hw = cost.hardware("a100", plan.topology)
    full = cost.estimate(plan, stats, hw)
    peak = max(r["total"] for r in full.memory)
    memo = Schedules()
    over = cost.estimate(plan, stats, hw, memory_limit=peak * 0.999, schedules=memo)
    assert over.memory == full.memory and over.inflight == full.inflight
    assert over.step_seconds == float("inf") and over.comms == []
    assert memo.built == {} and memo.ran == {}   # no schedule built, none timed
    within = cost.estimate(plan, stats, hw, memory_limit=peak)   # exactly at the limit: it fits
    assert within.step_seconds == full.step_seconds and within.memory == full.memory
