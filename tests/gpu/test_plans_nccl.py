"""Every example plan, a bf16 pipeline, every pipeline schedule and ZeRO-3, trained under NCCL with --verify.

Each case compiles examples/gpt.py under its plan and runs `torchrun -m parc.run --steps 3 --verify`:
parallel equals serial on the GPU, within parc's own tolerance (1e-4 fp32, 1e-2 bf16; runtime/verify.py).
With fewer GPUs than ranks the job runs with --oversubscribe (ranks share GPUs, each posing to NCCL as
its own host). --timeout 60 turns a hang into a failure within about a minute. Designed to take under
six minutes on one H200 (each job: ~10 s of start-up, a few seconds of training, the serial re-run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpu_results import RESULTS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

INLINE = {
    # a bf16 pipeline: 1F1B over 2 stages, bf16 compute with fp32 master weights
    "pp2_1f1b_bf16": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=1f1b stages=2\nprecision bf16\n"
                     "optimizer adamw lr=3e-4\n",
    "pp2_interleaved": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=interleaved_1f1b virtual=2\n"
                       "optimizer adamw lr=3e-4\n",
    "pp2_zb_h1": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=zb_h1 stages=2\noptimizer adamw lr=3e-4\n",
    "pp4_1f1b": "mesh pp=4\nbatch global=16 micro=2\npipeline schedule=1f1b stages=4\noptimizer adamw lr=3e-4\n",
    "zero3_dp2": "mesh dp=2\nbatch global=8 micro=2\nzero stage=3\noptimizer adamw lr=3e-4 clip=1.0\n",
}
CASES = [("dp", 4), ("tp", 2), ("pp", 4), ("zero", 4), ("3d", 8),
         ("pp2_1f1b_bf16", 2), ("pp2_interleaved", 2), ("pp2_zb_h1", 2), ("pp4_1f1b", 4), ("zero3_dp2", 2)]


def _plan_file(name: str, tmp: Path) -> Path:
    if name in INLINE:
        path = tmp / f"{name}.par"
        path.write_text(INLINE[name])
        return path
    return EXAMPLES / f"{name}.par"


def _free_port() -> int:
    from parc.runtime.launch import free_port

    return free_port()


@pytest.mark.parametrize("name,ranks", CASES, ids=[c[0] for c in CASES])
def test_plan_verifies_under_nccl(name, ranks, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "2", "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    compiled = tmp_path / "compiled"
    r = subprocess.run([sys.executable, "-m", "parc.cli", "compile", str(EXAMPLES / "gpt.py"), "--plan",
                        str(_plan_file(name, tmp_path)), "-o", str(compiled)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "parc.run", str(compiled), "--steps", "3", "--verify", "--timeout", "60",
           "--metrics", str(tmp_path / "metrics.jsonl")]
    # one machine stands in for the plan's nodes: with fewer GPUs than ranks, or more ranks than its
    # topology line puts on a node (the line `parc compile` prints says the same)
    if torch.cuda.device_count() < ranks or "--oversubscribe" in r.stdout:
        cmd.append("--oversubscribe")
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    wall = time.monotonic() - t0
    verdict = next((line for line in r.stdout.splitlines() if line.startswith("verify ")), "no verify line")
    RESULTS.append((name, ranks, verdict, wall))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    assert verdict.startswith("verify PASS"), verdict
