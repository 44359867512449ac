"""`parc calibrate` on a CPU: a training step's parts timed in place, against the per-op tables.

Start at `in_step(preset)`. The tables calibrate.py measures time each op in a loop of itself,
where its code and data stay in the caches. In a step, ops of different kinds follow one another
on fresh tensors, and none of them is as fast. On the 2-core machine parc is developed on, a
transformer block's forward run through took 1.9–2.3× the sum of its ops each timed in a loop
(blocks of 32 to 2048 rows of 64; replaying the same ops in order on fixed inputs already took
1.7–1.8×: most of it is the change of op, not the data), and an AdamW step right after a
backward 1.7× the same step in a loop of its own. A model priced from the tables alone under-predicts
every step by about that.

So calibrate trains a probe model (probe_model.py: a small Llama-layout decoder, none of the
example models) with parc's own compiler and runtime, as `parc.run` trains a user's plan, in a
world of one in a spawned process, and times each step's forward, backward and optimizer step
in place (for two micro-batch sizes, one micro-batch and four a step). The same three are
predicted from `preset`'s tables (parc.analysis.compute, as the cost model prices them); their
ratios are `in_step` (forward, backward, optimizer), which parc.analysis.cost multiplies the
table prices by on this device. What a step spends beyond the three (`get_batch`, slicing the
batch, the runtime's bookkeeping) is `step_overhead`: seconds per step and per micro-batch,
from the two sizes. The backward is timed as `Tensor.backward`, patched in that process only.
"""

from __future__ import annotations

import queue
import statistics
import time
from pathlib import Path

PROBE = Path(__file__).with_name("probe_model.py")
# (global batch, micro-batch): one micro-batch of 8 a step, and four of 2
SHAPES = ((8, 8), (8, 2))
RUNS = (5, 20, 3)   # warm-up steps, steps timed, repeats of those (the median kept)


def _plan_text(global_batch: int, micro: int) -> str:
    return f"mesh dp=1\nbatch global={global_batch} micro={micro}\noptimizer adamw lr=1e-4\n"


def _worker(port: int, root: str, out, runs: tuple[int, int, int]) -> None:
    """In a fresh process: train each compiled probe in `root` and put the mean seconds a step of its
    forward, backward, optimizer step and whole step (`runs`: warm-up steps, then the median of
    `repeats` runs of `steps` steps)."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch

    torch.set_num_threads(1)   # as each rank runs (OMP_NUM_THREADS=1)
    from parc import artifact
    from parc.runtime import data as data_sources
    from parc.runtime.context import init_distributed
    from parc.runtime.train import Trainer

    warmup, steps, repeats = runs
    init_distributed(120)
    spent = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def timed(key, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", backward)
    result = {}
    try:
        for g, m in SHAPES:
            art = artifact.load(Path(root) / f"g{g}m{m}")
            trainer = Trainer.load(art, 0)
            trainer.data = data_sources.source_for(trainer.user, trainer.entry["inputs"], g, 0, None, None)
            trainer.forward = timed("forward", trainer.forward)
            trainer.optimizer.step = timed("optimizer", trainer.optimizer.step)
            for s in range(warmup):
                trainer.step(s)
            samples = []
            for _ in range(repeats):
                spent.update(dict.fromkeys(spent, 0.0))
                t0 = time.perf_counter()
                for s in range(steps):
                    trainer.step(s)
                samples.append({**{k: v / steps for k, v in spent.items()}, "step": (time.perf_counter() - t0) / steps})
            result[(g, m)] = {k: statistics.median(r[k] for r in samples) for k in samples[0]}
    finally:
        torch.Tensor.backward = backward
    out.put(result)


def measure(root: Path, runs: tuple[int, int, int] = RUNS) -> dict:
    """{(global, micro): {forward, backward, optimizer, step}} seconds, the probes compiled into `root`."""
    import torch.multiprocessing as mp

    from parc.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=(free_port(), str(root), q, runs))
    p.start()
    deadline = time.monotonic() + 600
    while True:   # a worker that dies before it reports is said at once, not after the whole wait
        try:
            result = q.get(timeout=5)
            break
        except queue.Empty:
            if not p.is_alive():
                raise RuntimeError(f"calibrate's step probe died (exit code {p.exitcode}) before it reported") from None
            if time.monotonic() > deadline:
                p.kill()
                raise RuntimeError("calibrate's step probe reported nothing in 600 s") from None
    p.join()
    return result


def predict(hw, global_batch: int, micro: int) -> dict:
    """The tables' (forward, backward, optimizer) seconds a step of the probe under plan `_plan_text`."""
    from parc.analysis import compute, cost
    from parc.analysis.report import _trace_stats
    from parc.grammar.parser import parse

    plan = parse(_plan_text(global_batch, micro), file="calibrate-probe.par")
    stats = _trace_stats(PROBE, plan)
    f, b = compute.stage_seconds(stats["stages"][0]["ops"], hw, "fp32", 1)
    acc = global_batch // micro
    est = cost.estimate(plan, stats, hw)   # one rank: no sharing, no communication
    return {"forward": acc * f, "backward": acc * b, "optimizer": est.optimizer_seconds}


def in_step(hw, work: Path, runs: tuple[int, int, int] = RUNS) -> tuple[dict, dict]:
    """The preset's fields `in_step` (forward, backward, optimizer: measured in place over the tables' price, the median over
    SHAPES) and `step_overhead` (seconds per step, per micro-batch) for `hw`, a Hardware built from the
    tables just measured (its own `in_step` neutral); and, to log, {(global, micro): (measured, predicted)}.
    `work`: an empty directory for the compiled probes."""
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    for g, m in SHAPES:
        compile_model(PROBE, parse(_plan_text(g, m), file="calibrate-probe.par"), work / f"g{g}m{m}")
    measured = measure(work, runs)
    pairs = {(g, m): (measured[(g, m)], predict(hw, g, m)) for g, m in SHAPES}
    ratios = {k: statistics.median(got[k] / want[k] if want[k] else 1.0 for got, want in pairs.values())
              for k in ("forward", "backward", "optimizer")}
    # what a step spends beyond the three, with one and with four micro-batches: per step + per micro-batch
    rest = sorted((g // m, max(got["step"] - got["forward"] - got["backward"] - got["optimizer"], 0.0))
                  for (g, m), (got, _) in pairs.items())
    (a1, r1), (a2, r2) = rest
    per_micro = max((r2 - r1) / (a2 - a1), 0.0)
    per_step = max(r1 - a1 * per_micro, 0.0)
    return {"in_step": list(ratios.values()), "step_overhead": [per_step, per_micro]}, pairs
