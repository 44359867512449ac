"""Failure handling of `torchrun -m parc.run`: one rank's error stops the whole job fast, reported once.

The model is examples/gpt.py with a `get_batch` that fails on rank 1 at step 2 — user code failing
mid-training while rank 0 is already waiting in that step's collectives. It raises: the job must exit
non-zero well before the --timeout would matter twice over, with the user's message printed exactly once
(the failing rank's traceback; the others say in one line that a collective broke). It hangs (sleeps, or
stops itself with SIGSTOP): the job exits non-zero after --timeout with one line naming rank 1 and
step 2 (runtime/watchdog.py).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import GPT, compile_text
from test_checkpoint import _descendants, _running
from parc.runtime.launch import free_port

FAILING = '''

import os as _os
import signal as _signal
import time as _time

_get_batch = get_batch


def get_batch(step, batch_size):
    if step == 2 and _os.environ.get("RANK") == "1":
        if _os.environ.get("PARC_TEST_HANG"):
            _time.sleep(3600)  # stuck, not dead: only the process-group timeout can free rank 0
        if _os.environ.get("PARC_TEST_STOP"):
            _os.kill(_os.getpid(), _signal.SIGSTOP)  # every thread stopped, its watchdog too
        raise ValueError("corrupt shard 17: bad magic number")
    return _get_batch(step, batch_size)
'''


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Compiled once for both tests: the failure is chosen at run time by the environment."""
    tmp = tmp_path_factory.mktemp("failing")
    model = tmp / "failing_gpt.py"
    model.write_text(GPT.read_text() + FAILING)
    (tmp / "data").symlink_to(GPT.parent / "data")  # the model reads its corpus next to itself
    return compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp / "c", model=model).root


def _of_job(pid: int, compiled) -> bool:
    """Still a process of this job (its command line names the artifact), not a pid reused since."""
    try:
        return str(compiled).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _job(compiled, tmp_path, timeout: int, fault: str | None = None):
    """Run the job with `fault` (None, "hang", "stop") chosen for rank 1 at step 2; SIGKILL what is left."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "parc.run", str(compiled), "--steps", "5",
           "--timeout", str(timeout), "--metrics", str(tmp_path / "m.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({f"PARC_TEST_{fault.upper()}": "1"} if fault else {})}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()  # every worker met: once torchrun is gone, its orphans are no longer below it
    try:  # the time limit is the test's own guard: a hang fails here instead of stalling the suite
        while True:
            seen.update(_descendants(proc.pid))
            try:
                proc.stdout_text, proc.stderr_text = proc.communicate(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - t0 > 120:
                    raise
    finally:  # the workers too (torchrun gives them own sessions); a stopped one ignores SIGTERM
        for pid in [proc.pid, *seen]:
            if _running(pid) and _of_job(pid, compiled):
                os.kill(pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    print(f"\njob stopped after {elapsed:.1f}s, exit {proc.returncode}")
    return proc, proc.stdout_text + proc.stderr_text, elapsed


def test_one_rank_raises_every_rank_exits_once_reported(compiled, tmp_path):
    proc, out, elapsed = _job(compiled, tmp_path, 20)
    assert proc.returncode != 0, out
    # the exception line, once (the traceback also quotes the `raise` source line, which is not a copy)
    assert out.count("ValueError: corrupt shard 17: bad magic number") == 1, out
    assert "parc.run: rank 1 failed" in out, out
    assert elapsed < 90, f"{elapsed:.0f}s to stop a job with --timeout 20\n{out}"  # startup is slow on a loaded CI box


HUNG = ("parc.run: rank 1 hung: in step 2 it is still reading its batch while the other is computing; "
        "no progress for 8 s (--timeout). Exiting so the launcher can restart the job.")


def test_hung_rank_times_out(compiled, tmp_path):
    """Rank 1 sleeps inside step 2 while rank 0 waits in a collective: a watchdog fires after --timeout and
    names rank 1 from the progress each rank publishes."""
    proc, out, elapsed = _job(compiled, tmp_path, 8, fault="hang")
    assert proc.returncode != 0, out
    # whichever watchdog fires first prints it (both would print the same); the other rank's collective
    # breaks or torchrun stops it
    assert HUNG in out, out
    assert elapsed < 90, f"{elapsed:.0f}s to stop a job with --timeout 8\n{out}"


def test_stopped_rank_is_named_by_the_others(compiled, tmp_path):
    """Rank 1 SIGSTOPs itself in step 2, its watchdog thread with it: rank 0's watchdog must name it."""
    proc, out, elapsed = _job(compiled, tmp_path, 8, fault="stop")
    assert proc.returncode != 0, out
    assert HUNG in out, out
    # torchrun SIGTERMs the stopped rank, which cannot act on it, and SIGKILLs it 30 s later
    assert elapsed < 90, f"{elapsed:.0f}s to stop a job with --timeout 8\n{out}"


# --- the verdict, in one process ---------------------------------------------------------------------------

def test_verdict_names_the_ranks_behind():
    from parc.runtime.watchdog import verdict

    tail = "; no progress for 8 s (--timeout). Exiting so the launcher can restart the job."
    assert verdict(["3:compute", "2:compute", "3:data"], 8) == \
        "parc.run: rank 1 hung: its last step was 2 while the others reached step 3" + tail
    assert verdict(["2:data", "2:compute", "2:data", "2:compute"], 8) == ("parc.run: ranks 0, 2 hung: in step 2 they "
                                                                          "are still reading their batches while the "
                                                                          "others are computing" + tail)
    assert verdict(["0:compute", None], 8) == "parc.run: rank 1 hung: it never started a step while the other " \
                                              "reached step 0" + tail
    # nobody behind: no one to blame from outside
    assert verdict(["4:compute"] * 3, 8).startswith("parc.run: every rank is in step 4 (computing); none finished it")
    assert verdict(["4:data"], 8) == "parc.run: rank 0 hung in step 4 (reading its batch)" + tail


def test_marks_go_through_the_store_and_a_silent_store_does_not_hang(monkeypatch):
    import torch.distributed as dist

    from parc.runtime import watchdog

    store = dist.HashStore()
    dogs = [watchdog.Watchdog(3600, r, 3, store) for r in range(3)]
    dogs[0].mark(5, "data")
    dogs[0].mark(5, "compute")
    dogs[2].mark(5, "data")
    assert watchdog.read_marks(store, 3) == ["5:compute", None, "5:data"]
    assert dogs[1]._verdict() == watchdog.verdict(["5:compute", None, "5:data"], 3600)

    class Silent:  # the agent hosting the store is gone, or a main thread holds its client lock
        def set_timeout(self, _):
            pass

        def check(self, _):
            time.sleep(3600)

    monkeypatch.setattr(watchdog, "READ_SECONDS", 0.2)
    dogs[2].store = Silent()
    t0 = time.monotonic()
    line = dogs[2]._verdict()
    assert time.monotonic() - t0 < 5
    assert line.startswith("parc.run: rank 2 stopped in step 5 (reading its batch): no progress for 3600 s "
                           "(--timeout), and the other ranks' progress could not be read"), line
    for d in dogs:
        d.stop()


def _say(ctx, message: str):
    import torch.distributed as dist

    from parc.run import _first_to_say

    dist.barrier()  # both raise the same refusal at about the same moment, as a collective verdict does
    return _first_to_say(message), _first_to_say(f"{message} (rank {ctx.rank})")


def test_each_refusal_is_printed_by_exactly_one_rank():
    """A ParcError raised after start-up may come from one rank only (its batch, its shard): rank 0 alone
    printing left it unsaid (issue 29). Rank 0 prints what it raises; a refusal rank 0 did not raise is
    printed by the first other rank that raised it: once per job either way."""
    from parc.runtime.launch import spawn

    said = spawn(2, _say, "error: --data x.bin: token id 9999 ≥ 256")
    assert sum(same for same, _ in said) == 1  # the same refusal on both ranks: one line
    assert all(own for _, own in said)  # each rank's own: each printed


def test_the_ranks_a_verdict_names_are_the_ones_ended():
    from parc.runtime.watchdog import hung, verdict

    marks = ["3:data", "2:compute", "3:compute"]
    assert hung(marks) == [1] and verdict(marks, 8).startswith("parc.run: rank 1 hung: its last step was 2")
    assert hung(["2:data", "2:data"]) == []  # every rank at the same mark: nobody is blamed, nobody ended
