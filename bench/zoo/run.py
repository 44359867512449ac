"""One zoo family under one plan: compile, train 3 steps on gloo CPU ranks, train the serial model on the same
batches, compare, and classify.

    python -m bench.zoo.run llama tp2 [--source hf|graph] [--out DIR]

Start at `run(family, plan, source, out)`. Its result's `status` is one of
- PASS: compiled, and 3 steps equal serial: losses and the model-wide parameter difference within parc's
  `--verify` tolerance (runtime/verify.py `compare`), and every tensor's update within `UPDATE_TOL`;
- REFUSED: a ParcError before training (`reason`: its first line, `where`: its file:line:col), or no tp rules
  from the source (`where`: "rules");
- WRONG: trained, and differs from serial (`error`: the numbers, the worst tensor named);
- CRASH: any other exception, at compile or in a rank (`reason`: the exception's last line, `where`: the phase);
- UNBUILT: the family's tiny model does not run one forward in eager PyTorch (families.check), so parc is not tried.

The per-tensor check. parc's `compare` measures parameters model-wide, ‖a − b‖ / ‖b‖, which after 3 small SGD
steps is dominated by the unchanged initial weights. run.py therefore also measures each tensor's *update*:
‖a − b‖ / (‖b − b₀‖ + floor), b₀ the initial weights (the serial model after 0 steps), floor = 1e-3 × the
whole model's update norm scaled to the tensor's size, so a tensor whose gradient is zero in exact arithmetic
(rounding noise only) is measured against the model's scale, not its own noise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.zoo import families, plans, rules

STEPS = 3
# fp32: both runs sum the same products in another order (~1e-7 relative per op); over 3 SGD steps an update
# differs by ~1e-6 of itself. A gradient that misses a term (a head's share, a sequence slice's) is off by 1e-1
# or more. 1e-3 lies between.
# bf16: each matmul rounds to 8 mantissa bits (4e-3), and accumulation order differs between the sharded and
# the serial run: measured updates differ by up to ~2e-2 on PASSing families; a missing share is still ≥ 1e-1.
UPDATE_TOL = {"fp32": 1e-3, "bf16": 5e-2}


def _train_body(ctx, root: str):
    from parc.runtime.train import Trainer

    trainer = Trainer.load(root, 0)
    losses = trainer.global_losses([trainer.step(s).loss for s in range(STEPS)])
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None}


def update_errors(got: dict, serial: dict, initial: dict) -> dict[str, float]:
    """name → ‖a − b‖ / (‖b − b₀‖ + floor), for every tensor of the parallel run (module docstring)."""
    names = [n for n in got if n in serial]
    total_update = math.sqrt(sum((serial[n].double() - initial[n].double()).square().sum().item() for n in names))
    total_numel = sum(serial[n].numel() for n in names)
    out = {}
    for n in names:
        b, b0 = serial[n].double(), initial[n].double()
        floor = 1e-3 * total_update * math.sqrt(b.numel() / total_numel)
        out[n] = (got[n].double() - b).norm().item() / ((b - b0).norm().item() + floor + 1e-30)
    return out


def _where(e) -> str:
    span = next((d.span for d in getattr(e, "diagnostics", []) if d.span is not None), None)
    return str(span) if span is not None else "-"


def _first_line(e) -> str:
    d = getattr(e, "diagnostics", None)
    msg = d[0].message if d else str(e)
    return (msg.strip().splitlines() or [""])[0][:400]


def run(family: str, plan: str, source: str = "hf", out: Path | None = None) -> dict:
    from parc import artifact
    from parc.compiler import compile_model
    from parc.errors import ParcError
    from parc.grammar.parser import parse
    from parc.runtime.launch import spawn
    from parc.runtime.state import build_reference
    from parc.runtime.verify import TOLERANCES, compare, train_serial
    from parc.trace import load_user_module

    spec = plans.PLANS[plan]
    result = {"family": family, "plan": plan, "source": source if spec.tp else "-"}
    t0 = time.monotonic()
    out = Path(out or tempfile.mkdtemp(prefix=f"zoo_{family}_{plan}_"))
    model = families.model_file(family, out / "model")
    phase = "rules"
    try:
        block = None
        if spec.tp:
            r = rules.derive(family, source, model)
            result["dropped"] = r.dropped
            if r.block is None:
                return {**result, "status": "REFUSED", "reason": r.why_not, "where": "rules"}
            block = rules.block(r, spec.sequence_parallel)
        text = plans.text(spec, block)
        (out / "plan.par").write_text(text)
        phase = "compile"
        compile_model(model, parse(text, file=str(out / "plan.par")), out / "compiled", force=True)
        phase = "train"
        got = spawn(spec.world_size, _train_body, str(out / "compiled"), timeout=300)[0]
        phase = "serial"
        art = artifact.load(out / "compiled")
        user = load_user_module(art.root / "model" / "model.py")
        serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
        initial = {k: v.detach() for k, v in build_reference(user, 0).named_parameters(remove_duplicate=False)}
    except ParcError as e:
        # a family whose tiny model fails in eager PyTorch too is not parc's to refuse (checked only here: a
        # forward on CPU costs seconds)
        if phase == "compile" and (why := families.check(family)) is not None:
            return {**result, "status": "UNBUILT", "reason": why, "where": "tiny config"}
        return {**result, "status": "REFUSED", "reason": _first_line(e), "where": _where(e), "phase": phase,
                "seconds": round(time.monotonic() - t0, 1)}
    except Exception as e:  # noqa: BLE001 — a crash is a result to report, with its traceback's last line
        tb = traceback.format_exception(e)
        last = next((x.strip() for x in reversed("".join(tb).splitlines()) if x.strip()), repr(e))
        return {**result, "status": "CRASH", "reason": last[:400], "where": phase,
                "traceback": "".join(tb)[-3000:], "seconds": round(time.monotonic() - t0, 1)}
    precision = art.plan["plan"].get("precision", "fp32")
    verdict = compare(got["losses"], serial_losses, got["state"], serial_state, TOLERANCES[precision])
    errs = update_errors(got["state"], serial_state, initial)
    worst = max(errs, key=errs.get)
    ok = verdict.ok and errs[worst] <= UPDATE_TOL[precision] and serial_losses[0] != serial_losses[-1]
    return {**result, "status": "PASS" if ok else "WRONG",
            "error": f"{verdict.render()}; worst update {worst}: {errs[worst]:.2e} (tolerance "
                     f"{UPDATE_TOL[precision]:.0e})",
            "loss_rel": verdict.loss_rel, "param_rel": verdict.param_rel, "worst_update": [worst, errs[worst]],
            "seconds": round(time.monotonic() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family")
    ap.add_argument("plan", choices=sorted(plans.PLANS))
    ap.add_argument("--source", choices=rules.SOURCES, default="hf")
    ap.add_argument("--out", type=Path, help="working folder (default: a new temporary one)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = ap.parse_args(argv)
    res = run(args.family, args.plan, args.source, args.out)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['family']} {res['plan']} [{res['source']}]: {res['status']}  "
              f"{res.get('error') or res.get('reason', '')}  {res.get('where', '')}")
        if res["status"] == "CRASH":
            print(res["traceback"], file=sys.stderr)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
