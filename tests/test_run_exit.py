"""How `torchrun -m parc.run` ends: a user error stays one line, a good run exits 0, --oversubscribe sets NCCL up.

The torchrun cases run the real command line on gloo; they are kept to two ranks and one or two steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import compile_text
from parc.run import parser
from parc.runtime.launch import free_port, oversubscribe_env

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp_path_factory.mktemp("exit") / "c").root


def _torchrun(compiled, tmp, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "parc.run", str(compiled),
           "--metrics", str(tmp / "m.jsonl"), *extra]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)


def test_wrong_world_size_is_one_line_in_torchruns_summary(dp2, tmp_path):
    r = _torchrun(dp2, tmp_path, 1, "--steps", "1")
    out = r.stdout + r.stderr
    line = (f"error: launched with 1 processes but {dp2} was compiled for dp 2 × pp 1 × tp 1 = 2; "
            f"use --nproc-per-node 2")
    assert r.returncode != 0
    assert out.count(line) == 2, out  # printed once by the rank, once as torchrun's root cause
    assert f"traceback : {line}" in out  # the summary names parc's message (TORCHELASTIC_ERROR_FILE)
    assert "exitcode  : 2" in out        # parc's exit code, as torchrun reports the worker
    assert not re.search(r'File "[^"]*/(parc|runtime|passes|grammar)/', out), out  # no traceback of parc's
    assert "To enable traceback" not in out


def test_good_runs_exit_zero_every_time(dp2, tmp_path):
    # the abort at exit (terminate called without an active exception) came one run in six; five clean
    # runs in a row would happen by chance with probability (5/6)^5 ≈ 0.4 if it were back
    for attempt in range(5):
        r = _torchrun(dp2, tmp_path, 2, "--steps", "1")
        assert r.returncode == 0, (attempt, r.stderr[-3000:])
        assert "done: 1 steps" in r.stdout
        assert "terminate called" not in r.stderr


def test_oversubscribe_env_poses_each_rank_as_a_host():
    env = {"RANK": "5", "LOCAL_RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}
    assert oversubscribe_env(env, gpus=2) == {
        "NCCL_HOSTID": "parc-rank-5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1",
        "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}
    assert oversubscribe_env(env, gpus=1)["LOCAL_RANK"] == "0"  # every rank on cuda:0
    assert oversubscribe_env(env, gpus=0)["LOCAL_RANK"] == "0"
    mine = oversubscribe_env({**env, "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "0"}, gpus=8)
    assert (mine["NCCL_SOCKET_IFNAME"], mine["NCCL_IB_DISABLE"], mine["LOCAL_RANK"]) == ("eth0", "0", "5")


def test_oversubscribe_run_sets_the_env_before_the_group_starts(dp2, tmp_path):
    # on CPU the flag changes nothing NCCL would see, but the job must run with it, and each rank must
    # have posed as its own host before init_process_group (checked from inside the model file's get_batch)
    probe = tmp_path / "probe.py"
    probe.write_text("import os, runpy, sys\n"
                     "import torch.distributed as dist\n"
                     "real = dist.init_process_group\n"
                     "def init(*a, **k):\n"
                     "    print('init with', os.environ['NCCL_HOSTID'], os.environ['LOCAL_RANK'],"
                     " os.environ['LOCAL_WORLD_SIZE'], os.environ['NCCL_SOCKET_IFNAME'], flush=True)\n"
                     "    return real(*a, **k)\n"
                     "dist.init_process_group = init\n"
                     "sys.argv = ['parc.run', *sys.argv[1:]]\n"
                     "runpy.run_module('parc.run', run_name='__main__', alter_sys=True)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(probe), str(dp2), "--steps", "1", "--oversubscribe",
           "--metrics", str(tmp_path / "m.jsonl")]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(line for line in r.stdout.splitlines() if line.startswith("init with")) == [
        "init with parc-rank-0 0 1 lo", "init with parc-rank-1 0 1 lo"]


def test_oversubscribe_is_a_flag():
    assert parser().parse_args(["c", "--oversubscribe"]).oversubscribe
    assert not parser().parse_args(["c"]).oversubscribe
