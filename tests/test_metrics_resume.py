"""Metrics after --resume: each step appears once, in metrics.jsonl and in TensorBoard.

A run that logged steps 0..14 and crashed with its last checkpoint at step 10 resumes at step 10 and
runs steps 10..14 again: their old records must go (runtime/metrics.py `keep_before`), as must a
line half-written at the crash. The unit tests build `Metrics` directly; the last test runs the real
command line in one process (a world of one), crashed by hand after a save and resumed.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import compile_text
from parc.runtime import metrics as metrics_module
from parc.runtime.metrics import Metrics


def _log(m: Metrics, steps) -> None:
    for s in steps:
        m.log(s, 1.0 / (s + 1), 100.0, 0.01, advance=1)


def _steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_the_records_past_the_resumed_step(tmp_path):
    path = tmp_path / "runs" / "m.jsonl"
    m = Metrics(20, path, enabled=True)
    _log(m, range(15))
    m.log_eval(9, 0.5, 4)  # after step 9: the checkpoint at 10 holds it, so it stays
    m.log_eval(14, 0.25, 4)  # after step 14: redone, so it goes
    m.close()
    m = Metrics(20, path, enabled=True, first_step=10)
    _log(m, range(10, 20))
    m.close()
    assert _steps(path) == [*range(10), 9, *range(10, 20)]
    evals = [json.loads(line) for line in path.read_text().splitlines() if "val_loss" in line]
    assert evals == [{"step": 9, "val_loss": 0.5}]
    assert not (tmp_path / "runs" / "m.jsonl.tmp").exists()


def test_a_half_written_last_line_is_dropped(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(20, path, enabled=True)
    _log(m, range(4))
    m.close()
    with path.open("a") as f:  # killed mid-write: no closing brace, no newline
        f.write('{"step": 4, "loss": 0.2, "tokens_')
    m = Metrics(20, path, enabled=True, first_step=4)
    _log(m, [4, 5])
    m.close()
    assert _steps(path) == [0, 1, 2, 3, 4, 5]  # every line parses: nothing was appended to the torn one


def test_resume_without_an_earlier_file_starts_one(tmp_path):
    path = tmp_path / "new" / "m.jsonl"
    m = Metrics(20, path, enabled=True, first_step=7)
    _log(m, [7])
    m.close()
    assert _steps(path) == [7]


def test_fresh_run_truncates(tmp_path):
    path = tmp_path / "m.jsonl"
    m = Metrics(20, path, enabled=True)
    _log(m, range(5))
    m.close()
    m = Metrics(20, path, enabled=True)
    _log(m, [0, 1])
    m.close()
    assert _steps(path) == [0, 1]


def test_tensorboard_purges_the_redone_steps(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    asked = []
    writer = metrics_module.tensorboard_writer
    monkeypatch.setattr(metrics_module, "tensorboard_writer",
                        lambda path, purge_step=None: asked.append(purge_step) or writer(path, purge_step))
    tb = tmp_path / "tb"
    m = Metrics(20, None, enabled=True, tensorboard=tb)
    _log(m, range(15))
    m.close()
    m = Metrics(20, None, enabled=True, first_step=10, tensorboard=tb)
    _log(m, range(10, 20))
    m.close()
    assert asked == [None, 10]
    events = EventAccumulator(str(tb))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(20))  # 10..14 once, from the resumed run
    assert events.Scalars("loss")[12].value == pytest.approx(1 / 13)


def test_resumed_command_line_logs_each_step_once(tmp_path):
    """`python -m parc.run` in one process: 6 steps saved every 3, metrics of steps 0..5 plus a torn
    line (as if killed while logging step 6 of a longer run); resumed from step_3 to 8 steps."""
    compiled = compile_text("mesh dp=1\nbatch global=4 micro=2\n", tmp_path / "c").root
    ckpt, path = tmp_path / "ckpt", tmp_path / "m.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "parc.run", str(compiled), "--metrics", str(path)]
    first = subprocess.run([*base, "--steps", "6", "--save-every", "3", "--checkpoint-dir", str(ckpt)],
                           env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    with path.open("a") as f:
        f.write('{"step": 6, "lo')
    again = subprocess.run([*base, "--steps", "8", "--resume", str(ckpt / "step_3")],
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert _steps(path) == list(range(8))
