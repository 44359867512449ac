"""Faults injected on purpose, for the chaos test: what a long run meets, on a schedule, each once per job.

Start here: `PARC_FAULTS`, a comma-separated list of `<fault>@<step>[:<rank>]` (rank 0 when omitted):

  kill@S:R           rank R kills itself (SIGKILL) as step S starts: a worker lost
  kill-launcher@S    rank 0 kills its torchrun agent (SIGKILL) as step S starts: the job is gone
  stop@S:R           rank R stops itself (SIGSTOP) as step S starts: a rank that no longer runs
  hang@S:R           rank R sleeps forever as step S starts: user data code that never returns
  raise@S:R          rank R raises as step S starts, where it reads its batch: a data error
  kill-in-save@S:R   rank R kills itself inside the save of step_S, after DCP wrote, before it is sealed
  corrupt@S          once step_S is complete, one byte of one of its shard files is flipped
  enospc@S:R         the save of step_S fails on rank R with "No space left on device"

`PARC_FAULTS_DONE=DIR` (required with PARC_FAULTS): a fault fires once per job, not once per process:
before firing, a rank creates DIR/<fault>@<step>:<rank> exclusively, and a fault whose marker exists
is skipped, so the torchrun restart that redoes step S does not meet the fault again.

Every fault prints one line, `parc.run: fault injected: …`, with the time, before it acts: the chaos
test (tests/test_chaos.py) reads the time lost per fault from them. Without PARC_FAULTS nothing here
runs beyond one dictionary lookup per step.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

KINDS = ("kill", "kill-launcher", "stop", "hang", "raise", "kill-in-save", "corrupt", "enospc")


def parse(text: str) -> dict[tuple[str, int], int]:
    """{(fault, step): rank} from PARC_FAULTS' text."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, at = item.partition("@")
        step, _, rank = at.partition(":")
        if kind not in KINDS or not step.isdigit() or (rank and not rank.isdigit()):
            raise ValueError(f"PARC_FAULTS: {item!r} is not <fault>@<step>[:<rank>] with a fault among "
                             f"{', '.join(KINDS)}")
        out[(kind, int(step))] = int(rank or 0)
    return out


_SCHEDULE = parse(os.environ.get("PARC_FAULTS", ""))


def _fire(kind: str, step: int, rank: int) -> bool:
    """Whether `kind` fires here and now: scheduled for this step and rank, and not yet fired in this job."""
    if _SCHEDULE.get((kind, step), -1) != rank:
        return False
    done = Path(os.environ["PARC_FAULTS_DONE"])
    done.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(done / f"{kind}@{step}:{rank}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    print(f"parc.run: fault injected: {kind} at step {step} on rank {rank} (t={time.time():.3f})",
          file=sys.stderr, flush=True)
    return True


def at_step(step: int, rank: int) -> None:
    """The faults of the start of a step."""
    if not _SCHEDULE:
        return
    if _fire("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if _fire("kill-launcher", step, rank):
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(60)  # runtime/lifeline.py ends this process as its launcher goes
    if _fire("stop", step, rank):
        os.kill(os.getpid(), signal.SIGSTOP)
    if _fire("hang", step, rank):
        while True:
            time.sleep(3600)
    if _fire("raise", step, rank):
        raise OSError(f"injected fault: reading the batch of step {step} failed (PARC_FAULTS)")


def in_save(step: int, rank: int) -> None:
    """Inside the save of step_<step>, after the tensors are written, before the checkpoint is sealed."""
    if _SCHEDULE and _fire("kill-in-save", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def after_commit(step: int, final: Path) -> None:
    """Rank 0, once step_<step> is complete and named by `latest`."""
    if _SCHEDULE and _fire("corrupt", step, 0):
        shard = sorted(final.glob("*.distcp"))[-1]
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))


def writer(path: Path, step: int, rank: int):
    """DCP's file writer for step_<step>, or one that fails with ENOSPC on this rank (`enospc`)."""
    import torch.distributed.checkpoint as dcp

    if not (_SCHEDULE and _SCHEDULE.get(("enospc", step), -1) == rank):
        return dcp.FileSystemWriter(path)

    class Full(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            if _fire("enospc", step, rank):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return super().write_data(plan, planner)

    return Full(path)
