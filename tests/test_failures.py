"""Failure handling of `torchrun -m parc.run`: one rank's error stops the whole job fast, reported once.

The model is examples/gpt.py with a `get_batch` that raises on rank 1 at step 2 — user code failing
mid-training while rank 0 is already waiting in that step's collectives. The job must exit non-zero well
before the --timeout would matter twice over, with the user's message printed exactly once (the failing
rank's traceback; the others say in one line that a collective broke).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import GPT, compile_text
from test_checkpoint import _descendants
from parc.runtime.launch import free_port

FAILING = '''

import os as _os
import time as _time

_get_batch = get_batch


def get_batch(step, batch_size):
    if step == 2 and _os.environ.get("RANK") == "1":
        if _os.environ.get("PARC_TEST_HANG"):
            _time.sleep(3600)  # stuck, not dead: only the process-group timeout can free rank 0
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


def _job(compiled, tmp_path, timeout: int, hang: bool):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "parc.run", str(compiled), "--steps", "5",
           "--timeout", str(timeout), "--metrics", str(tmp_path / "m.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PARC_TEST_HANG": "1"} if hang else {})}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the time limit is the test's own guard: a hang fails here instead of stalling the suite
        proc.stdout_text, proc.stderr_text = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:  # the workers too: torchrun gives them own sessions
            os.kill(pid, signal.SIGKILL)
        raise
    elapsed = time.monotonic() - t0
    print(f"\njob stopped after {elapsed:.1f}s")
    return proc, proc.stdout_text + proc.stderr_text, elapsed


def test_one_rank_raises_every_rank_exits_once_reported(compiled, tmp_path):
    proc, out, elapsed = _job(compiled, tmp_path, 20, hang=False)
    assert proc.returncode != 0, out
    # the exception line, once (the traceback also quotes the `raise` source line, which is not a copy)
    assert out.count("ValueError: corrupt shard 17: bad magic number") == 1, out
    assert "parc.run: rank 1 failed" in out, out
    assert elapsed < 90, f"{elapsed:.0f}s to stop a job with --timeout 20\n{out}"  # startup is slow on a loaded CI box


def test_hung_rank_times_out(compiled, tmp_path):
    """Rank 1 sleeps inside step 2 while rank 0 waits in a collective: a watchdog fires after --timeout."""
    proc, out, elapsed = _job(compiled, tmp_path, 8, hang=True)
    assert proc.returncode != 0, out
    # whichever watchdog fires first exits; the other rank's collective breaks or torchrun stops it
    assert "stopped: step 2 made no progress for 8 s (--timeout)" in out, out
    assert elapsed < 90, f"{elapsed:.0f}s to stop a job with --timeout 8\n{out}"
