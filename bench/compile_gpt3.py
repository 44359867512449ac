"""Time parc on a GPT-3-sized model: wall time and peak RSS of one call.

Start here: `compile_once` is the timed call (today: trace on meta; later the full
compile). Run: `python bench/compile_gpt3.py [micro_batch]`.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from parc.trace import load_user_module, trace

MODEL = Path(__file__).resolve().parent / "gpt3.py"


def compile_once(micro_batch: int = 1):
    """The work being measured: everything parc does from model file to result."""
    return trace(load_user_module(MODEL), micro_batch)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str]) -> None:
    micro_batch = int(argv[0]) if argv else 1
    start = time.perf_counter()
    traced = compile_once(micro_batch)
    wall = time.perf_counter() - start
    nodes = sum(1 for _ in traced.gm.graph.nodes)
    print(f"gpt3: {traced.param_count / 1e9:.1f}B params, {traced.num_layers} layers, {nodes} graph nodes, "
          f"micro-batch {micro_batch}")
    print(f"wall {wall:.2f} s, peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
