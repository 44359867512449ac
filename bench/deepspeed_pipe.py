"""DeepSpeed's pipeline engine (2021) timed on the published DeepSpeed-pipeline rows, against parc's 1F1B.

    python bench/deepspeed_pipe.py

(`parc report --pp-engine deepspeed` prices a run this way; bench/published.py's DeepSpeed rows use it. This
script shows the parts: the same rows' costs on parc's 1F1B, on DeepSpeed's order with free transfers, and on
DeepSpeed's order with its blocking ones, each row priced without the flag.)

Why: bench/published.py's BLOOM and MT-NLG rows ran Megatron-DeepSpeed on DeepSpeed's pipeline engine and
are all optimistic (+14 … +29%); a fit of MT-NLG's three step times has ≈ 6 s a step that parc lacks, about
(pp − 1) schedule slots, as if the engine paid the pipeline's fill and drain twice. This script checks that
against the engine's own instruction order and its transfer semantics, on each row's own stage costs.

What the engine did (microsoft/DeepSpeed at 9f17087, 2021-09-30):
- deepspeed/runtime/pipe/schedule.py `TrainSchedule`: `parc.passes.schedule.deepspeed_train`'s docstring.
- runtime/pipe/p2p.py: `dist.send` / `dist.recv` with torch ≥ 1.8, `dist.broadcast` over a two-rank group
  before; `async_op` is asserted False. Each transfer is blocking and in order: both ranks meet, nothing
  else runs on either meanwhile (parc's simulator `p2p="blocking", send_waits=True`).
- runtime/pipe/engine.py: `is_pipe_partitioned = is_grad_partitioned = is_model_parallel`: with tp > 1
  each tp rank sends 1/tp of the activation and of its gradient, and the receiver all-gathers it over the
  tp group: Megatron's scatter/gather, what the rows already price (`--pp-sends scatter-gather`).
- ReduceTiedGrads, ReduceGrads and OptimizerStep run after the last step (the rows' `--no-dp-overlap`).

Each row is priced by bench/published.py's `predict` (`parc report`'s own code path); its per-stage forward
and backward seconds and its per-transfer time are read from the pipeline timing call the report makes, and
the same costs are run through parc's simulator (passes/simulate.py) on three schedules: parc's 1F1B as
priced (batched, eager sends), DeepSpeed's order with free transfers, and DeepSpeed's order with blocking
rendezvous transfers. The simulator checks the transcribed order too (no deadlock, every input there
before its compute).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from parc.passes.schedule import Schedule, deepspeed_train  # noqa: E402


def row_costs(row) -> tuple[Schedule, dict, object, float]:
    """(parc's schedule, the costs it was timed with, its timing, the step) for a published row, from the
    pipeline timing call `parc report` makes while pricing it."""
    import published
    from parc.analysis import schedules

    calls = []
    timing = schedules.timing

    def spy(schedule, **kwargs):
        result = timing(schedule, **kwargs)
        calls.append((schedule, kwargs, result))
        return result

    schedules.timing = spy
    try:
        flags = [f for f in published.report_flags(row) if f not in published.DEEPSPEED_PIPE]
        _, rep = published.predict(row, flags)
    finally:
        schedules.timing = timing
    schedule, kwargs, result = next(c for c in calls if c[1].get("cost_comm"))   # the run with its transfers
    return schedule, kwargs, result, rep["utilization"]["step_seconds"]


def main() -> int:
    import published
    from parc.passes.simulate import simulate

    print("| run | GPUs | pp | m | F, B per stage (s, first … last) | transfer s | parc 1F1B | DeepSpeed, free "
          "transfers | DeepSpeed, blocking | step: parc → with DeepSpeed's order |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in published.ROWS:
        if row.source not in (published.BLOOM, published.MTNLG):
            continue
        sch, kw, parc_t, step = row_costs(row)
        f, b, comm = kw["cost_f"], kw["cost_b"], kw["cost_comm"]
        ds = deepspeed_train(sch.pp, sch.m)
        free = simulate(ds, cost_f=f, cost_b=b).makespan
        blocking = simulate(ds, cost_f=f, cost_b=b, cost_comm=comm, p2p="blocking", send_waits=True).makespan
        extra = blocking - parc_t.makespan
        print(f"| {row.name} | {row.gpus} | {sch.pp} | {sch.m} | {f[0]:.4f}, {b[0]:.4f} … {f[-1]:.4f}, "
              f"{b[-1]:.4f} | {comm:.5f} | {parc_t.makespan:.2f} | {free:.2f} | {blocking:.2f} | "
              f"{step:.2f} → {step + extra:.2f} ({100 * extra / step:+.1f}%) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
