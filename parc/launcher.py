"""`parc run DIR`: torchrun for a compiled plan, whose output is parc's lines alone.

Start here: `main(argv)`. `torchrun --nproc-per-node N -m parc.run DIR` stays the documented form,
and this runs exactly that, through torchrun's own API (`torch.distributed.run`), in this process.
What it adds is what a first job trips over:

- the rank count defaults to the plan's (plan.json), and `--oversubscribe` is added when the plan's
  topology puts fewer GPUs on a node than it has ranks (one machine standing in for its nodes);
- OMP_NUM_THREADS defaults to 1 as torchrun sets it, without torchrun's banner saying so;
- a failed job ends with one line (which rank, which exit code) instead of torchrun's 45-62-line
  `ChildFailedError` traceback: the failing rank's own error is printed above it by the rank;
- torchrun's progress logging (its W/I lines) is left out; `--verbose` keeps it.

Every option parc.run takes is passed through; torchrun's own are the ones below (`parc run --help`).
The exit code is the failing rank's (2 for a refused launch, 1 for a failure), 0 on success.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from parc.errors import ParcError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parc run", description=__doc__.split("\n\n")[0],
        epilog="every other option goes to parc.run (python -m parc.run --help): e.g.\n"
               "  parc run compiled/ --steps 100 --checkpoint-dir ckpt/ --save-every 20\n"
               "  parc run compiled/ --max-restarts 3 --checkpoint-dir ckpt/ --save-every 20 --resume auto",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("compiled", type=Path, help="directory written by `parc compile`")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="ranks on this machine (default: all the plan's ranks, on one machine)")
    p.add_argument("--nnodes", default="1", help="machines (torchrun's --nnodes; default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's index (static rendezvous)")
    p.add_argument("--rdzv-backend", default=None, help="torchrun's rendezvous backend (c10d for several nodes)")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="the rendezvous host:port")
    p.add_argument("--rdzv-id", default=None, help="a word the job's machines share")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restart the ranks up to K times after a failure (with --resume auto: "
                        "docs/fault-tolerance.md)")
    p.add_argument("--verbose", action="store_true", help="keep torchrun's own log lines")
    return p


def _plan_ranks(compiled: Path) -> tuple[int, bool]:
    """(the plan's rank count, whether one machine needs --oversubscribe to hold them: parc/cli.py's rule)."""
    try:
        plan_json = json.loads((compiled / "plan.json").read_text())
    except (OSError, ValueError) as e:
        raise ParcError(f"{compiled}: no readable plan.json ({type(e).__name__}); is it a `parc compile` "
                        f"output directory?") from None
    world = len(plan_json["ranks"])
    from parc.runtime.placement import stated_topology

    gpn = stated_topology(plan_json["plan"])[0].get("gpus_per_node")
    return world, gpn is not None and world > gpn


def _first_failure(failures: dict) -> tuple[int, object]:
    """The rank whose failure stopped the job: one that exited by itself (code > 0) before any torchrun killed.
    torchrun SIGTERMs the other ranks once one exits, and on a busy machine the killed ranks' failures can be
    stamped earlier than the one that exited with the error; a signal is the first failure only when no rank
    exited by itself (a rank killed from outside: the OOM killer, say)."""
    own = {r: f for r, f in failures.items() if f.exitcode > 0}
    return min((own or failures).items(), key=lambda kv: kv[1].timestamp)


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(argv)
    world, over = _plan_ranks(args.compiled)
    nproc = args.nproc_per_node or world
    if over and args.nnodes == "1" and "--oversubscribe" not in rest:
        rest.append("--oversubscribe")
        print(f"parc run: the plan's topology puts fewer GPUs on a node than its {world} ranks: "
              f"running them on this machine with --oversubscribe", file=sys.stderr, flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    targv = ["--nproc-per-node", str(nproc), "--nnodes", args.nnodes, "--max-restarts", str(args.max_restarts)]
    for flag, value in (("--node-rank", args.node_rank), ("--rdzv-backend", args.rdzv_backend),
                        ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id)):
        if value is not None:
            targv += [flag, str(value)]
    targv += ["-m", "parc.run", str(args.compiled), *rest]

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not args.verbose:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(targv))
    except ChildFailedError as e:
        rank, failure = _first_failure(e.failures)
        code = failure.exitcode
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"parc run: the job failed: rank {rank} stopped first ({why}); its error is printed above",
              file=sys.stderr, flush=True)
        return code if code > 0 else 1
    except SignalException as e:
        print(f"parc run: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    return 0
