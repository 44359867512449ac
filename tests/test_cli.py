"""End to end through the commands a user types: parc check, parc compile, torchrun -m parc.run."""

import json
import os
import subprocess
import sys

from helpers import GPT, ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args, cwd, timeout=300):
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_compile_then_torchrun_trains(tmp_path):
    plan = tmp_path / "dp2.par"
    plan.write_text("mesh dp=2\nbatch global=16 micro=4\noptimizer adamw lr=3e-3\n")
    r = _run([sys.executable, "-m", "parc.cli", "compile", str(GPT), "--plan", str(plan), "-o", "compiled"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "torchrun --nproc-per-node 2 -m parc.run compiled" in r.stdout
    r = _run([*TORCHRUN, "--nproc-per-node", "2", "-m", "parc.run", "compiled", "--steps", "12",
              "--log-every", "4", "--metrics", "m.jsonl"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [3, 7, 11]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # byte-level loss starts at ln 256 ≈ 5.5
    assert all(rec["tokens_per_s"] > 0 for rec in records)


def test_verify_flag_passes(tmp_path):
    plan = tmp_path / "dp2.par"
    plan.write_text("mesh dp=2\nbatch global=8 micro=2\n")
    assert _run([sys.executable, "-m", "parc.cli", "compile", str(GPT), "--plan", str(plan), "-o", "c"],
                tmp_path).returncode == 0
    r = _run([*TORCHRUN, "--nproc-per-node", "2", "-m", "parc.run", "c", "--steps", "2", "--verify"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verify PASS" in r.stdout


def test_plan_errors_exit_2_without_traceback(tmp_path):
    plan = tmp_path / "bad.par"
    plan.write_text("mesh dp=8 tp=0\nbatch global=1024 micro=4 accumulation=8\n")
    r = _run([sys.executable, "-m", "parc.cli", "check", str(plan)], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "bad.par:1:" in r.stderr  # tp=0
    assert "bad.par:2:" in r.stderr  # the seed's batch arithmetic



def test_check_reports_what_compile_would_refuse(tmp_path):
    """`parc check` lists the runtime's refusals (parc/support.py, fp16) with the plan's other errors."""
    plan = tmp_path / "refused.par"
    plan.write_text('mesh dp=2\nbatch global=8 micro=2\nzero stage=3\nrecompute "blocks.*"\nprecision fp16\n')
    r = _run([sys.executable, "-m", "parc.cli", "check", str(plan)], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "refused.par:4:11: error: recompute with zero stage=3" in r.stderr
    assert "refused.par:5:11: error: precision fp16" in r.stderr

def test_help_explains_the_commands():
    r = _run([sys.executable, "-m", "parc.cli", "--help"], ROOT)
    assert r.returncode == 0 and "compile" in r.stdout and "check" in r.stdout
    r = _run([sys.executable, "-m", "parc.run", "--help"], ROOT)
    assert r.returncode == 0 and "--verify" in r.stdout


def test_missing_model_file_is_a_clean_error(tmp_path):
    r = _run([sys.executable, "-m", "parc.cli", "compile", "nope.py", "--plan", str(ROOT / "examples/dp.par")],
             tmp_path)
    assert r.returncode == 2 and "nope.py: no such file" in r.stderr and "Traceback" not in r.stderr
