"""parc's compiled program vs the same model in eager PyTorch vs `torch.compile` of it, on one device.

    .venv/bin/python bench/single_device.py [--model examples/gpt.py] [--micro 8] [--precision fp32|bf16]
        [--compile none|inductor] [--no-torch-compile] [--rounds 5] [--steps 3] [--peak-tflops F]

One process, a world of one (gloo on CPU, NCCL on CUDA). The three contenders start from the
same weights (`build_model()` under seed 0), train on the same batches (contender step i takes
`get_batch(i, micro)`) with the same optimizer (AdamW, the plan's defaults), one micro-batch per
step. Rounds alternate (bench/common.py `interleave`) so all three see the same machine noise;
a step is timed with `torch.cuda.synchronize()` around it on CUDA, wall clock on CPU. Printed per
contender: median ms/step, tokens/s, MFU, and on CUDA the peak memory of its step above what the
earlier-built contenders hold; then the ratios parc/eager and parc/torch.compile.

FLOPs per step are parc's count of the traced forward (plan.json `costs`, matmuls exactly,
attention as 4·B·nh·T²·hs) × 3 for forward + backward. MFU divides by the device's dense peak
for the precision (parc.analysis.cost presets, by device name) or `--peak-tflops`; on CPU, without
that flag, MFU is not printed. `compile` and `torch.compile`'s compile times are printed apart,
never inside a timed step. The method follows ../shared/gpu/bench_single.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, compile_plan, interleave  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "examples" / "gpt.py")
    p.add_argument("--micro", type=int, default=8, help="samples per step (one micro-batch)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--compile", choices=("none", "inductor"), default="none", help="parc's plan statement")
    p.add_argument("--no-torch-compile", action="store_true", help="leave torch.compile out (its compile is slow)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense peak of the device, for MFU")
    return p.parse_args(argv)


def plan_text(args) -> str:
    return (f"mesh dp=1\nbatch global={args.micro} micro={args.micro}\nprecision {args.precision}\n"
            f"compile {args.compile}\n")


def peak_flops(args, device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    import torch

    from parc.analysis.cost import PRESETS

    name = torch.cuda.get_device_name(device).lower()
    hw = next((h for key, h in PRESETS.items() if key in name), None)
    return hw.flops[args.precision] if hw else None


class Contender:
    """One way of training the model: `step()` runs its next step (on its own batch counter), synchronised."""

    def __init__(self, name: str, run, sync):
        self.name, self._run, self._sync, self.i = name, run, sync, 0
        self.peak_bytes: int | None = None

    def step(self) -> None:
        self._run(self.i)
        self.i += 1
        self._sync()


def eager_step(model, optimizer, user, micro: int, device, bf16: bool):
    import torch

    def run(i: int) -> None:
        batch = [t.to(device) for t in user.get_batch(i, micro)]
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            loss = user.loss_fn(model, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    from parc.run import _single_process_env

    _single_process_env()
    import torch

    from parc.runtime.context import init_distributed
    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    init_distributed()
    compiled = compile_plan(plan_text(args), args.model)
    t0 = time.perf_counter()
    trainer = Trainer.load(compiled, 0)
    load_s = time.perf_counter() - t0
    device, user, plan = trainer.ctx.device, trainer.user, trainer.art.plan
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    contenders: list[Contender] = []

    def add(c: Contender, warm: int = 2) -> None:
        """Build-and-warm one contender; on CUDA its peak above what the earlier ones hold."""
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(warm):
            c.step()
        if cuda:
            c.peak_bytes = torch.cuda.max_memory_allocated(device) - base[0]
            base[0] = torch.cuda.memory_allocated(device)
        contenders.append(c)

    base = [0]  # bytes held before the contender being added (parc's own state is counted in parc's)
    add(Contender("parc", lambda i: trainer.step(i), sync))
    if trainer.compile_seconds is not None:
        print(f"parc: compiled its program with {args.compile} in {trainer.compile_seconds:.1f} s (start-up)")
    print(f"parc: start-up {load_s:.1f} s")
    bf16 = args.precision == "bf16"
    opt_cfg = plan["plan"]["optimizer"]
    model = build_reference(user, 0).to(device)
    add(Contender("eager", eager_step(model, make_optimizer(list(model.parameters()), opt_cfg), user, args.micro,
                                      device, bf16), sync))
    if not args.no_torch_compile:
        twin = build_reference(user, 0).to(device)
        cm = torch.compile(twin)
        c = Contender("torch.compile", eager_step(cm, make_optimizer(list(twin.parameters()), opt_cfg), user,
                                                  args.micro, device, bf16), sync)
        t = time.perf_counter()
        c.step()  # compiles; the contender's step 0, untimed
        print(f"torch.compile: compiled in {time.perf_counter() - t:.1f} s (its first step)")
        add(c, warm=1)
    times = interleave({c.name: c.step for c in contenders}, args.rounds, args.steps, warmup=0)
    print(render(args, plan, times, contenders, peak_flops(args, device), device))
    return 0


def render(args, plan, times, contenders, peak, device) -> str:
    stages = plan["costs"]["graph"]["stages"]
    flops = 3 * sum(s["flops_sharded"] + s["flops_replicated"] for s in stages)  # forward + backward, one step
    tokens = args.micro * plan["model"]["tokens_per_sample"]
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"{plan['model']['name']}, {plan['model']['param_count']:,} parameters, {args.precision}, micro "
             f"{args.micro} × {plan['model']['tokens_per_sample']} tokens, on {device}; parc compile {args.compile}; "
             f"{args.rounds} rounds × {args.steps} steps, medians"]
    for c in contenders:
        s = med[c.name]
        mfu = f"{flops / s / peak:6.1%}" if peak else "   n/a"
        mem = f"{c.peak_bytes / 2**20:9.1f} MiB" if c.peak_bytes is not None else "      n/a (CUDA only)"
        lines.append(f"  {c.name:<14} {s * 1e3:9.2f} ms/step  {tokens / s:12,.0f} tokens/s  MFU {mfu}  peak {mem}")
    lines.append(f"  parc/eager {med['parc'] / med['eager']:.3f}"
                 + (f"   parc/torch.compile {med['parc'] / med['torch.compile']:.3f}" if "torch.compile" in med else ""))
    lines.append(f"  (FLOPs per step {flops:.3e}: parc's traced forward × 3)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
