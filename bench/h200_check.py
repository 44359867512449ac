"""The single-H200 figures of ../shared/gpu/README.md against `parc report --preset h200` (issue 14, 4b).

    python bench/h200_check.py            # trace both models (~1 min each here), print predicted vs measured
    python bench/h200_check.py --write    # also store the traced statistics for tests/test_cost_h200.py

The models are examples/gpt.py's GPT at GPT-2 124M (12 × 768) and 1.4B (24 × 2048),
vocab 50304, sequence 1024, bf16, one GPU, micro-batch 16 and 8
(tests/models/gpt_h200.py). Tracing them takes a minute each on this machine, so the
test reads the statistics this script stored (tests/golden/cost_h200_stats.json);
rerun it with --write whenever graph_stats changes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "cost_h200_stats.json"
MODEL = ROOT / "tests" / "models" / "gpt_h200.py"
# measured on one H200, ../shared/gpu/README.md "Findings": (step seconds, peak memory GiB or None)
CASES = {"124m": (16, 0.0494, 15.6), "1.4b": (8, 0.1748, 41.1)}


def plan_text(micro: int) -> str:
    return f"mesh dp=1\nbatch global={micro} micro={micro}\nprecision bf16\noptimizer adamw lr=3e-4 weight_decay=0.1\n"


def main() -> int:
    from parc.analysis import cost
    from parc.analysis.report import _trace_stats
    from parc.grammar.parser import parse

    stored = {}
    for size, (micro, step, peak) in CASES.items():
        os.environ["PARC_TEST_GPT_SIZE"] = size
        plan = parse(plan_text(micro))
        stats = _trace_stats(MODEL, plan)
        stored[size] = stats
        est = cost.estimate(plan, stats, cost.hardware("h200"))
        mem = est.memory[0]["total"] / 2 ** 30
        print(f"{size}: step {est.step_seconds * 1e3:.1f} ms (measured {step * 1e3:.1f}, "
              f"{est.step_seconds / step - 1:+.1%}); peak {mem:.2f} GiB (measured {peak}, {mem / peak - 1:+.1%})")
    if "--write" in sys.argv:
        GOLDEN.write_text(json.dumps(stored))
        print(f"wrote {GOLDEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
