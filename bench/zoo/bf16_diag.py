"""Why a family differs from serial under a low-precision plan: real bug, or rounding noise?

    python -m bench.zoo.bf16_diag axk1 [--plan tp2_bf16] [--out DIR]

Start at `diagnose`. It compiles the family under the plan and under the same plan on one rank (mesh dp=1: the
precision pass alone, no tp), and takes step 0's gradients of four runs from the same weights on the same
batch: the parallel plan, the one-rank plan, the serial model in the plan's precision (per micro-batch, as
--verify runs it) and the serial model in fp32 (the reference). For each tensor it prints each run's distance to
the fp32 reference, max|x − fp32| / max|fp32| (floored as runtime/verify.py floors): a run computing something
serial does not is far from fp32 where the serial low-precision run is near it; rounding noise puts both at
comparable distances. It also records every `aten.topk` of step 0's forward (the MoE routers) in each run and
counts the tokens routed to another expert set than in the fp32 run; `--forced` routes every run as the fp32 run
did (bench/zoo/routing.py), which leaves what is not routing.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

from bench.zoo import families, plans, routing, rules

def _rank_body(ctx, root: str, force=None):
    from parc.runtime.train import Trainer
    from parc.runtime.verify_grads import FirstGrads

    trainer = Trainer.load(root, 0)
    grads = FirstGrads()
    trainer.grad_observer = grads.of_trainer
    log = routing.Routing(force)
    with log:
        trainer.step(0)
    return {"grads": grads.grads, "topk": log.indices if ctx.rank == 0 else None,
            "scores": log.scores if ctx.rank == 0 else None}


def _parallel(root: Path, world: int, force=None):
    from parc.runtime.launch import spawn
    return spawn(world, _rank_body, str(root), force, timeout=300)[0]


def _serial(user, plan_json: dict, precision: str, force=None):
    from parc.runtime.serial_reference import train_serial
    from parc.runtime.verify_grads import FirstGrads

    pj = copy.deepcopy(plan_json)
    pj["plan"]["precision"] = precision
    grads = FirstGrads()
    log = routing.Routing(force)
    with log:
        train_serial(user, pj, 0, 1, grad_observer=grads.of_model, per_micro_batch=True)
    return {"grads": grads.grads, "topk": log.indices, "scores": log.scores}


def compile_plan(family: str, plan: str, out: Path) -> tuple[plans.Spec, Path]:
    """The zoo's `plan` for `family` compiled under out/parallel, with the tp rules the zoo derives for it."""
    spec = plans.PLANS[plan]
    block = None
    if spec.tp:
        r = rules.derive(family, "hf", families.model_file(family, out / "rules"))
        block = rules.block(r, spec.sequence_parallel)
    return spec, _compile(family, spec, out / "parallel", block)


def _compile(family: str, spec: plans.Spec, out: Path, tp_block: str | None) -> Path:
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    model = families.model_file(family, out / "model")
    text = plans.text(spec, tp_block)
    (out / "plan.par").write_text(text)
    compile_model(model, parse(text, file=str(out / "plan.par")), out / "compiled", force=True)
    return out / "compiled"


def _dist(run: dict, ref: dict, names: list[str], floor: float) -> dict[str, float]:
    out = {}
    for n in names:
        a, b = run["grads"][n].double(), ref["grads"][n].double()
        out[n] = (a - b).abs().max().item() / max(b.abs().max().item(), floor)
    return out


def _flips(run: dict, ref: dict) -> str:
    if run["topk"] is None or len(run["topk"]) != len(ref["topk"]):
        return f"{len(run['topk'] or [])} topk calls vs {len(ref['topk'])}"
    differ = total = 0
    score = 0.0
    for a, b, x, y in zip(run["topk"], ref["topk"], run["scores"], ref["scores"]):
        sa, sb = a.sort(-1).values, b.sort(-1).values  # the set chosen per token, not its order
        rows = (sa != sb).reshape(-1, sa.shape[-1]).any(-1)
        differ += int(rows.sum())
        total += rows.numel()
        score = max(score, ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
    return f"{differ}/{total} tokens route to another expert set; router scores max|Δ|/scale {score:.2e}"


def diagnose(family: str, plan: str = "tp2_bf16", out: Path | None = None, forced: bool = False,
             show: tuple[str, ...] = ()) -> dict:
    """`forced`: every run routes each token as the fp32 run did (bench/zoo/routing.py): what is left is not routing."""
    from parc import artifact
    from parc.runtime.verify import SCALE_FLOOR
    from parc.trace import load_user_module

    out = Path(out or tempfile.mkdtemp(prefix=f"bf16diag_{family}_"))
    spec, par_root = compile_plan(family, plan, out)
    one = plans.Spec("dp=1", spec.batch, extra=spec.extra.replace("zero stage=3\n", ""))
    one_root = _compile(family, one, out / "one", None)
    art = artifact.load(par_root)
    user = load_user_module(art.root / "model" / "model.py")
    precision = art.plan["plan"].get("precision", "fp32")
    ref = _serial(user, art.plan, "fp32")
    force = ref["topk"] if forced and ref["topk"] else None
    runs = {"parallel": _parallel(par_root, spec.world_size, force), "1-rank": _parallel(one_root, 1, force),
            f"serial {precision}": _serial(user, art.plan, precision, force)}
    names = list(ref["grads"])
    least = SCALE_FLOOR * max(g.abs().max().item() for g in ref["grads"].values())
    dists = {k: _dist(v, ref, names, least) for k, v in runs.items()}
    # parallel against serial in the same precision: what run.py / --verify judge today
    same = _dist(runs["parallel"], runs[f"serial {precision}"], names, least)
    order = sorted(names, key=lambda n: -dists["parallel"][n] / max(dists[f"serial {precision}"][n], 1e-12))
    print(f"{family} {plan}{' (routing forced to fp32 choice)' if forced else ''}: distance to serial fp32, "
          "max|Δ|/scale per tensor (worst parallel/serial ratio first)")
    cols = list(runs) + ["par vs ser"]
    print(f"{'tensor':60s} " + " ".join(f"{c:>12s}" for c in cols) + "   ratio")
    for n in order[:12] + [n for n in order[12:] if any(w in n for w in show)]:
        vals = [dists[k][n] for k in runs] + [same[n]]
        ratio = dists["parallel"][n] / max(dists[f"serial {precision}"][n], 1e-12)
        print(f"{n[:60]:60s} " + " ".join(f"{v:12.2e}" for v in vals) + f"   {ratio:6.2f}")
    for k, v in runs.items():
        print(f"router top-k, {k} vs fp32: {_flips(v, ref)}")
    print(f"router top-k, parallel vs serial {precision}: {_flips(runs['parallel'], runs[f'serial {precision}'])}")
    return {"dists": dists, "same": same}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("--plan", default="tp2_bf16", choices=sorted(plans.PLANS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--forced", action="store_true", help="route every run as the fp32 run did")
    ap.add_argument("--show", default="", help="comma-separated pieces of tensor names to print too")
    args = ap.parse_args(argv)
    diagnose(args.family, args.plan, args.out, args.forced, tuple(w for w in args.show.split(",") if w))
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
