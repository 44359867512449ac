"""Shared benchmark scaffolding: compile a plan, time interleaved steps, print medians and ratios.

Benchmarks are not tests: this machine is shared and noisy. Each one runs parc
and its PyTorch peer in the same processes, alternating rounds, so both see the
same noise; the figure to read is the ratio of medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def compile_plan(plan_text: str, model: Path = ROOT / "examples" / "gpt.py") -> Path:
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    out = Path(tempfile.mkdtemp(prefix="parc-bench-")) / "compiled"
    compile_model(model, parse(plan_text, file="bench.par"), out)
    return out


def pair_args(doc: str, steps: int = 4, rounds: int = 5) -> argparse.Namespace:
    """The flags every side-by-side benchmark takes."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--steps", type=int, default=steps, help="steps per contender per round")
    return p.parse_args()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(runs: dict[str, callable], rounds: int, steps_per_round: int, warmup: int = 2) -> dict[str, list[float]]:
    """Alternate the contenders round by round; return each one's per-step times."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name] += [timed(fn) for _ in range(steps_per_round)]
    return times


def report(title: str, times: dict[str, list[float]], ours: str, peer: str, target: float) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med[ours] / med[peer]
    lines = [title]
    lines += [f"  {k:<10} median {med[k] * 1e3:8.2f} ms/step over {len(times[k])} steps" for k in times]
    verdict = "meets" if ratio <= target else "misses"
    lines.append(f"  ratio {ours}/{peer} = {ratio:.3f} ({verdict} the target ≤ {target})")
    return "\n".join(lines)


def peak_rise(fn) -> int:
    """Bytes: the highest the CPU allocator's live total rises above where it stood when `fn` started.

    Read from the profiler's allocator events (`profile_memory=True`: every allocation and free of a
    tensor's storage on this thread, and on gloo's worker threads inside a collective), summed in time
    order; their running maximum is the peak. A free gloo's thread makes after a collective (dropping
    the work's last reference to a buffer) is not seen, and leaves that buffer counted to the end. A GPU
    run reads `torch.cuda.max_memory_allocated` instead; a CPU has no allocator statistics to read."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def mib(b: float) -> str:
    return f"{b / 2 ** 20:.2f} MiB"

