"""`torchrun --nproc-per-node N -m parc.run compiled/`: execute a compiled plan.

Every rank verifies the artifact, joins the process group (NCCL on GPUs, gloo on
CPU), builds its groups from the mesh and trains. Rank 0 shows progress and
writes metrics. Launch mistakes (a tampered artifact, a wrong world size) exit 2
with one line saying what to do. Run without torchrun, it is a world of one.

Failures: a rank whose code raises mid-run prints its traceback once and
exits at once (`_fail`); its closed sockets make every peer's pending
collective fail immediately (a peer that is merely stuck times out after
`--timeout`); each peer prints one line and exits 1; torchrun stops the job
non-zero (tests/test_failures.py). A rank that hangs (an endless loop in its data code, SIGSTOP) is
named by the others' watchdogs after --timeout (runtime/watchdog.py).
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
  torchrun --nproc-per-node 4 -m parc.run compiled/ --data train.bin --val-data val.bin --eval-every 100
  torchrun --nproc-per-node 4 --max-restarts 3 -m parc.run compiled/ --steps 10000 \\
      --checkpoint-dir ckpt/ --save-every 500 --resume auto --async-save --keep-last 3

A run with --checkpoint-dir stops safely on SIGTERM or Ctrl-C: it finishes a step, saves and exits 0.
Surviving failures (restarts, hung ranks, damaged checkpoints): docs/fault-tolerance.md.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parc.run", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("compiled", type=Path, help="directory written by `parc compile`")
    p.add_argument("--steps", type=int, default=20,
                   help="the step to train up to (default 20); with --resume, the total: the steps the checkpoint "
                        "holds count towards it")
    p.add_argument("--seed", type=int, default=0, help="seed for the initial weights and dropout (default 0)")
    p.add_argument("--log-every", type=int, default=1, metavar="N", help="log loss and speed every N steps")
    p.add_argument("--metrics", type=Path, default=Path("runs/metrics.jsonl"),
                   help="JSON-lines metrics file written by rank 0 (default runs/metrics.jsonl)")
    p.add_argument("--verify", action="store_true",
                   help="also train the serial model in-process on the same batches and compare; "
                        "exit 1 past the tolerance")
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative tolerance of --verify's loss and parameter checks against the serial run "
                        "(default 1e-4); its first-step gradient check keeps its own (runtime/verify_grads.py). "
                        "Under bf16/fp16 the default is instead to measure both runs from a serial fp32 run, "
                        "the parallel within 3x the serial's distance (runtime/verify.py); a --tolerance asks "
                        "for the direct comparison at that tolerance")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="pipeline (pp > 1): record every action of the last step on each rank, write "
                        "Chrome-trace JSON (open in Perfetto) to FILE and print the measured bubble fraction")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="process-group timeout in seconds: a collective waiting longer on a hung "
                        "rank fails and the job exits; also the watchdog's: a rank that makes no progress "
                        "this long is named in one line and the job exits 1 (default 600; "
                        "runtime/watchdog.py)")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="write a sharded checkpoint every N ≥ 1 steps and after the last one (needs "
                        "--checkpoint-dir)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                   help="where --save-every writes step_<N>/ checkpoints and a `latest` pointer; a fresh run "
                        "needs a new or empty directory, a resumed one a directory with nothing beyond the "
                        "step it resumes")
    p.add_argument("--overwrite-checkpoints", action="store_true",
                   help="let this run replace the checkpoints in --checkpoint-dir: at its first save, those "
                        "beyond the step it started from (all, for a fresh run) are deleted")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a checkpoint (or the latest in a --checkpoint-dir), saved under any "
                        "plan of the same model: any dp/tp/pp, any ZeRO stage; prints what it loaded and "
                        "every setting that differs. `auto`: the newest whole checkpoint in --checkpoint-dir "
                        "(a damaged one is set aside, the one before it used), a fresh start if there is none; "
                        "with torchrun --max-restarts a failed job comes back by itself (docs/fault-tolerance.md)")
    p.add_argument("--keep-last", type=int, default=None, metavar="K",
                   help="keep only the K newest checkpoints: older ones are deleted once a newer one is complete")
    p.add_argument("--async-save", action="store_true",
                   help="save in the background: the step after a save waits only for a copy of the state to "
                        "host memory, not for storage; the next save waits for the one in flight")
    p.add_argument("--on-save-error", choices=("stop", "continue"), default="stop",
                   help="a checkpoint that cannot be written (disk full, permission denied): stop (default: "
                        "exit 2 with one line; `latest` still names the last complete one) or continue training")
    p.add_argument("--weights", type=Path, default=None, metavar="PATH",
                   help="start from pretrained weights: a .safetensors file, a directory of shards with "
                        "model.safetensors.index.json, or a Hugging Face checkpoint directory; each rank reads "
                        "only its own slices (default: a from_pretrained directory the model file names, else "
                        "the model's own init under --seed; docs/weights.md)")
    p.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                   help="a nan/inf loss or gradient: stop (default: exit 2 before anything more is saved; "
                        "checked at log points, no extra sync) or skip the step (parameters and optimizer "
                        "state unchanged; one host sync per step)")
    p.add_argument("--data", type=Path, default=None, metavar="FILE",
                   help="train on a flat binary file of token ids (nanoGPT's train.bin), memory-mapped; each rank "
                        "reads only its own samples (runtime/data.py). Default: the model file's get_samples, "
                        "else its get_batch")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16",
                   help="the token id type of --data and --val-data (default uint16, GPT-2's 50257 ids fit)")
    p.add_argument("--val-data", type=Path, default=None, metavar="FILE",
                   help="held-out token file for --eval-every (default: the model file's get_val_samples or "
                        "get_val_batch)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="every N steps (and after the last) log the mean loss over --eval-batches held-out "
                        "global batches, the same ones each time")
    p.add_argument("--eval-batches", type=int, default=4, metavar="K",
                   help="held-out global batches per eval (default 4)")
    p.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="also write the metrics as TensorBoard event files to DIR (needs the tensorboard package)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="run more ranks than this machine has GPUs (they share them): each rank poses to "
                        "NCCL as a host of its own and talks over loopback sockets; slow, for checking a "
                        "plan before renting its GPUs (docs/pipeline.md)")
    return p


def _check_eval_args(args: argparse.Namespace, plan_json: dict) -> None:
    """--eval-every and its companions: refused in one line before any process starts training."""
    from parc.runtime.evaluate import refusal

    if args.eval_every is None:
        if args.val_data is not None:
            raise LaunchError(f"--val-data {args.val_data} is read only by evals: add --eval-every N")
        return
    if args.eval_every < 1 or args.eval_batches < 1:
        raise LaunchError(f"--eval-every {args.eval_every} --eval-batches {args.eval_batches}: both must be ≥ 1")
    if why := refusal(plan_json):
        raise LaunchError(why)


def _check_fault_args(args: argparse.Namespace, auto: bool) -> None:
    """The checkpoint flags of a run that survives failures, refused in one line before anything starts."""
    if auto and args.checkpoint_dir is None:
        raise LaunchError("--resume auto looks for checkpoints in --checkpoint-dir: add --checkpoint-dir DIR "
                          "--save-every N")
    if args.resume is not None and not auto:
        args.resume = Path(args.resume)
    if args.keep_last is not None and args.keep_last < 1:
        raise LaunchError(f"--keep-last {args.keep_last}: keep at least 1 checkpoint")
    for flag, given in (("--keep-last", args.keep_last is not None), ("--async-save", args.async_save)):
        if given and not args.save_every:
            raise LaunchError(f"{flag} applies to the checkpoints --save-every N writes; add --save-every N "
                              f"--checkpoint-dir DIR")


def _choose_auto(args: argparse.Namespace, lead: bool) -> Path | None:
    """`--resume auto`: the newest whole checkpoint in --checkpoint-dir, or None for a fresh start (collective)."""
    from parc.runtime.checkpoint import files as checkpoint_dir
    from parc.runtime.checkpoint.sharded import newest_complete

    saved, said = newest_complete(args.checkpoint_dir, lead) if args.checkpoint_dir.is_dir() else (None, [])
    if lead:
        for line in said:
            print(f"parc.run: warning: {line}", file=sys.stderr, flush=True)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        again = f" (torchrun restart {restart})" if restart != "0" else ""
        print(f"parc.run: --resume auto{again}: " + (f"resuming from {saved.path}" if saved else
                                                    f"no checkpoint in {args.checkpoint_dir}, starting fresh"),
              flush=True)
    checkpoint_dir.check_saving(args.save_every, args.checkpoint_dir, saved.step if saved else None,
                                args.overwrite_checkpoints, auto=True)
    return saved.path if saved else None


def _describe_data(d: dict) -> str:
    if d["source"] == "memmap":
        return f"{d['file']} ({d['dtype']} tokens, {d['samples']} samples, shuffled per epoch by --seed)"
    if d["source"] == "get_samples":
        return "get_samples (each rank reads its own samples)" + (f", {d['samples']} per epoch" if d["samples"] else "")
    return "get_batch (every rank reads the whole global batch and keeps its rows)"


def _single_process_env() -> None:
    if "RANK" in os.environ:
        return
    from parc.runtime.launch import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))


def run(args: argparse.Namespace) -> int:
    from parc import artifact

    art = artifact.load(args.compiled)
    world = int(os.environ["WORLD_SIZE"])
    if world != art.world_size:
        m = art.plan["mesh"]
        raise LaunchError(f"launched with {world} processes but {args.compiled} was compiled for dp {m['dp']} × "
                          f"pp {m['pp']} × tp {m['tp']} = {art.world_size}; use --nproc-per-node {art.world_size}")
    from parc.runtime import placement

    # every rank alike, before any process group and before torch loads (a refused launch ends in a moment)
    placed = placement.check(art.plan, dict(os.environ), args.oversubscribe)
    import torch.distributed as dist

    from parc.runtime.context import init_distributed
    from parc.runtime.metrics import Metrics
    from parc.runtime.train import Trainer
    from parc.runtime import verify as verifier
    from parc.runtime import verify_grads

    if args.steps < 1:
        raise LaunchError(f"--steps {args.steps}: need at least 1 step")
    if args.log_every < 1:
        raise LaunchError(f"--log-every {args.log_every}: need at least 1 (a line, and a metrics record, every N steps)")
    if args.trace is not None and art.plan["mesh"]["pp"] == 1:
        raise LaunchError(f"--trace {args.trace}: the trace records the pipeline schedule, and this plan has pp 1",
                          hint="trace a pipelined plan, or profile this one with torch.profiler")
    if args.verify and (why := verifier.dropout_refusal(art.plan)):  # before training, not after it
        raise LaunchError(why)
    _check_eval_args(args, art.plan)
    from parc.runtime.checkpoint import files as checkpoint_dir

    auto = args.resume == "auto"
    _check_fault_args(args, auto)
    # files only, before any process group, at start rather than at the first save; rank 0 alone stats the
    # shard files (a rank that refuses here exits, and torchrun stops the others). `--resume auto` chooses
    # after the process group is up (its checksums are shared out over the ranks), and checks then.
    lead_rank = os.environ.get("RANK", "0") == "0"
    if not auto:
        resumed = checkpoint_dir.open_checkpoint(args.resume, shards=lead_rank).step if args.resume else None
        checkpoint_dir.check_saving(args.save_every, args.checkpoint_dir, resumed, args.overwrite_checkpoints)
    # NCCL: a collective past --timeout aborts the communicator and raises instead of hanging forever
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if args.oversubscribe:  # before NCCL starts: it reads NCCL_HOSTID once
        import torch

        from parc.runtime.launch import oversubscribe_env

        os.environ.update(oversubscribe_env(dict(os.environ), torch.cuda.device_count()))
    lead = os.environ.get("RANK", "0") == "0"
    t_start = time.perf_counter()
    if lead:  # start-up takes seconds (process groups, building the model, sending shards): say so
        m = art.plan["mesh"]
        print(f"parc.run: {art.world_size} ranks (dp {m['dp']} × pp {m['pp']} × tp {m['tp']}{' × cp ' + str(m['cp']) if 'cp' in m else ''}); starting process "
              "groups, building the model and loading each rank's state", flush=True)
        for line in placed:
            print(f"parc.run: warning: {line}", file=sys.stderr, flush=True)
    init_distributed(args.timeout)
    if auto:
        args.resume = _choose_auto(args, lead)
    trainer = Trainer.load(art, args.seed, args.weights)
    if lead and trainer.compile_seconds is not None:  # `compile inductor`: paid here, once, not in step 0
        print(f"parc.run: compiled this rank's programs with {art.plan['plan']['compile']} in "
              f"{trainer.compile_seconds:.1f} s", flush=True)
    ctx, user = trainer.ctx, trainer.user
    from parc.runtime import data as data_sources

    G = art.plan["plan"]["batch"]["global"]
    trainer.data = data_sources.source_for(user, trainer.entry["inputs"], G, args.seed, args.data, args.data_dtype)
    val = None
    if args.eval_every:
        val = data_sources.source_for(user, trainer.entry["inputs"], G, args.seed, args.val_data, args.data_dtype,
                                      val=True)
        if val is None:
            raise LaunchError(f"--eval-every {args.eval_every}: no held-out split; give --val-data FILE, or define "
                              f"get_val_samples(indices) or get_val_batch(step, batch_size) in the model file")
    first = 0
    if args.resume is not None:
        from parc.runtime import checkpoint

        # steps done: get_batch(step) resumes the data
        first, said = checkpoint.resume(trainer, args.resume, sums=not auto)
        if first >= args.steps and auto:  # a restart after the last save: the job is done
            if lead:
                print(f"parc.run: {args.resume} holds {first} steps, --steps {args.steps}: nothing left to train",
                      flush=True)
            dist.destroy_process_group()
            return 0
        if first >= args.steps:
            raise LaunchError(f"--resume {args.resume} holds {first} steps already; ask for more with --steps")
        if lead:
            print(said, flush=True)
    low_precision = art.plan["plan"]["precision"] != "fp32" and args.tolerance is None
    replay = None  # bf16/fp16 --verify: the serial optimizer stepped with this run's gradients (rank 0)
    if args.verify and first == 0 and low_precision and lead:
        from parc.runtime.verify_replay import OptimizerReplay

        replay = OptimizerReplay(user, art.plan, args.seed, args.weights,
                                 skips=art.plan["plan"]["precision"] == "fp16" or args.on_nonfinite == "skip")
    # --verify: step 0's gradients (a resumed run has no step 0), and under bf16/fp16 every step's for the replay
    parallel_grads = verify_grads.FirstGrads((replay.feed if replay else _ignore) if low_precision else None,
                                             skips=art.plan["plan"]["precision"] == "fp16")
    if args.verify and first == 0:
        trainer.grad_observer = parallel_grads.of_trainer
    from parc.runtime.divergence import Guard

    guard = Guard(trainer, args.on_nonfinite, lead)
    saver = None
    if args.save_every:
        from parc.runtime import checkpoint

        saver = checkpoint.Saver(trainer, args.checkpoint_dir, replace=args.overwrite_checkpoints,
                                 keep_last=args.keep_last, asynchronous=args.async_save,
                                 keep_going=args.on_save_error == "continue")
    metrics = Metrics(args.steps, args.metrics, enabled=lead, first_step=first,
                      tensorboard=args.tensorboard)
    if lead:
        from parc.runtime.schedule_lr import describe

        print(f"parc.run: ready in {time.perf_counter() - t_start:.1f} s; steps {first}…{args.steps - 1}"
              + (f", metrics to {args.metrics}" if args.metrics else ""), flush=True)
        print(f"parc.run: data {_describe_data(trainer.data.describe())}; {describe(art.plan['plan']['optimizer'])}",
              flush=True)
    from parc.runtime import faults

    tokens = art.plan["plan"]["batch"]["global"] * art.plan["model"]["tokens_per_sample"]
    local, window, t_window = [], [], time.perf_counter()
    from parc.runtime.watchdog import Watchdog

    # each rank publishes its progress to the rendezvous store; a watchdog that fires reads who stopped
    store = dist.distributed_c10d._get_default_store() if ctx.world_size > 1 else None
    watchdog = Watchdog(args.timeout, ctx.rank, ctx.world_size, store, report=_error_file)
    trainer.progress = watchdog.mark  # twice a step: before and after fetching the batch
    from parc.runtime.lifeline import Stop

    stop = Stop(ctx.device) if saver else None  # SIGTERM/SIGINT: save after an agreed step, exit 0
    stopped = None
    try:
        for step in range(first, args.steps):
            faults.at_step(step, ctx.rank)  # PARC_FAULTS, for the chaos test (runtime/faults.py); else nothing
            if args.trace and trainer.pipeline is not None:
                trainer.pipeline.trace = step == args.steps - 1  # the last (warm) step
            log_point = (step + 1) % args.log_every == 0 or step + 1 == args.steps
            result = trainer.step(step, skip_nonfinite=args.on_nonfinite == "skip", want_norm=log_point)
            guard.watch(step, result)
            # and at the last step, as torchtitan does: a run given a --checkpoint-dir ends saved, even
            # one with --save-every beyond --steps
            if stop and stop.poll():
                stopped = step + 1
            if saver and ((step + 1) % args.save_every == 0 or step + 1 == args.steps or stopped):
                guard.check()  # a diverged step stops the run here, before its checkpoint
                saver.save(step + 1)
                guard.note_saved(step + 1)
            local.append(result.loss)
            window.append(result.loss)
            if log_point:
                guard.check()  # the losses are read here anyway (the one sync per log point)
                loss = guard.last_loss
                dt = (time.perf_counter() - t_window) / len(window)
                metrics.log(step, loss, tokens / dt, dt, advance=len(window), lr=result.lr, grad_norm=guard.last_norm)
                window, t_window = [], time.perf_counter()
            if val is not None and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                from parc.runtime.evaluate import eval_loss

                metrics.log_eval(step, eval_loss(trainer, val, args.eval_batches), args.eval_batches)
            if stopped:
                break
        if saver:
            saver.wait()  # the save in flight (--async-save) is complete before the run says done
    finally:
        metrics.close()
    losses = trainer.global_losses(local)
    if stopped:  # asked to stop: saved, nothing more to do (--trace and --verify want the whole run)
        watchdog.stop()
        if lead:
            print(f"parc.run: stopped by {stop.requested or 'a signal to another rank'} after {stopped} steps; "
                  f"saved {args.checkpoint_dir / f'step_{stopped}'}; continue with --resume "
                  f"{args.checkpoint_dir}", flush=True)
        dist.destroy_process_group()
        return 0
    if args.trace and trainer.pipeline is not None:
        from parc.runtime.parallel import pipeline

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
            # bf16/fp16: one forward per micro-batch, as the ranks run them: bf16 rounds each micro-batch's
            # gradient before the fp32 sum, so the grouping decides the rounding (runtime/verify_grads.py)
            scale_log = []  # fp16: (scale, skipped) per step of the serial run
            serial_losses, serial_state = verifier.train_serial(user, art.plan, args.seed, args.steps,
                                                                batch_of=trainer.data.whole,
                                                                weights=args.weights, per_micro_batch=low_precision,
                                                                scale_log=scale_log)
            precision = art.plan["plan"]["precision"]
            if not low_precision:
                worst_grad = verify_grads.check(parallel_grads, user, art.plan, args.seed, trainer.data.whole,
                                                args.weights)
                verdict = verifier.compare(losses, serial_losses, state, serial_state,
                                           args.tolerance or verifier.TOLERANCES[precision],
                                           worst_grad, verify_grads.GRAD_TOLERANCES[precision])
            else:  # bf16/fp16: both runs measured from the serial model in fp32 (runtime/verify.py)
                skipped = [step for step, (_, skip) in enumerate(scale_log) if skip]
                verdict = _verify_low_precision(user, art.plan, args, trainer.data.whole, losses, serial_losses,
                                                state, parallel_grads, replay, skipped)
            print(verdict.render(), flush=True)
            status = 0 if verdict.ok else 1
        flag = [status]
        dist.broadcast_object_list(flag, src=0)
        status = flag[0]
    if lead:
        print(f"done: {args.steps} steps, loss {losses[0]:.4f} → {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()
    return status


def _ignore(step: int, grads: dict) -> None:
    """What the ranks other than 0 do with each step's gathered gradients under --verify's replay: nothing."""


def _verify_low_precision(user, plan_json, args, batch_of, losses, serial_losses, state, parallel_grads, replay,
                          skipped: list[int]):
    """--verify's verdict under bf16/fp16 (runtime/verify.py `compare_low_precision`): the serial model trained
    again in fp32 on the same batches from the same weights is the reference the losses and first-step gradients
    are measured from; the parameters are held to the optimizer replayed on this run's gradients
    (runtime/verify_replay.py).
    `skipped`: fp16's steps the serial fp16 run skipped on overflow while its loss scale came down. The fp32
    reference skips them too (else it trains from step 0 while both fp16 runs stand still), and the gradients
    compared are those of the first step it did not skip, where the parallel run must have its first finite ones:
    a parallel run that overflows where serial does not, or the reverse, fails here."""
    from parc.runtime import verify as verifier
    from parc.runtime import verify_grads

    fp32 = verify_grads.in_precision(plan_json, "fp32")
    ref_losses, _ = verifier.train_serial(user, fp32, args.seed, args.steps, batch_of=batch_of, weights=args.weights,
                                          per_micro_batch=True, skip_steps=frozenset(skipped))
    precision = plan_json["plan"]["precision"]
    step = next((s for s in range(args.steps) if s not in skipped), None)  # None: serial applied no step
    grads, mismatch = None, None
    if parallel_grads.observed and parallel_grads.step != step:  # observed: not a resumed run
        mismatch = (f"the serial {precision} run's first step with finite gradients is "
                    f"{'none' if step is None else f'step {step}'}, this run's is "
                    f"{'none' if parallel_grads.step is None else f'step {parallel_grads.step}'}: its gradients "
                    f"overflowed {precision} where serial's did not, or the reverse")
    elif parallel_grads.grads is not None:
        grads = (parallel_grads.grads,
                 verify_grads.serial_grads(user, plan_json, args.seed, batch_of, args.weights, None, step, skipped),
                 verify_grads.serial_grads(user, plan_json, args.seed, batch_of, args.weights, "fp32", step, skipped))
    return verifier.compare_low_precision(precision, losses, serial_losses, ref_losses, grads,
                                          replay.check(state) if replay else None, step, mismatch)


def main(argv: list[str] | None = None) -> int:
    from parc.runtime.lifeline import tie_to_launcher

    tie_to_launcher()  # first: a worker whose torchrun is killed must not train on (runtime/lifeline.py)
    args = parser().parse_args(argv)
    _single_process_env()
    try:
        return run(args)
    except ParcError as e:
        _error_file(e.render())
        if _first_to_say(e.render()):
            print(e.render(), file=sys.stderr, flush=True)
        else:  # let the rank that prints exit first: torchrun SIGTERMs the rest at the first exit it sees,
            time.sleep(3)  # and a speaker killed before its print left the refusal unsaid (parc run's test)
        return 2
    except Exception as e:  # noqa: BLE001 — any failure mid-run: report once, then leave at once
        _fail(e)


def _first_to_say(message: str) -> bool:
    """Whether this rank prints `message`: exactly one rank prints each refusal, whichever rank raised it.

    Before the process group exists every rank runs the same checks on the same files and refuses alike,
    so rank 0 speaks for all. After it, a refusal may come from one rank only (its own batch, its own
    shard). Rank 0 still speaks for every refusal it raises too, and marks it in torchrun's store; another
    rank waits a moment for that mark and prints only if rank 0 did not raise the same message, the first
    such rank alone. If the store cannot answer, print: a repeated line beats a lost one.
    """
    import datetime
    import hashlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return os.environ.get("RANK", "0") == "0"
    key = f"parc/said/{hashlib.sha1(message.encode()).hexdigest()[:16]}"
    try:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set(key, "rank 0")
            return True
        store.set_timeout(datetime.timedelta(seconds=5))
        try:
            store.wait([key])  # rank 0 raised it too: it prints
            return False
        except Exception:  # noqa: BLE001 — a timeout: rank 0 did not (yet) say it
            pass
        return store.add(f"{key}/others", 1) == 1
    except Exception:  # noqa: BLE001 — the store's own failure must not hide the message
        return True


def _error_file(message: str) -> None:
    """Under torchrun, leave `message` where its job summary looks for a worker's root cause.

    torch.distributed.elastic's convention: the agent names a file per worker in
    TORCHELASTIC_ERROR_FILE; a JSON `{"message": str}` there is shown as that worker's error, in
    place of "To enable traceback see …", and no traceback of ours is printed. The layout is the one
    `torch.distributed.elastic.multiprocessing.errors.record` writes, the message standing in for
    its `py_callstack`: the summary prints that field.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json

        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        # written whole or not at all: torchrun SIGTERMs the other ranks once one has failed, and reads the
        # file of each that exited non-zero; a rank killed inside the write left it empty, and torchrun
        # itself died on the JSONDecodeError (tests/test_multinode.py, on a loaded machine)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
        os.replace(tmp, path)


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


def _exit(code: int) -> None:
    """Leave without interpreter finalization, once training is done and the process groups are destroyed.

    Why: torch's communication threads (gloo's workers, NCCL's watchdog) finish releasing the buffers
    of the last collectives a moment after `wait()` returns, and releasing a tensor whose Python object
    C++ kept alive takes the GIL. If that moment falls inside interpreter finalization, Python ends the
    thread with pthread_exit, whose forced unwind through a noexcept C++ frame calls std::terminate:
    "terminate called without an active exception", exit -6, after a run that printed `done` (about
    one run in six on 4 CPU ranks, most runs on the GPU). Nothing is left to finalize that matters:
    metrics are closed, stdout and stderr are flushed here.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
