"""parc ZeRO-3 against PyTorch FSDP2 (`fully_shard` per block), same model, same run.

    python bench/zero3_vs_fsdp2.py [--steps 20] [--dp 2]

Both train examples/gpt.py (default size) on dp gloo CPU ranks, same seed, same
global batch (no accumulation), AdamW. Each rank times every step after two
warm-up steps; the median over steps of the slowest rank's time is reported,
and the ratio parc / FSDP2 (≤ 1.0: parc is as fast or faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2


def _parc(compiled: str, steps: int) -> list[float]:
    from parc import artifact
    from parc.runtime.context import ParallelContext
    from parc.runtime.train import Trainer
    from parc.trace import load_user_module

    art = artifact.load(Path(compiled))
    trainer = Trainer(art, ParallelContext.create(art.plan), load_user_module(art.root / "model" / "model.py"), 0)
    times = []
    for s in range(steps + WARMUP):
        dist.barrier()
        times.append(trainer.step(s).seconds)
    return times[WARMUP:]


def _fsdp2(model_file: str, global_batch: int, lr: float, steps: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parc.runtime.state import build_reference
    from parc.trace import load_user_module

    user = load_user_module(model_file)
    model = build_reference(user, 0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    per_rank = global_batch // dist.get_world_size()
    lo = dist.get_rank() * per_rank
    times = []
    for s in range(steps + WARMUP):
        dist.barrier()
        t0 = time.perf_counter()
        batch = [t[lo:lo + per_rank] for t in user.get_batch(s, global_batch)]
        loss = user.loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[WARMUP:]


def _body(ctx, compiled: str, model_file: str, global_batch: int, lr: float, steps: int):
    return {"parc": _parc(compiled, steps), "fsdp2": _fsdp2(model_file, global_batch, lr, steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--micro", type=int, default=8, help="samples per rank per step")
    args = p.parse_args(argv)
    from parc.compiler import compile_model
    from parc.frontend import parse
    from parc.runtime.launch import spawn

    model = ROOT / "examples" / "gpt.py"
    global_batch, lr = args.micro * args.dp, 1e-3
    plan = parse(f"mesh dp={args.dp}\nbatch global={global_batch} micro={args.micro}\nzero stage=3\n"
                 f"optimizer adamw lr={lr}\n", file="zero3.par")
    with tempfile.TemporaryDirectory() as tmp:
        compile_model(model, plan, Path(tmp) / "compiled")
        results = spawn(args.dp, _body, str(Path(tmp) / "compiled"), str(model), global_batch, lr, args.steps)
    med = {}
    for name in ("parc", "fsdp2"):
        slowest = [max(r[name][i] for r in results) for i in range(args.steps)]  # a step ends on its last rank
        med[name] = statistics.median(slowest)
    print(f"examples/gpt.py dp={args.dp} gloo, {args.steps} steps, {args.micro} samples per rank: "
          f"median step parc ZeRO-3 {med['parc'] * 1e3:.1f} ms, FSDP2 {med['fsdp2'] * 1e3:.1f} ms, "
          f"ratio {med['parc'] / med['fsdp2']:.2f} (target ≤ 1.0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
