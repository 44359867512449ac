"""Workers die with their launcher: a rank whose torchrun is gone stops at once, before it saves anything.

Start here: `tie_to_launcher()`, the first thing parc.run does under torchrun.

Why: torchrun starts each worker in a session of its own, so `kill -9` of the torchrun process (what
a scheduler or an impatient user does) reaches no worker. They are re-parented to init and train on:
appending to the metrics file, writing `step_<N>/` and moving `latest` while the user, seeing the
job gone, resumes from that same directory and races with them.

How: on Linux, `prctl(PR_SET_PDEATHSIG, SIGKILL)` asks the kernel to kill this process the moment its
parent (the torchrun agent that started it) exits, however it exits. SIGKILL, not SIGTERM: a worker
must not save a checkpoint or write a line after its job is gone (a SIGTERM handler might). The
kernel ties the signal to the parent thread, and torchrun starts its workers from its main thread,
which lives as long as the agent. Two gaps are closed by a watcher thread that checks the parent id
twice a second: the parent may have died between the fork and the prctl, and elsewhere than Linux
there is no prctl. Either way the process exits within about half a second of its launcher, by
`os._exit`, without flushing or saving anything.

Only under torchrun (`TORCHELASTIC_RUN_ID` in the environment): `python -m parc.run` alone is a world
of one whose parent is the user's shell, and Ctrl-C already reaches it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _pdeathsig(sig: int) -> bool:
    """Ask the kernel for `sig` when the parent exits; False where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tie_to_launcher(env: dict[str, str] | None = None, poll: float = 0.5) -> bool:
    """Under torchrun, make this process die with its launcher; whether it is now tied."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return False
    parent = os.getppid()
    if parent == 1:  # the launcher died before this line: nothing will signal the loss
        os._exit(1)
    _pdeathsig(signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent, poll), daemon=True, name="parc-lifeline").start()
    return True


def _watch(parent: int, poll: float) -> None:
    while True:
        if os.getppid() != parent:  # re-parented: the launcher is gone (and the kernel's signal did not come)
            os._exit(1)
        time.sleep(poll)


class Stop:
    """SIGTERM or SIGINT asks the run to stop: it saves a checkpoint after a step and exits cleanly.

    Why: a preemptible cluster (Slurm's `--signal`, Kubernetes, a spot instance) sends SIGTERM and
    waits a grace period before SIGKILL; Ctrl-C on torchrun reaches the workers as SIGTERM too.
    Dying at once loses every step since the last checkpoint.

    The signal reaches the ranks at different moments, maybe in different steps, and a save is
    collective: they must agree on the step after which they all stop. So at the end of every step
    each rank starts an asynchronous MAX all-reduce of its flag, and reads it at the end of the next
    step, when it has long completed (no wait, one element): every rank reads the same verdict at
    the same step. The run then stops one step after the earliest signal, saves, and exits 0. A
    second signal kills at once (the default action is restored after the first). Only a run that
    saves checkpoints waits: without --checkpoint-dir there is nothing to keep, and the signal's
    default action ends the process as before.
    """

    def __init__(self, device):
        import torch

        self.requested: str | None = None
        self._flag = torch.zeros(1, device=device)
        self._work = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)

    def poll(self) -> bool:
        """At the end of a step, on every rank: whether every rank stops now (collective, no wait)."""
        import torch.distributed as dist

        if self._work is not None:
            self._work.wait()
            if self._flag.item() > 0:
                return True
        self._flag.fill_(1.0 if self.requested else 0.0)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return False
