"""The step-time cost of a checkpoint save, in the step (default) and with --async-save, 2 gloo ranks.

Both save the same state of the same run (examples/gpt.py at a size whose checkpoint takes a while to
write; ZeRO-1, AdamW: parameters plus two moments) through `checkpoint.Saver`, alternating rounds in
the same processes so both see the same noise. A round: a plain step, then a save, then the next step,
each timed alone. The stall of a save is save + next step − plain step: what training loses to it. With
--async-save the save returns once the state is copied to host memory; the write then runs beside
training (on a 2-core box it competes with it for the CPU, which the next step's time shows).
Run: python bench/checkpoint_stall.py [--rounds 4] [--size 4,512,8,8192,64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import ROOT, compile_plan

PLAN = """
mesh dp=2
batch global=8 micro=4
zero stage=1
optimizer adamw lr=1e-4
"""


def _body(ctx, compiled: str, rounds: int, root: str):
    import torch.distributed as dist

    from parc.runtime import checkpoint
    from parc.runtime.train import Trainer

    trainer = Trainer.load(compiled, 0)
    savers = {"in step": checkpoint.Saver(trainer, Path(root) / "sync"),
              "async": checkpoint.Saver(trainer, Path(root) / "async", asynchronous=True)}
    step, out = 0, {"plain step": [], **{k: [] for k in savers}, **{k + ": next step": [] for k in savers}}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    for warm in range(2):
        trainer.step(step)
        step += 1
    for _ in range(rounds):
        for name, saver in savers.items():
            out["plain step"].append(timed(lambda: trainer.step(step)))
            step += 1
            s = step

            out[name].append(timed(lambda: saver.save(s)))
            out[name + ": next step"].append(timed(lambda: trainer.step(s)))
            step += 1
        savers["async"].wait()  # outside the timed windows: one save in flight at a time
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--size", default="4,512,8,8192,64", help="layers,hidden,heads,vocab,seq of the GPT")
    args = p.parse_args()
    os.environ["PARC_BENCH_GPT"] = args.size
    from parc.runtime.launch import spawn

    compiled = compile_plan(PLAN, ROOT / "bench" / "gpt_sized.py")
    root = tempfile.mkdtemp(prefix="parc-stall-")
    try:
        times = spawn(2, _body, str(compiled), args.rounds, root, timeout=1800)[0]
        size = sum(f.stat().st_size for f in next(Path(root, "sync").glob("step_*")).iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    plain = med["plain step"]
    print(f"checkpoint stall, GPT {args.size} (layers,hidden,heads,vocab,seq), dp 2 ZeRO-1, 2 gloo ranks; "
          f"a checkpoint is {size / 2**20:.0f} MiB")
    print(f"  plain step              median {plain * 1e3:8.1f} ms over {len(times['plain step'])} steps")
    stall = {}
    for k in ("in step", "async"):
        stall[k] = max(med[k] + med[k + ": next step"] - plain, 1e-9)
        print(f"  {k:<7}: save returns in {med[k] * 1e3:8.1f} ms, the next step takes {med[k + ': next step'] * 1e3:8.1f} "
              f"ms (medians of {len(times[k])}): stall {stall[k] * 1e3:8.1f} ms")
    print(f"  ratio stall async / in step = {stall['async'] / stall['in step']:.3f}")


if __name__ == "__main__":
    main()
