"""Every step's gradients of a zoo family's low-precision run, each measured from the run's own parameters.

    python -m bench.zoo.bf16_steps doge [--plan tp2_bf16] [--show self_attn.A] [--out DIR]

Start at `diagnose`. `--verify` under bf16 compares the first step's gradients three-way (runtime/verify.py
`spreads`: the run's distance to serial fp32 against 3× serial bf16's, plus a floor) and holds the parameters to
the serial optimizer replayed on the run's own gradients (runtime/verify_replay.py). Later steps' gradients are
seen there only through the losses. This tool looks at them directly: the parallel run gathers its parameters
before each step and its complete gradients in each step; for each step the serial model is given those
parameters and computes that step's gradients in bf16 and in fp32 (one forward per micro-batch, as the ranks run
them), and each tensor's `Spread` is printed. A program that computes a wrong gradient at some step shows there;
two trajectories that drifted apart by rounding (what the old three-way parameter check measured) do not, since
every step starts from the same parameters.

Measured (2026-12-05): doge under tp2_bf16, worst tensor 0.29, 0.36 and 0.28 of allowed at steps 0, 1 and 2, and
`self_attn.A`'s gradients nearer fp32 than serial bf16's at every step (layer 0: 0.14/0.16, 0.24/0.38,
0.061/0.21 of their scale): the row the three-way parameter check called WRONG computes its gradients right.
Not keyed: dropout (the zoo's tiny configs have none) and top-k routing (bench/zoo/routing.py pins it in
bench/zoo/run.py; here each run routes by its own scores).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.zoo import plans
from bench.zoo.bf16_diag import compile_plan


def _rank_body(ctx, root: str, steps: int):
    from parc.runtime.train import Trainer
    from parc.runtime.verify_grads import FirstGrads

    trainer = Trainer.load(root, 0)
    grads = []
    trainer.grad_observer = FirstGrads(lambda step, g: grads.append({k: v.clone() for k, v in g.items()})).of_trainer
    params = []
    for step in range(steps):
        state = trainer.gathered_state()  # collective: the parameters this step starts from
        if ctx.rank == 0:
            params.append({k: v.clone() for k, v in state.items()})
        trainer.step(step)
    return (params, grads) if ctx.rank == 0 else None


def _serial_grads(user, plan_json: dict, state: dict, step: int, precision: str) -> dict[str, torch.Tensor]:
    """Step `step`'s gradients of the serial model given `state`, in `precision`, one forward per micro-batch."""
    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.precision import autocast, compute_dtype
    from parc.runtime.serial_reference import compute_copies
    from parc.runtime.verify_grads import FirstGrads

    model = build_reference(user, 0)
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            if name in state:
                p.copy_(state[name])
    whole, micro = plan_json["plan"]["batch"]["global"], plan_json["plan"]["batch"]["micro"]
    batch = user.get_batch(step, whole)
    for first in range(0, whole, micro):
        with autocast(precision, "cpu"), compute_copies(model, compute_dtype(precision)):
            loss = user.loss_fn(model, *(t[first:first + micro] for t in batch)).float()
        (loss * (micro / whole)).backward()  # the mean over the global batch, as train_serial sums it
    grads = FirstGrads()
    grads.of_model(model)
    return grads.grads


def diagnose(family: str, plan: str = "tp2_bf16", steps: int = 3, out: Path | None = None,
             show: tuple[str, ...] = ()) -> list:
    from parc import artifact
    from parc.runtime.launch import spawn
    from parc.runtime.verify import LOW_PRECISION_GRAD_FLOOR, spreads
    from parc.trace import load_user_module

    out = Path(out or tempfile.mkdtemp(prefix=f"bf16steps_{family}_"))
    spec, root = compile_plan(family, plan, out)
    art = artifact.load(root)
    user = load_user_module(art.root / "model" / "model.py")
    precision = art.plan["plan"].get("precision", "fp32")
    params, grads = spawn(spec.world_size, _rank_body, str(root), steps, timeout=300)[0]
    worst = []
    for step in range(steps):
        low = _serial_grads(user, art.plan, params[step], step, precision)
        ref = _serial_grads(user, art.plan, params[step], step, "fp32")
        ranked = spreads(grads[step], low, ref, LOW_PRECISION_GRAD_FLOOR)
        worst.append(ranked[0])
        print(f"step {step}: worst {ranked[0].ratio:.2f} of allowed — {ranked[0].render()}")
        for s in ranked[1:]:
            if any(w in s.name for w in show):
                print(f"    {s.ratio:.2f} of allowed — {s.render()}")
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("--plan", default="tp2_bf16", choices=sorted(plans.PLANS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--show", default="", help="comma-separated pieces of tensor names to print too")
    args = ap.parse_args(argv)
    diagnose(args.family, args.plan, args.steps, args.out, tuple(w for w in args.show.split(",") if w))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
