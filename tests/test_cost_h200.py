"""The single-H200 figures (../shared/gpu/README.md, "Findings") predicted by `--preset h200` (issue 14, 4b).

examples/gpt.py's GPT at GPT-2 124M (micro 16) and 1.4B (24 × 2048, micro 8), sequence 1024,
bf16, one GPU: measured 49.4 ms and 174.8 ms per step, peak memory 15.6 and 41.1 GiB. Targets:
step time within 15%, peak memory within 10%. The statistics of the two traced models are stored
in tests/golden/cost_h200_stats.json by bench/h200_check.py --write (tracing them takes a minute
each here); that script prints the same comparison from a fresh trace.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from parc.analysis import cost
from parc.grammar.parser import parse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from h200_check import CASES, GOLDEN, plan_text  # noqa: E402


@pytest.mark.parametrize("size", sorted(CASES))
def test_single_h200_step_and_peak(size):
    micro, step, peak = CASES[size]
    stats = json.loads(GOLDEN.read_text())[size]
    plan = parse(plan_text(micro))
    est = cost.estimate(plan, stats, cost.hardware("h200"))
    assert est.step_seconds == pytest.approx(step, rel=0.15)
    assert est.memory[0]["total"] / 2 ** 30 == pytest.approx(peak, rel=0.10)
    assert any("compute: per operation" in n for n in est.notes)   # the tables, not 50% of peak
