"""The `parc` command: check a plan, compile a model under it.

Every user mistake arrives here as a `ParcError`; it is printed with all its
diagnostics (`file:line:col: error: …`, the line, a caret, a hint) and the
command exits 2 — never with a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from parc.errors import Diagnostic, ParcError

DESCRIPTION = """parc compiles a parallel training plan (a .par file) and a PyTorch model file
into one readable program per rank, then runs them under torchrun.

  parc check   plan.par [--model model.py] [--world-size N]   find every mistake in a plan
  parc compile model.py --plan plan.par -o compiled/            write the per-rank programs
  torchrun --nproc-per-node N -m parc.run compiled/            train
"""


def _print(diags: list[Diagnostic]) -> None:
    for d in diags:
        print(d.render(), file=sys.stderr)


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise ParcError(f"{what} {path}: no such file")
    return path


def _batch_line(plan) -> str:
    m = plan.mesh
    return (f"mesh dp {m.dp} × pp {m.pp} × tp {m.tp} = {m.world_size} ranks; global batch {plan.global_batch} = "
            f"micro {plan.micro_batch} × accumulation {plan.accumulation} × dp {m.dp}")


def cmd_check(args) -> int:
    from parc.frontend import load_plan
    from parc.validate import validate

    plan = load_plan(_existing(args.plan, "plan"))
    module_paths = num_layers = None
    if args.model:
        from parc.trace import load_user_module, trace

        traced = trace(load_user_module(_existing(args.model, "model")), plan.micro_batch)
        module_paths, num_layers = traced.module_paths, traced.num_layers
    warnings = validate(plan, world_size=args.world_size, module_paths=module_paths, num_layers=num_layers)
    _print(warnings)
    print(f"{args.plan}: ok — {_batch_line(plan)}")
    return 0


def cmd_compile(args) -> int:
    from parc.compiler import compile_model
    from parc.frontend import load_plan

    plan = load_plan(_existing(args.plan, "plan"))
    result = compile_model(_existing(args.model, "model"), plan, args.output, debug=args.debug)
    _print(result.warnings)
    n = len(result.plan_json["programs"])
    print(f"wrote {args.output}/ in {result.seconds:.1f}s: {n} program{'s' * (n != 1)} for "
          f"{plan.world_size} ranks; {_batch_line(plan)}")
    print(f"run it: torchrun --nproc-per-node {plan.world_size} -m parc.run {args.output}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parc", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"parc {__import__('parc').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="parse and validate a plan; with --model, against the traced model too",
                       description="Report every error and warning in a plan. Exit 2 if there is an error.")
    c.add_argument("plan", type=Path, help="the .par file")
    c.add_argument("--model", type=Path, help="model file to check the plan against (module paths, layers)")
    c.add_argument("--world-size", type=int, help="the launch's world size, checked against dp × pp × tp")
    c.set_defaults(fn=cmd_check)

    k = sub.add_parser("compile", help="compile a model under a plan into a directory of per-rank programs",
                       description="Trace MODEL on the meta device (no memory for weights), apply the plan's "
                                   "passes, and write plan.json, one program per (stage, tp rank), a copy of "
                                   "the model and a MANIFEST to OUTPUT.")
    k.add_argument("model", type=Path, help="model file defining build_model(), get_batch(), loss_fn()")
    k.add_argument("--plan", type=Path, required=True, help="the .par file")
    k.add_argument("-o", "--output", type=Path, default=Path("compiled"), help="output directory (default compiled)")
    k.add_argument("--debug", action="store_true", help="log each pass's time and a before/after graph diff")
    k.set_defaults(fn=cmd_compile)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "debug", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.fn(args)
    except ParcError as e:
        _print(e.diagnostics)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
