"""End to end through the commands a user types: parc check, parc compile, torchrun -m parc.run."""

import json
import os
import re
import subprocess
import sys
import time

from helpers import GPT, ROOT

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(args, cwd, timeout=300):
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_compile_then_torchrun_trains(tmp_path):
    plan = tmp_path / "dp2.par"
    plan.write_text("mesh dp=2\nbatch global=16 micro=4\noptimizer adamw lr=3e-3\n")
    t0 = time.perf_counter()
    r = _run([sys.executable, "-m", "parc.cli", "compile", str(GPT), "--plan", str(plan), "-o", "compiled"], tmp_path)
    wall = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert "torchrun --nproc-per-node 2 -m parc.run compiled" in r.stdout
    said, compiling = map(float, re.search(r"in ([0-9.]+)s \(([0-9.]+)s compiling\)", r.stdout).groups())
    assert compiling < said <= wall  # the time printed is the command's, start-up (importing torch) included
    r = _run([*TORCHRUN, "--nproc-per-node", "2", "-m", "parc.run", "compiled", "--steps", "12",
              "--log-every", "4", "--metrics", "m.jsonl"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [3, 7, 11]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # byte-level loss starts at ln 256 ≈ 5.5
    assert all(rec["tokens_per_s"] > 0 for rec in records)
    # rank 0's lines, in order, on stdout: start-up said before its seconds of silence, steps, the end
    lines = r.stdout.splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(p))
             for p in ("parc.run: 2 ranks", "parc.run: ready in", "step      3", "step     11", "done: 12 steps")]
    assert order == sorted(order), r.stdout
    for bad, said in ((["--log-every", "0"], "--log-every 0: need at least 1"),
                      (["--trace", "t.json"], "this plan has pp 1")):
        r = _run([*TORCHRUN, "--nproc-per-node", "2", "-m", "parc.run", "compiled", *bad], tmp_path)
        assert r.returncode != 0 and said in r.stderr and "ZeroDivisionError" not in r.stderr


def test_metrics_appended_on_resume(tmp_path):
    plan = tmp_path / "dp2.par"
    plan.write_text("mesh dp=2\nbatch global=8 micro=2\n")
    assert _run([sys.executable, "-m", "parc.cli", "compile", str(GPT), "--plan", str(plan), "-o", "c"],
                tmp_path).returncode == 0
    run = [*TORCHRUN, "--nproc-per-node", "2", "-m", "parc.run", "c", "--metrics", "m.jsonl"]
    r = _run([*run, "--steps", "2", "--save-every", "5", "--checkpoint-dir", "ck"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ck").glob("step_*")) == ["step_2"]  # the last step, though 2 < 5
    r = _run([*run, "--steps", "4", "--resume", "ck"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]  # the first run's steps are kept


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
    """`parc check` lists the runtime's refusals (parc/analysis/support.py: fp16 with ep and pp, unproven) with
    the plan's other errors."""
    plan = tmp_path / "refused.par"
    plan.write_text('mesh dp=2 ep=2 pp=2\nbatch global=8 micro=2\nzero stage=3\nrecompute "blocks.*"\nprecision fp16\n'
                    'expert_parallel {\n    "blocks.*.moe.experts"\n}\n')
    r = _run([sys.executable, "-m", "parc.cli", "check", str(plan)], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "refused.par:4:11: error: recompute with zero stage=3" in r.stderr
    assert "refused.par:5:11: error: expert parallelism (mesh ep 2) with precision fp16" in r.stderr

def test_help_explains_the_commands():
    r = _run([sys.executable, "-m", "parc.cli", "--help"], ROOT)
    assert r.returncode == 0 and "compile" in r.stdout and "check" in r.stdout
    r = _run([sys.executable, "-m", "parc.run", "--help"], ROOT)
    assert r.returncode == 0 and "--verify" in r.stdout


def test_missing_model_file_is_a_clean_error(tmp_path):
    r = _run([sys.executable, "-m", "parc.cli", "compile", "nope.py", "--plan", str(ROOT / "examples/dp.par")],
             tmp_path)
    assert r.returncode == 2 and "nope.py: no such file" in r.stderr and "Traceback" not in r.stderr


# ---- issue 10: bad input gets one located line, exit 2, quickly ----------------------

def test_check_bad_encoding_special_files_and_preset_are_located(tmp_path):
    import time

    (tmp_path / "x.par").write_bytes(b"mesh dp=2 \xff\n")
    os.mkfifo(tmp_path / "pipe.par")
    (tmp_path / "h.par").write_text("mesh dp=2\ntopology preset=h\n")
    (tmp_path / "big.par").write_text("mesh dp=2\nbatch global=20000000 micro=10000000\n")
    cases = [(["x.par"], "x.par:1:11: error: the plan is not UTF-8 text: byte ff (invalid start byte)"),
             (["pipe.par"], "error: plan pipe.par: is a FIFO (named pipe), not a file"),
             ([str(tmp_path)], f"error: plan {tmp_path}: is a directory, not a file"),
             (["h.par"], "h.par:2:17: error: topology preset `h` is not a known hardware preset"),
             (["h.par", "--model", str(GPT)], "h.par:2:17: error: topology preset `h` is not a known hardware preset"),
             (["big.par", "--model", str(GPT)], "big.par:2:29: error: batch micro 10000000 > 65536 samples")]
    for args, first in cases:
        t0 = time.perf_counter()
        r = _run([sys.executable, "-m", "parc.cli", "check", *args], tmp_path, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert first in r.stderr, (args, r.stderr)
        assert time.perf_counter() - t0 < 60, args  # seconds on a loaded core; the micro-batch is never built


def test_check_prints_a_bounded_amount_for_thousands_of_errors(tmp_path):
    lines = ["mesh " + " ".join(["dp=1"] * 800)] * 10  # 8,000 duplicate keys on 4 KB lines
    (tmp_path / "dup.par").write_text("\n".join(lines) + "\n")
    r = _run([sys.executable, "-m", "parc.cli", "check", "dup.par"], tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr) < 100_000 and r.stderr.rstrip().endswith("more errors not shown")


def test_printed_launch_line_is_one_the_launch_check_accepts():
    """For every example plan, the command `parc compile` prints passes parc.run's placement check, as
    torchrun would start it on one machine (issue 29: pp.par's printed line used to be refused)."""
    import pytest

    from parc.cli import _launch_lines
    from parc.errors import LaunchError
    from parc.grammar.parser import load_plan
    from parc.runtime import placement

    for par in sorted((ROOT / "examples").glob("*.par")):
        plan = load_plan(par)
        line = _launch_lines(plan, "compiled")[-1]  # the one-machine form
        world = int(re.search(r"--nproc-per-node (\d+)", line).group(1))
        assert world == plan.world_size, (par.name, line)
        env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": "1"}
        plan_json = {"plan": {"source": par.read_text(), "file": str(par)}, "groups": {"tp": []}}
        placement.check(plan_json, env, oversubscribe="--oversubscribe" in line)
        if "--oversubscribe" in line:  # needed indeed: without it the same launch is refused
            with pytest.raises(LaunchError):
                placement.check(plan_json, env, oversubscribe=False)


def test_compile_refuses_a_bad_plan_path_before_loading_torch(tmp_path):
    """A missing plan, a directory or a wrong model path is refused before torch loads (seconds), issue 29."""
    code = ("import sys\nfrom parc.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "finally:\n    print('torch loaded' if 'torch' in sys.modules else 'torch not loaded')\n"
            "raise SystemExit(rc)")
    for plan, model in ((tmp_path / "missing.par", GPT), (tmp_path, GPT), (ROOT / "examples" / "dp.par", tmp_path / "x.py")):
        r = _run([sys.executable, "-c", code, "compile", str(model), "--plan", str(plan), "-o", str(tmp_path / "o")],
                 tmp_path)
        assert r.returncode != 0 and r.stdout.strip().splitlines()[-1:] == ["torch not loaded"], (plan, r.stdout,
                                                                                                  r.stderr)
        assert "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_parc_run_prints_parcs_lines_alone(tmp_path):
    """`parc run` is torchrun for a compiled plan without torchrun's banner, logging and 45-line traceback
    (issue 29): a refused launch ends in the rank's one line and parc run's one line, exit code 2."""
    plan = tmp_path / "dp2.par"
    plan.write_text("mesh dp=2\nbatch global=8 micro=4\n")
    r = _run([sys.executable, "-m", "parc.cli", "compile", str(GPT), "--plan", str(plan), "-o", "c"], tmp_path)
    assert r.returncode == 0, r.stderr
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}  # torchrun's banner appears without it
    ok = subprocess.run([sys.executable, "-m", "parc.cli", "run", "c", "--steps", "2"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "done: 2 steps" in ok.stdout, ok.stdout + ok.stderr
    assert "OMP_NUM_THREADS" not in ok.stdout + ok.stderr and "torch.distributed.elastic" not in ok.stderr
    bad = subprocess.run([sys.executable, "-m", "parc.cli", "run", "c", "--resume", "nowhere"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    error, last = bad.stderr.strip().splitlines()
    assert error == "error: --resume nowhere: no such file or directory", bad.stderr
    # both ranks refuse; which exits first is the machine's timing, never a rank torchrun killed after it
    assert re.fullmatch(r"parc run: the job failed: rank [01] stopped first \(exit code 2\); its error is printed "
                        r"above", last), bad.stderr


def test_the_failure_named_is_a_rank_that_exited_not_one_torchrun_killed():
    """torchrun SIGTERMs the other ranks after one exits; on a busy machine a killed rank's failure can be stamped
    first (seen: `rank 1 stopped first (signal 15)`, exit 1 for a refused launch). parc run names the rank that
    exited by itself, and its exit code."""
    from types import SimpleNamespace

    from parc.launcher import _first_failure

    failures = {0: SimpleNamespace(exitcode=2, timestamp=20), 1: SimpleNamespace(exitcode=-15, timestamp=10)}
    assert _first_failure(failures)[0] == 0
    failures = {0: SimpleNamespace(exitcode=-9, timestamp=20), 1: SimpleNamespace(exitcode=-15, timestamp=10)}
    assert _first_failure(failures)[0] == 1  # only signals (killed from outside): the earliest
