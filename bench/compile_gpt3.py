"""Time parc on a GPT-3-sized model: wall time, CPU time and peak RSS of one call, by phase.

Start here: `main`. Each mode runs once in a fresh process, so peak RSS and the
one-time imports (torch.export pulls in sympy and dynamo, ~2–3 s) count:

    python bench/compile_gpt3.py                # trace, 2 blocks exported + 94 replicated (parc.replicate)
    python bench/compile_gpt3.py --full         # trace, the whole model through torch.export (before)
    python bench/compile_gpt3.py --compile      # parc.compiler.compile_model under a dp=8 plan
    python bench/compile_gpt3.py --compile PLAN # ... under another plan file

CPU time is reported beside wall time because on a shared machine wall time
mostly measures the neighbours.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

MODEL = Path(__file__).resolve().parent / "gpt3.py"
# The first build on meta also imports torch._dynamo (~2.5 s, which torch.export needs anyway):
# "trace" minus its two sub-phases is that plus building the 175B model on meta (~0.7 s warm).
DP_PLAN = "mesh dp=8\nbatch global=8 micro=1\n"
PHASES: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # name → [wall, cpu]
ORDER = ["trace: build on meta + export + replicate", "  torch.export", "  replicate",
         "deepcopy + passes, all programs", "codegen, all programs", "GraphModule.recompile, anywhere"]


def timed(owner, attr: str, name: str) -> None:
    """Wrap `owner.attr` so its wall/CPU seconds add up under `name`."""
    fn = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        w, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES[name][0] += time.perf_counter() - w
            PHASES[name][1] += time.process_time() - c

    setattr(owner, attr, wrapper)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def main(argv: list[str]) -> None:
    w0, c0 = time.perf_counter(), time.process_time()
    import torch.fx

    from parc import codegen, compiler, replicate, trace
    from parc.grammar.parser import load_plan, parse

    timed(trace, "trace", "trace: build on meta + export + replicate")
    timed(compiler, "trace", "trace: build on meta + export + replicate")
    timed(trace, "_export", "  torch.export")
    timed(replicate, "_replicate", "  replicate")
    timed(compiler, "compile_program", "deepcopy + passes, all programs")
    timed(codegen, "program_source", "codegen, all programs")
    timed(torch.fx.GraphModule, "recompile", "GraphModule.recompile, anywhere")
    imported = time.perf_counter() - w0, time.process_time() - c0
    if "--compile" in argv:
        rest = argv[argv.index("--compile") + 1:]
        plan = load_plan(rest[0]) if rest else parse(DP_PLAN, file="dp8.par")
        with tempfile.TemporaryDirectory() as out:
            result = compiler.compile_model(MODEL, plan, out)
        nodes, what = None, f"compile_model, mesh {result.plan_json['mesh']}"
        params, layers = result.plan_json["model"]["param_count"], result.plan_json["model"]["num_layers"]
    else:
        traced = trace.trace(trace.load_user_module(MODEL), 1, fast="--full" not in argv)
        nodes, what = sum(1 for _ in traced.gm.graph.nodes), "trace" + (" --full" if "--full" in argv else "")
        params, layers = traced.param_count, traced.num_layers
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"gpt3 {what}: {params / 1e9:.1f}B params, {layers} layers"
          + (f", {nodes} graph nodes" if nodes else ""))
    print(f"  {'imports (torch, parc)':46s} wall {imported[0]:6.2f} s  cpu {imported[1]:6.2f} s")
    for name in sorted(PHASES, key=ORDER.index):
        w, c = PHASES[name]
        print(f"  {name:46s} wall {w:6.2f} s  cpu {c:6.2f} s")
    print(f"total wall {wall:.2f} s, cpu {cpu:.2f} s, peak RSS {peak_rss_mib():.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
