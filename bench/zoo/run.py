"""One zoo family under one plan: compile, train 3 steps on gloo CPU ranks, train the serial model on the same
batches, compare, and classify.

    python -m bench.zoo.run llama tp2 [--source hf|graph] [--out DIR]

Start at `run(family, plan, source, out)`. Its result's `status` is one of
- PASS: compiled, and 3 steps equal serial by parc's own `--verify` checks (runtime/verify.py `compare`,
  runtime/verify_grads.py): losses, the model-wide parameter difference, and every tensor's first-step gradient
  against its own scale. Under bf16 (`tp2_bf16`), --verify's low-precision check (runtime/verify.py
  `compare_low_precision`): the serial model trained in fp32 is the reference, and per step's loss and per
  first-step gradient the parallel run's distance to it must be within 3× the serial bf16 run's plus a floor;
  the final parameters must equal, to fp32 rounding, the serial optimizer replayed on the run's own gradients
  (runtime/verify_replay.py); every top-k router's choice is pinned to the fp32 run's (routing.py: a flip is a
  discontinuity that one bf16 rounding decides), and `routing` says how many tokens each run would have routed
  elsewhere;
- REFUSED: a ParcError before training (`reason`: its first line, `where`: its file:line:col), or no tp rules
  from the source (`where`: "rules");
- WRONG: trained, and differs from serial (`error`: `Verdict.render()`, which names the worst tensor);
- CRASH: any other exception, at compile or in a rank (`reason`: the exception's last line, `where`: the phase);
- UNBUILT: the family's tiny model does not run one forward in eager PyTorch (families.check), so parc is not tried.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.zoo import families, plans, routing, rules

STEPS = 3


def _train_body(ctx, root: str, pin=None):
    from parc.runtime.train import Trainer
    from parc.runtime.verify_grads import FirstGrads
    from parc.runtime.verify_replay import OptimizerReplay

    trainer = Trainer.load(root, 0)
    precision = trainer.art.plan["plan"].get("precision", "fp32")
    # low precision: every step's gradients go to the serial optimizer replayed on rank 0 (runtime/verify_replay.py)
    replay = OptimizerReplay(trainer.user, trainer.art.plan, 0, skips=precision == "fp16") \
        if precision != "fp32" and ctx.rank == 0 else None
    grads = FirstGrads((replay.feed if replay else lambda step, grads: None) if precision != "fp32" else None)
    trainer.grad_observer = grads.of_trainer  # step 0's complete gradients, gathered whole on rank 0
    with (log := routing.Routing(pin)):  # low precision: the fp32 run's top-k choices replayed (routing.py)
        local = [trainer.step(s).loss for s in range(STEPS)]
    log.check_paired()
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None, "grads": grads.grads,
            "replayed": replay.check(state) if replay else None, "unpinned": log.said()}


def _serial(user, plan_json: dict, precision: str, pin=None) -> dict:
    """The serial model trained STEPS steps in `precision`, one forward per micro-batch as the tp ranks run them
    (so its top-k calls pair with theirs, routing.py): losses, final state, step 0's gradients, its routing."""
    from parc.runtime.serial_reference import train_serial
    from parc.runtime.verify_grads import FirstGrads, in_precision

    grads = FirstGrads()
    with (log := routing.Routing(pin)):
        losses, state = train_serial(user, in_precision(plan_json, precision), 0, STEPS,
                                     grad_observer=grads.of_model, per_micro_batch=True)
    log.check_paired()
    return {"losses": losses, "state": state, "grads": grads.grads, "routing": log}


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
    from parc.runtime import verify_grads
    from parc.runtime.serial_reference import train_serial
    from parc.runtime.verify import TOLERANCES, compare, compare_low_precision
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
        art = artifact.load(out / "compiled")
        user = load_user_module(art.root / "model" / "model.py")
        precision = art.plan["plan"].get("precision", "fp32")
        if precision != "fp32":
            phase = "serial"
            ref = _serial(user, art.plan, "fp32")
            pin = ref["routing"].indices if routing.pinnable(spec) and ref["routing"].indices else None
            low = _serial(user, art.plan, precision, pin)
            phase = "train"
            got = spawn(spec.world_size, _train_body, str(out / "compiled"), pin, timeout=300)[0]
            verdict = compare_low_precision(precision, got["losses"], low["losses"], ref["losses"],
                                            (got["grads"], low["grads"], ref["grads"]), got["replayed"])
            serial_losses = low["losses"]
            result["routing"] = (f"pinned to fp32's top-k: parallel's own choice differed for {got['unpinned']}, "
                                 f"serial {precision}'s for {low['routing'].said()}" if pin else "-")
        else:
            phase = "train"
            got = spawn(spec.world_size, _train_body, str(out / "compiled"), timeout=300)[0]
            phase = "serial"
            serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
            first = verify_grads.FirstGrads()
            first.grads = got["grads"]
            worst_grad = verify_grads.check(first, user, art.plan, 0)
            verdict = compare(got["losses"], serial_losses, got["state"], serial_state, TOLERANCES[precision],
                              worst_grad, verify_grads.GRAD_TOLERANCES[precision])
    except ParcError as e:
        # a family whose tiny model fails in eager PyTorch too is not parc's to refuse (checked only here: a
        # forward on CPU costs seconds); graph rules trace the model already in phase "rules"
        if phase in ("rules", "compile") and (why := families.check(family)) is not None:
            return {**result, "status": "UNBUILT", "reason": why, "where": "tiny config"}
        return {**result, "status": "REFUSED", "reason": _first_line(e), "where": _where(e), "phase": phase,
                "seconds": round(time.monotonic() - t0, 1)}
    except Exception as e:  # noqa: BLE001 — a crash is a result to report, with its traceback's last line
        tb = traceback.format_exception(e)
        last = next((x.strip() for x in reversed("".join(tb).splitlines()) if x.strip()), repr(e))
        return {**result, "status": "CRASH", "reason": last[:400], "where": phase,
                "traceback": "".join(tb)[-3000:], "seconds": round(time.monotonic() - t0, 1)}
    ok = verdict.ok and serial_losses[0] != serial_losses[-1]  # and the model trained
    # the tensor the verdict points at: a failed check's, the gradients' first (no optimizer between them and a cause)
    worst = (verdict.worst_param if "parameters" in verdict.failed and "gradients" not in verdict.failed
             else verdict.worst_grad or verdict.worst_param)
    return {**result, "status": "PASS" if ok else "WRONG", "error": verdict.render().replace("\n", " "),
            "loss_rel": verdict.loss_rel, "param_rel": verdict.param_rel,
            "worst_grad": [worst.name, worst.rel] if worst else None, "seconds": round(time.monotonic() - t0, 1)}


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
