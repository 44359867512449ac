"""A run that survives failures (docs/fault-tolerance.md), through the real command line.

- workers die with their launcher: SIGKILL of torchrun alone stops every worker within 10 s, and
  nothing is written after the kill (runtime/lifeline.py);
- the chaos test: one job meets a schedule of faults (runtime/faults.py) under `torchrun --max-restarts`
  with `--resume auto --async-save --keep-last`, relaunched only when its launcher itself was killed
  (as a scheduler would). It finishes, and its final parameters and optimizer state equal an
  uninterrupted run's bitwise. It prints the time lost and the steps redone per fault;
- a damaged checkpoint is one line naming the file, for `--resume`, `parc export` and `read`;
- a save that fails with --on-save-error continue leaves the run training and `latest` where it was.

The model is examples/gpt.py, dp=2 with ZeRO-1 (sharded optimizer state: a resume must restore each
rank's range), on 2 CPU ranks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import checkpoint_differences, compile_text
from test_checkpoint import _descendants, _running
from parc.errors import LaunchError
from parc.runtime import checkpoint
from parc.runtime.checkpoint import checksums
from parc.runtime.launch import free_port

PLAN = "mesh dp=2\nbatch global=8 micro=2\nzero stage=1\noptimizer adamw lr=1e-2 clip=1.0\n"
STEPS, EVERY = 16, 2


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_text(PLAN, tmp_path_factory.mktemp("ft") / "c").root


class Job:
    """One `torchrun … -m parc.run` process, its output read line by line with arrival times."""

    def __init__(self, compiled: Path, *args: str, restarts: int = 0, env: dict | None = None):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
               str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "parc.run",
               str(compiled), "--log-every", "1", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout: float = 300) -> int:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.reader.join(10)
        return self.proc.returncode

    def kill(self):
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def _files(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in root.rglob("*") if p.is_file()}


def test_workers_die_with_their_launcher(compiled, tmp_path):
    out = tmp_path / "out"
    job = Job(compiled, "--steps", "100000", "--save-every", "1", "--checkpoint-dir", str(out / "ck"),
              "--metrics", str(out / "metrics.jsonl"))
    try:
        deadline = time.monotonic() + 120
        while not (out / "ck" / checkpoint.LATEST).exists():
            assert job.proc.poll() is None and time.monotonic() < deadline, job.text
            time.sleep(0.05)
        workers = _descendants(job.proc.pid)
        assert len([p for p in workers if _running(p)]) >= 2
        killed = time.time()
        os.kill(job.proc.pid, signal.SIGKILL)  # the launcher only, as `kill -9 <torchrun>` does
        while any(_running(p) for p in workers):
            assert time.time() - killed < 10, "workers still alive 10 s after their launcher was killed"
            time.sleep(0.05)
        gone = time.time() - killed
        before = _files(out)
        time.sleep(2)
        assert _files(out) == before  # nothing written once they are gone
        late = {f: t for f, (_, t) in before.items() if t > killed + 0.5}
        assert not late, f"written after the kill: {late}"
        print(f"\nevery worker gone {gone:.2f} s after torchrun was killed")
    finally:
        job.kill()


def test_sigterm_saves_and_stops(compiled, tmp_path):
    """What a preemptible cluster sends: every rank stops after one agreed step, saved, and exits 0."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    job = Job(compiled, "--steps", "100000", "--save-every", "100000", "--checkpoint-dir", str(ck),
              "--metrics", str(metrics))
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert job.proc.poll() is None and time.monotonic() < deadline, job.text
            time.sleep(0.05)
        os.kill(job.proc.pid, signal.SIGTERM)  # torchrun passes it on to every worker
        job.wait(120)
    finally:
        job.kill()
    said = re.search(r"stopped by SIGTERM after (\d+) steps; saved .*step_(\d+)", job.text)
    assert said and said.group(2) == said.group(1), job.text
    assert checkpoint.resolve(ck).name == f"step_{said.group(2)}"
    assert re.search(r"exitcode\s*:\s*[1-9]|failed \(exitcode", job.text) is None, job.text  # the workers exit 0
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged[-1] + 1 == int(said.group(1))  # the saved step was the last one trained


# The fault schedule, by step (a fault at step S fires as step S starts; a save fault in the save of step_S).
# Each resumes from the newest whole checkpoint: the steps redone are S − that checkpoint's step. Under
# --async-save a save is sealed a step or two after it starts, so which checkpoint that is depends on timing
# (kill@11 may come before or after step_10 is sealed, and corrupted): the table prints what happened.
FAULTS = [
    ("kill@3:1", "a worker killed", 3),
    ("raise@5:0", "get_batch raises", 5),
    ("stop@7:1", "a rank stopped by SIGSTOP (found by --timeout)", 7),
    ("kill-in-save@8:1", "a worker killed inside a save", 8),
    ("corrupt@10", "a shard of step_10 damaged …", None),
    ("kill@11:0", "… then a worker killed: step_10 set aside", 11),
    ("enospc@12:1", "disk full during a save", 12),
    ("kill-launcher@14", "the launcher killed: the job relaunched", 14),
]


def test_chaos_resumes_to_the_uninterrupted_state(compiled, tmp_path):
    whole = tmp_path / "whole"
    ref = Job(compiled, "--steps", str(STEPS), "--save-every", str(EVERY), "--checkpoint-dir", str(whole),
              "--metrics", str(tmp_path / "whole.jsonl"))
    assert ref.wait() == 0, ref.text
    step_times = [json.loads(line)["step_time_s"] for line in (tmp_path / "whole.jsonl").read_text().splitlines()]

    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    env = {"PARC_FAULTS": ",".join(f for f, _, _ in FAULTS), "PARC_FAULTS_DONE": str(tmp_path / "fired")}
    args = ("--steps", str(STEPS), "--save-every", str(EVERY), "--checkpoint-dir", str(ck), "--resume", "auto",
            "--async-save", "--keep-last", "3", "--timeout", "12", "--metrics", str(metrics))
    jobs, t0 = [], time.time()
    for _ in range(3):  # a relaunch only after the launcher itself was killed
        jobs.append(Job(compiled, *args, restarts=len(FAULTS), env=env))
        code = jobs[-1].wait(600)
        if code == 0:
            break
        assert "fault injected: kill-launcher" in jobs[-1].text, jobs[-1].text
    text = "\n".join(j.text for j in jobs)
    assert code == 0, text
    lines = [x for j in jobs for x in j.lines]
    elapsed = time.time() - t0

    # each fault fired once, and the job went on past it
    for fault, _, _ in FAULTS:
        kind, _, at = fault.partition("@")
        assert len(re.findall(rf"fault injected: {kind} at step {at.split(':')[0]} ", text)) == 1, (fault, text)
    assert "does not match its checksum" in text and "set aside as step_10.damaged" in text, text
    assert "No space left on device" in text, text
    # the stopped rank named by the others' watchdog (an endless loop in data code: tests/test_failures.py)
    assert re.search(r"parc\.run: rank 1 hung: .*step 7", text), text
    # each step's metrics once, though steps were redone after every fault (the records past a resume dropped)
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert logged == list(range(STEPS)), logged

    # bitwise: parameters, optimizer state, RNG, data position
    final = checkpoint.resolve(ck)
    assert final.name == f"step_{STEPS}"
    diff = checkpoint_differences(whole / f"step_{STEPS}", final)
    assert not diff, diff
    # --keep-last 3: the three newest, and the damaged one set aside, not deleted
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == \
        ["step_10.damaged", "step_12", "step_14", "step_16"]

    # time lost per fault: from the fault to the next "ready" (restart + reload), plus the steps redone
    step_s = sum(step_times[1:]) / len(step_times[1:])
    resumed = [(t, int(m.group(1)) if (m := re.search(r"resuming from .*step_(\d+)", line)) else 0)
               for t, line in lines if "--resume auto" in line and ("resuming from" in line or "fresh" in line)]
    readies = [t for t, line in lines if "parc.run: ready in" in line]
    print(f"\nchaos: {len(FAULTS)} faults, {elapsed:.0f} s in all; the uninterrupted run: {step_s * 1e3:.0f} ms/step")
    print(f"{'fault':<20} {'what':<48} {'lost (s)':>8} {'redone':>6}")
    for fault, what, step in FAULTS:
        fired = next(t for t, line in lines if f"fault injected: {fault.partition('@')[0]} at step "
                     f"{fault.partition('@')[2].split(':')[0]} " in line)
        if step is None:
            print(f"{fault:<20} {what:<48} {'-':>8} {'-':>6}")
            continue
        ready = next(t for t in readies if t > fired)
        back = next(s for t, s in resumed if t > fired)
        redone = step - back
        print(f"{fault:<20} {what:<48} {ready - fired + redone * step_s:8.1f} {redone:6d}")
        # a save may still be in flight at the fault (--async-save), and a damaged newest costs one more
        assert 0 <= redone <= 2 * EVERY + 1, "\n".join(line for _, line in lines if "parc.run" in line)


def test_damaged_checkpoint_is_one_line_naming_the_file(compiled, tmp_path):
    ck = tmp_path / "ck"
    job = Job(compiled, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(ck), "--metrics",
              str(tmp_path / "m.jsonl"))
    assert job.wait() == 0, job.text
    info = json.loads((ck / "step_2" / "parc.json").read_text())
    assert set(info["files"]) == set(checksums.files(ck / "step_2")) and ".metadata" in info["files"]
    assert checksums.damaged(ck / "step_2", info) == []
    shard = sorted((ck / "step_2").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01  # one bit, the length unchanged: the files check alone would not see it
    shard.write_bytes(bytes(data))

    with pytest.raises(LaunchError, match=rf"{shard.name} does not match its checksum"):
        checkpoint.read(ck)
    export = subprocess.run([sys.executable, "-m", "parc.cli", "export", str(ck), "-o", str(tmp_path / "m.st")],
                            capture_output=True, text=True)
    assert export.returncode != 0 and "Traceback" not in export.stderr, export.stderr
    assert f"{shard.name} does not match its checksum" in export.stderr, export.stderr
    job = Job(compiled, "--steps", "4", "--resume", str(ck), "--metrics", str(tmp_path / "m2.jsonl"))
    assert job.wait() != 0
    said = [line for line in job.text.splitlines() if "does not match its checksum" in line]
    assert said and all(shard.name in line for line in said), job.text
    assert not re.search(r"^\[rank\d+\]|parc\.run: rank \d+ failed", job.text, re.M), job.text  # no worker traceback


def test_failed_save_can_let_training_go_on(compiled, tmp_path):
    ck = tmp_path / "ck"
    job = Job(compiled, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(ck), "--on-save-error",
              "continue", "--metrics", str(tmp_path / "m.jsonl"),
              env={"PARC_FAULTS": "enospc@2:1", "PARC_FAULTS_DONE": str(tmp_path / "fired")})
    assert job.wait() == 0, job.text
    assert "checkpoint step_2 not saved" in job.text and "training goes on" in job.text, job.text
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_4"]  # no partial step_2, no temporary left
    assert checkpoint.resolve(ck).name == "step_4"


def test_checksums_of_a_folder(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100)
    (tmp_path / "b").write_bytes(b"y" * 10)
    (tmp_path / "parc.json").write_text("{}")
    sums = {**checksums.measure(tmp_path, 0, 2), **checksums.measure(tmp_path, 1, 2)}
    assert sorted(sums) == ["a", "b"] and sums == checksums.measure(tmp_path)  # shared out, same answer
    (tmp_path / "b").write_bytes(b"y" * 9 + b"z")
    (tmp_path / "a").unlink()
    assert checksums.damaged(tmp_path, {"files": sums}) == [
        "a is missing", f"b does not match its checksum (crc32 {checksums.crc32(tmp_path / 'b')}, "
                        f"{sums['b']['crc32']} when written)"]
    assert checksums.damaged(tmp_path, {}) == []  # an older checkpoint: no sums to check
