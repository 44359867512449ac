"""How long `parc check` (without --model) takes on the plans tests/test_fuzz_plans.py feeds it.

The fuzz test only guards against hangs (60 s per input); this prints the times: a small plan, the
worst size a plan may have (64 KiB of repeated keys, issue 10), and megabyte inputs that must be
refused quickly. Run: python bench/plan_parse.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from parc.cli import _review
from parc.errors import ParcError
from parc.grammar.parser import MAX_PLAN_BYTES, parse
from parc.grammar.validate import validate

ARGS = argparse.Namespace(world_size=None, preset=None)


def check(text: str) -> None:
    try:
        plan = parse(text, "bench.par")
        validate(plan)
        _review(plan, ARGS, None, failed=False)
    except ParcError:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    mb = 1 << 20
    line = "mesh " + " ".join(["dp=1"] * 800) + "\n"
    cases = {
        "small plan (examples/3d.par-like)": "mesh dp=2 pp=2 tp=2\nbatch global=16 micro=2\nzero stage=1\n",
        "worst accepted size (64 KiB of keys)": line * (MAX_PLAN_BYTES // len(line)),
        "megabyte comment": "mesh # " + "x" * mb,
        "megabyte integer": "mesh dp=" + "1" * mb,
        "megabyte of newlines": "mesh\n" + "\n" * mb,
        "megabyte of braces": "mesh\n" + "{" * mb,
    }
    check("mesh\n")  # warm: imports and lark's tables, outside the timings
    print(f"parc check without --model, median of {args.repeat}:")
    for name, text in cases.items():
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            check(text)
            times.append(time.perf_counter() - t0)
        print(f"  {name:<40} {statistics.median(times) * 1e3:10.1f} ms")


if __name__ == "__main__":
    main()
