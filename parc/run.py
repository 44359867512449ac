"""`torchrun --nproc-per-node N -m parc.run compiled/`: execute a compiled plan.

Every rank verifies the artifact, joins the process group (NCCL on GPUs, gloo on
CPU), builds its groups from the mesh and trains. Rank 0 shows progress and
writes metrics. Launch mistakes (a tampered artifact, a wrong world size) exit 2
with one line saying what to do. Run without torchrun, it is a world of one.

Failures: a rank whose code raises mid-run prints its traceback once and
exits at once (`_fail`); its closed sockets make every peer's pending
collective fail immediately (a peer that is merely stuck times out after
`--timeout`); each peer prints one line and exits 1; torchrun stops the job
non-zero (tests/test_failures.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from parc.errors import LaunchError, ParcError

EPILOG = """examples:
  torchrun --nproc-per-node 4 -m parc.run compiled/ --steps 20
  torchrun --nproc-per-node 4 -m parc.run compiled/ --steps 3 --verify
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parc.run", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("compiled", type=Path, help="directory written by `parc compile`")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to run (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and dropout (default 0)")
    p.add_argument("--log-every", type=int, default=1, metavar="N", help="log loss and speed every N steps")
    p.add_argument("--metrics", type=Path, default=Path("runs/metrics.jsonl"),
                   help="JSON-lines metrics file written by rank 0 (default runs/metrics.jsonl)")
    p.add_argument("--verify", action="store_true",
                   help="also train the serial model in-process on the same batches and compare; "
                        "exit 1 past the tolerance")
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative tolerance for --verify (default 1e-4; bf16 1e-2)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="pipeline (pp > 1): record every action of the last step on each rank, write "
                        "Chrome-trace JSON (open in Perfetto) to FILE and print the measured bubble fraction")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="process-group timeout in seconds: a collective waiting longer on a hung "
                        "rank fails and the job exits (default 600)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="write a sharded checkpoint every N steps (needs --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="where --save-every writes step_<N>/ checkpoints and a `latest` pointer")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR",
                   help="continue from a checkpoint (or the latest in a --checkpoint-dir), saved under any "
                        "plan of the same model: any dp/tp/pp, any ZeRO stage")
    return p


def _single_process_env() -> None:
    if "RANK" in os.environ:
        return
    from parc.runtime.launch import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from parc import artifact
    from parc.runtime.context import init_distributed
    from parc.runtime.metrics import Metrics
    from parc.runtime.train import Trainer
    from parc.runtime import verify as verifier

    art = artifact.load(args.compiled)
    world = int(os.environ["WORLD_SIZE"])
    if world != art.world_size:
        m = art.plan["mesh"]
        raise LaunchError(f"launched with {world} processes but {args.compiled} was compiled for dp {m['dp']} × "
                          f"pp {m['pp']} × tp {m['tp']} = {art.world_size}; use --nproc-per-node {art.world_size}")
    if args.steps < 1:
        raise LaunchError(f"--steps {args.steps}: need at least 1 step")
    if args.verify and (why := verifier.dropout_refusal(art.plan)):  # before training, not after it
        raise LaunchError(why)
    # NCCL: a collective past --timeout aborts the communicator and raises instead of hanging forever
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    init_distributed(args.timeout)
    trainer = Trainer.load(art, args.seed)
    ctx, user = trainer.ctx, trainer.user
    if args.save_every and args.checkpoint_dir is None:
        raise LaunchError(f"--save-every {args.save_every} needs --checkpoint-dir DIR to write into")
    first = 0
    if args.resume is not None:
        from parc.runtime import checkpoint

        first = checkpoint.load(trainer, args.resume)  # steps already done: get_batch(step) resumes the data
        if first >= args.steps:
            raise LaunchError(f"--resume {args.resume} holds {first} steps already; ask for more with --steps")
    lead = ctx.rank == 0
    metrics = Metrics(args.steps, args.metrics, enabled=lead)
    tokens = art.plan["plan"]["batch"]["global"] * art.plan["model"]["tokens_per_sample"]
    local, window, t_window = [], [], time.perf_counter()
    watchdog = _Watchdog(args.timeout, ctx.rank)
    try:
        for step in range(first, args.steps):
            watchdog.tick(f"step {step}")
            if args.trace and trainer.pipeline is not None:
                trainer.pipeline.trace = step == args.steps - 1  # the last (warm) step
            result = trainer.step(step)
            if args.save_every and (step + 1) % args.save_every == 0:
                from parc.runtime import checkpoint

                checkpoint.save(trainer, args.checkpoint_dir, step + 1)
            local.append(result.loss)
            window.append(result.loss)
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
                loss = trainer.global_losses(window)[-1]
                dt = (time.perf_counter() - t_window) / len(window)
                metrics.log(step, loss, tokens / dt, dt, advance=len(window))
                window, t_window = [], time.perf_counter()
    finally:
        metrics.close()
    losses = trainer.global_losses(local)
    if args.trace and trainer.pipeline is not None:
        from parc.runtime import pipeline

        events = trainer.pipeline.gather_trace()
        if lead:
            pipeline.write_chrome_trace(events, args.trace, args.steps - 1)
            print(f"trace: {args.trace} (step {args.steps - 1}, the pp ranks of dp 0); measured bubble "
                  f"{pipeline.measured_bubble(events):.3f} of the step", flush=True)
    watchdog.stop()  # --verify's serial training on rank 0 may legitimately outlast --timeout
    status = 0
    if args.verify:
        state = trainer.gathered_state()
        if lead:
            serial_losses, serial_state = verifier.train_serial(user, art.plan, args.seed, args.steps)
            verdict = verifier.compare(losses, serial_losses, state, serial_state,
                                       args.tolerance or verifier.TOLERANCES[art.plan["plan"]["precision"]])
            print(verdict.render(), flush=True)
            status = 0 if verdict.ok else 1
        flag = [status]
        dist.broadcast_object_list(flag, src=0)
        status = flag[0]
    if lead:
        print(f"done: {args.steps} steps, loss {losses[0]:.4f} → {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()
    return status


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _single_process_env()
    try:
        return run(args)
    except ParcError as e:
        if os.environ.get("RANK", "0") == "0":
            print(e.render(), file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 — any failure mid-run: report once, then leave at once
        _fail(e)


class _Watchdog:
    """Exit this rank when one step (with its checkpoint and logging) makes no progress for --timeout s.

    The process-group timeout does not cover every wait: a rank stuck in user code leaves its peers in
    an async gloo collective whose `wait()` has no deadline. Every rank runs this, the stuck one too, so
    every rank is gone about --timeout after the last step that finished anywhere.
    """

    def __init__(self, timeout: float, rank: int):
        import threading

        self.timeout, self.rank = timeout, rank
        self.mark: float | None = time.monotonic()
        self.what = "start"
        threading.Thread(target=self._watch, daemon=True, name="parc-watchdog").start()

    def tick(self, what: str) -> None:
        self.mark, self.what = time.monotonic(), what

    def stop(self) -> None:
        self.mark = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            mark = self.mark
            if mark is not None and time.monotonic() - mark > self.timeout:
                print(f"parc.run: rank {self.rank} stopped: {self.what} made no progress for "
                      f"{self.timeout:g} s (--timeout); a rank hung or failed", file=sys.stderr, flush=True)
                os._exit(1)


def _peer_failure(e: BaseException) -> bool:
    """A communication error: this rank is fine, a peer died or hung (its own error is printed there)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out", "Gloo", "gloo",
        "NCCL", "Broken pipe"))


def _fail(e: BaseException) -> None:
    """Print the error (the failing rank: one traceback; a rank whose collective broke: one line) and exit 1.

    `os._exit` skips destroy_process_group and interpreter teardown, either of which can block on peers:
    the sockets close now, so every peer's pending gloo collective fails at once instead of after
    --timeout, and torchrun, seeing a worker exit non-zero, stops the rest of the job.
    """
    import traceback

    rank = os.environ.get("RANK", "0")
    if _peer_failure(e):
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f"parc.run: rank {rank} stopped: a collective failed ({first}); another rank failed or hung "
              f"— its error is printed above or below", file=sys.stderr, flush=True)
    else:
        print(f"parc.run: rank {rank} failed:\n" + "".join(traceback.format_exception(e)).rstrip(),
              file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
