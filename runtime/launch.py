"""Spawn N local ranks with a process group, for tests and benchmarks.

`spawn(n, body, *args)` starts n processes on a free loopback port, initializes
torch.distributed (gloo on CPU), calls `body(ctx, *args)` on each rank and
returns the list of their return values, rank order. A failing rank's traceback
is re-raised in the parent; a hung world is killed after `timeout` seconds.
`body` must be importable by name (a module-level function), as with any spawn.

`oversubscribe_env` is `parc.run --oversubscribe`: more ranks than GPUs on one
machine, each rank posing to NCCL as a host of its own.

`start_env[r]` is set in the environment rank r's interpreter starts with: what
Python reads only at start-up, such as PYTHONHASHSEED (`env` is applied later,
inside the rank, for all ranks alike).

Ranks start from a fork server that has imported torch once (multiprocessing's
"forkserver", torch, torch.distributed, torch._dynamo and transformers preloaded): a fresh interpreter importing
torch costs seconds per rank, which on a small machine was most of a distributed
test's time (4 ranks: 7–16 s to start with "spawn", under 1 s forked). A forked rank
sees what a spawned one would: the caller's environment as of the call (applied
first thing in the rank, since the server's is older), the caller's sys.path and
main module, and modules imported fresh (only torch and transformers come from the
server, so they read the environment of the first spawn at import; parc is imported
in the rank, so a module reading the environment at import reads the caller's). Its stdout and stderr are the server's (the caller's at the first
spawn); a failing rank's traceback comes back through the result queue as before.
`start_env` needs a fresh interpreter, so it, and `PARC_START_METHOD=spawn`, use
"spawn".
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp


@dataclass(frozen=True)
class RankCtx:
    """What a rank body gets: its rank and the world's size (the group is initialized)."""

    rank: int
    world_size: int


def oversubscribe_env(env: dict[str, str], gpus: int) -> dict[str, str]:
    """The environment changes that let N ranks share `gpus` GPUs of one machine under NCCL.

    NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected"). Each rank gets its
    own NCCL_HOSTID, so NCCL sees N one-GPU hosts and connects them with its socket transport
    over loopback (NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1; the user's values win); LOCAL_RANK
    becomes the GPU this rank uses (local rank mod gpus, so ranks fill the GPUs round-robin) and
    LOCAL_WORLD_SIZE 1, so each rank builds its own copy of the model (runtime/checkpoint/state.py). NCCL
    reads these when the process group starts: call this before `init_process_group`.
    Slow (every message crosses a socket), but the collectives and kernels are the real ones.
    """
    local = int(env.get("LOCAL_RANK", env.get("RANK", "0")))
    out = {"NCCL_HOSTID": f"parc-rank-{env.get('RANK', '0')}",
           "LOCAL_RANK": str(local % gpus if gpus > 0 else 0),
           "LOCAL_WORLD_SIZE": "1",
           "NCCL_SOCKET_IFNAME": env.get("NCCL_SOCKET_IFNAME", "lo"),
           "NCCL_IB_DISABLE": env.get("NCCL_IB_DISABLE", "1")}
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, body: Callable, args: tuple, env: dict, results,
           caller_env: dict[str, str]) -> None:
    if os.environ != caller_env:  # forked from the server: its environment is from when it started
        os.environ.clear()
        os.environ.update(caller_env)
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.update(env)  # after: a test may pose as several hosts (LOCAL_WORLD_SIZE)
    torch.set_num_threads(1)  # several ranks share two cores: oversubscription only slows them
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        out = body(RankCtx(rank, world), *args)
        # plain pickle copies tensors by value; the queue's own reducer would share
        # them through file descriptors that close when this process exits
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 — forwarded to the parent verbatim
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # leave without interpreter finalization, as parc.run does (its `_exit` says why); the
        # result is already in the queue's pipe
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# what the fork server imports once (module docstring); torch._dynamo because every rank imports it anyway:
# a parameter initialised on meta (`Trainer.load`'s skeleton) goes through torch._refs, whose wrappers import
# it (1.3 s a rank measured here)
# transformers too, where it is installed (the server skips a module it cannot import): a rank of an HF model
# imports it anyway (2.6 s a rank measured here), and a rank of any other model pays nothing for it in a fork
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers.modeling_utils"]


def _context(fresh_interpreter: bool):
    """multiprocessing's "forkserver" with torch preloaded, or "spawn" where a rank needs a fresh interpreter."""
    method = os.environ.get("PARC_START_METHOD", "forkserver")
    if fresh_interpreter or method == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def spawn(world_size: int, body: Callable, *args: Any, timeout: float = 300.0,
          env: dict[str, str] | None = None, start_env: list[dict[str, str]] | None = None) -> list[Any]:
    ctx = _context(fresh_interpreter=bool(start_env))
    results = ctx.SimpleQueue()
    port = free_port()
    procs = []
    for r in range(world_size):
        extra = start_env[r] if start_env else {}
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)  # a spawned interpreter inherits the parent's environment at start
        try:
            p = ctx.Process(target=_entry, args=(r, world_size, port, body, args, env or {}, results,
                                                  dict(os.environ)), daemon=True)
            procs.append(p)
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    import time

    deadline = time.monotonic() + timeout
    got: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(got) + len(errors) < world_size:
            if results.empty():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout:.0f}s: "
                                       f"{sorted(set(range(world_size)) - set(got))}")
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        raise RuntimeError(f"rank process died with exit code {dead[0].exitcode}")
                time.sleep(0.02)
                continue
            rank, ok, value = results.get()
            if ok:
                got[rank] = pickle.loads(value)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                break  # one failure is enough; the rest may hang on a collective
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("a rank failed:\n" + "\n".join(errors))
    return [got[r] for r in range(world_size)]
