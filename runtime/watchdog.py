"""Hung ranks: find the rank that stopped, name it in one line, and exit so the launcher restarts the job.

Start here: `Watchdog`, which parc/run.py starts on every rank just before the first step and hands to
the Trainer as `trainer.progress`. `Trainer.step` calls it twice a step: `mark(step, "data")` before it
fetches the rank's batch (user code: get_batch, get_samples, a token file) and `mark(step, "compute")`
once the batch is in hand. Each mark restarts this rank's timer and publishes "<step>:<phase>" to the
torchrun rendezvous store (one `store.set`, one TCP round trip) under `parc/progress/<rank>`. The
process group's store already keeps each torchrun attempt's keys apart (runtime/context.py
`_attempt_store`), so a restarted job never reads its predecessor's marks.

When a rank's timer passes --timeout, its watchdog thread reads every rank's mark and prints the verdict
(`verdict`): the ranks furthest behind are the hung ones, e.g. `rank 1 hung: in step 2 it is still
reading its batch while the others are computing`, or `its last step was 2 while the others reached
step 3`. The verdict depends only on the marks, so whichever rank prints it (the hung one's own thread
still runs under an endless loop, not under SIGSTOP) prints the same line. When every rank is at the
same mark, no rank can be blamed from outside: the line says so. A named rank on this host is then
SIGKILLed (`end_hung_peers`: a stopped process never acts on torchrun's SIGTERM, which costs 30 s per
restart). Then `os._exit(1)`: no teardown that
could block on the hung peer; torchrun sees a worker fail, stops the others (SIGTERM, then SIGKILL 30 s
later for one that ignores it) and restarts the job under --max-restarts.

What --timeout covers. It is two deadlines of the same length. (1) The process-group timeout
(runtime/context.py `init_distributed`): a collective that waits longer fails, and under NCCL aborts
its communicator. That does not cover everything: an async gloo collective's `wait()` has no deadline,
and a rank stuck in its own code is in no collective at all. (2) This watchdog: from its start (after
start-up: process groups, model build, --resume's load) to the end of the last step, a rank must pass a
mark every --timeout seconds; so a batch must be fetched, and one step computed together with what
follows it before the next step's fetch (its checkpoint save, logging, --eval-every's held-out loss),
within --timeout each. Start-up before the first step is covered only by (1); `stop` ends the watch
after training, because --verify's serial run on rank 0 may legitimately take longer.

The store is read from a thread of its own, bounded by a few seconds: a read must not hang the
watchdog, e.g. when the store's client lock is held by a main thread stuck in a store call, or the
agent hosting the store is gone. Then the line says the marks could not be read.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Callable

PHASES = {"data": "reading its batch", "compute": "computing"}  # in the order a step passes them
READ_SECONDS = 5.0  # each store call of the verdict's read; the read is given up one second after that


def key(rank: int) -> str:
    return f"parc/progress/{rank}"


def _position(mark: str | None) -> tuple[int, int]:
    """'3:compute' → (3, 1): marks order by step, then by phase; None (never marked) before any."""
    if mark is None:
        return -1, -1
    step, phase = mark.split(":")
    return int(step), list(PHASES).index(phase)


def describe(mark: str | None) -> str:
    """'2:data' → 'step 2 (reading its batch)'."""
    if mark is None:
        return "start-up, before its first step"
    step, phase = mark.split(":")
    return f"step {step} ({PHASES[phase]})"


def verdict(marks: list[str | None], timeout: float) -> str:
    """The one line naming the hung ranks, from every rank's last mark (None: it never marked a step)."""
    tail = f"no progress for {timeout:g} s (--timeout). Exiting so the launcher can restart the job."
    pos = [_position(m) for m in marks]
    low, high = min(pos), max(pos)
    if low == high:
        if len(marks) == 1:
            return f"parc.run: rank 0 hung in {describe(marks[0])}; {tail}"
        if marks[0] is None:
            return f"parc.run: no rank started a step; {tail}"
        where = describe(marks[0]).replace("its batch", "their batches")
        return f"parc.run: every rank is in {where}; none finished it (one hung inside it, or all wait on one); {tail}"
    behind = [r for r, p in enumerate(pos) if p == low]
    one, others = len(behind) == 1, len(pos) - len(behind)
    who = ("rank " if one else "ranks ") + ", ".join(map(str, behind))
    it, its, is_ = ("it", "its", "is") if one else ("they", "their", "are")
    them = "the other" + ("" if others == 1 else "s")
    if low[0] < 0:
        where = f"{it} never started a step while {them} reached step {high[0]}"
    elif low[0] < high[0]:
        where = f"{its} last step was {low[0]} while {them} reached step {high[0]}"
    else:  # the same step, an earlier phase: reading its batch while the others compute
        doing = list(PHASES.values())[low[1]]
        doing = doing if one else doing.replace("its batch", "their batches")
        where = (f"in step {low[0]} {it} {is_} still {doing} while {them} {'is' if others == 1 else 'are'} "
                 f"{list(PHASES.values())[high[1]]}")
    return f"parc.run: {who} hung: {where}; {tail}"


def hung(marks: list[str | None]) -> list[int]:
    """The ranks `verdict` names: those furthest behind, or none when every rank is at the same mark."""
    pos = [_position(m) for m in marks]
    return [] if min(pos) == max(pos) else [r for r, p in enumerate(pos) if p == min(pos)]


def pid_key(rank: int) -> str:
    return f"parc/pid/{rank}"


def end_hung_peers(store, ranks: list[int]) -> list[int]:
    """SIGKILL the named hung ranks that run on this host (each published "<host>:<pid>" at start); the
    ranks ended. Why: torchrun's restart first SIGTERMs every worker and waits 30 s before SIGKILL, and a
    stopped (SIGSTOP) or wedged process never acts on SIGTERM: 30 s lost per such hang. Only a process
    whose command line is parc.run's is touched, so a pid reused since cannot be hit."""
    import signal
    import socket

    ended = []
    for r in ranks:
        try:
            host, pid = store.get(pid_key(r)).decode().rsplit(":", 1)
            if host != socket.gethostname():
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"parc.run" not in f.read():
                    continue
            os.kill(int(pid), signal.SIGKILL)
            ended.append(r)
        except (OSError, ValueError, RuntimeError):  # gone already, another host, no /proc: torchrun's job
            continue
    return ended


def read_marks(store, world: int) -> list[str | None]:
    """Every rank's last mark; a rank that never marked is None. Raises if the store does not answer."""
    store.set_timeout(datetime.timedelta(seconds=READ_SECONDS))
    keys = [key(r) for r in range(world)]
    if store.check(keys):  # the usual case, two round trips whatever the world; `get` waits for a missing key
        return [v.decode() for v in store.multi_get(keys)]
    return [store.get(k).decode() if store.check([k]) else None for k in keys]


class Watchdog:
    """This rank's marks, published; a thread that exits the process after --timeout s without one.

    `store`: the rendezvous store (None in a world of one: there is no one else to blame). `report`: also
    given the verdict line, for torchrun's job summary (parc.run passes its error-file writer).
    """

    def __init__(self, timeout: float, rank: int, world: int, store=None,
                 report: Callable[[str], None] | None = None):
        self.timeout, self.rank, self.world, self.store, self.report = timeout, rank, world, store, report
        self.last: float | None = time.monotonic()
        self.what: str | None = None  # this rank's last mark
        self.marks: list[str | None] | None = None  # every rank's, once read for a verdict
        if store is not None:  # where a peer can find this process, to end it if it hangs (`end_hung_peers`)
            import socket

            store.set(pid_key(rank), f"{socket.gethostname()}:{os.getpid()}")
        threading.Thread(target=self._watch, daemon=True, name="parc-watchdog").start()

    def mark(self, step: int, phase: str) -> None:
        """This rank reached `phase` (a PHASES key) of `step`: restart the timer and tell the others."""
        self.what = f"{step}:{phase}"
        self.last = time.monotonic()
        if self.store is not None:
            self.store.set(key(self.rank), self.what)

    def stop(self) -> None:
        self.last = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 10))
            last = self.last
            if last is not None and time.monotonic() - last > self.timeout:
                line = self._verdict()
                print(line, file=sys.stderr, flush=True)
                if self.report is not None:
                    self.report(line)
                if self.marks is not None and (others := [r for r in hung(self.marks) if r != self.rank]):
                    self._end(others)
                sys.stdout.flush()
                os._exit(1)

    def _end(self, ranks: list[int]) -> None:
        """End the hung peers on this host, bounded like the read (the store may be slow or gone)."""
        reader = threading.Thread(target=end_hung_peers, args=(self.store, ranks), daemon=True,
                                  name="parc-watchdog-end")
        reader.start()
        reader.join(READ_SECONDS + 1.0)

    def _verdict(self) -> str:
        if self.store is None:  # a world of one
            return verdict([self.what], self.timeout)
        got: list = []

        def read() -> None:
            try:
                got.append(read_marks(self.store, self.world))
            except Exception as e:  # noqa: BLE001 — the store is gone or slow: say so, and exit anyway
                got.append(e)

        reader = threading.Thread(target=read, daemon=True, name="parc-watchdog-read")
        reader.start()
        reader.join(READ_SECONDS + 1.0)
        if got and isinstance(got[0], list):
            self.marks = got[0]
            return verdict(got[0], self.timeout)
        why = (str(got[0]).strip().splitlines() or [type(got[0]).__name__])[0][:200] if got else "no answer"
        return (f"parc.run: rank {self.rank} stopped in {describe(self.what)}: no progress for {self.timeout:g} s "
                f"(--timeout), and the other ranks' progress could not be read from the rendezvous store "
                f"({why}). Exiting so the launcher can restart the job.")
