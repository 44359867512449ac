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
