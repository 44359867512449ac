"""Kill and resume, twice, under every ZeRO stage and under pp: the whole checkpoint is bitwise that of an
uninterrupted run, with every rank under its own PYTHONHASHSEED.

Why hash seeds: Python orders a set of strings by their hashes, which PYTHONHASHSEED randomizes per
process. A collective sequence built from such an order (one all-gather per optimizer key, say) pairs
different tensors on different ranks: ZeRO resume once mixed Adam's exp_avg and exp_avg_sq this way
(issue 10). Each world here starts its two ranks with seeds that order {"exp_avg", "exp_avg_sq"}
differently, and the seeds swap between worlds.

Why "kill": each leg is a fresh world of fresh processes that ends right after its checkpoint, which is
the state a SIGKILL after that checkpoint leaves on disk (tests/test_checkpoint.py kills a real torchrun
job mid-run and shows that a kill never leaves a half-written checkpoint). The legs chain: an
uninterrupted run saves after steps 2, 4 and 6; the interrupted one takes its step_2, resumes to step 4
(the first save after a resume, where the mixed moments showed), then resumes again to step 6. The
comparison is of every tensor the checkpoints hold (parameters, optimizer state, step, each rank's RNG)
with `torch.equal`, and of their parc.json.

All nine plans run in each world one after another (every plan has 2 ranks), so the test starts three
worlds, not one per plan and leg: process start-up is most of the time on a small box.
"""

import shutil
import subprocess
import sys

import pytest
import torch

from helpers import checkpoint_differences, checkpoint_leg, compile_text
from parc.runtime import checkpoint
from parc.runtime.launch import spawn

PLANS = {
    "zero1": "mesh dp=2\nzero stage=1\n",
    "zero2": "mesh dp=2\nzero stage=2\n",
    "zero3": "mesh dp=2\nzero stage=3\n",
    "pp": "mesh pp=2\npipeline schedule=1f1b\n",
    # bf16 (runtime/precision.py): the checkpoint holds the fp32 masters; a resumed step computes with
    # copies made from the loaded masters, never from stale ones
    "dp_bf16": "mesh dp=2\nprecision bf16 reduce=bf16\n",
    # bf16 ZeRO-1/2 hold fp32 master ranges beside a bf16 flat buffer (runtime/parallel/zero.py): the checkpoint
    # gathers the fp32 ranges, and a resume refreshes the bf16 buffer from the loaded masters
    "zero1_bf16": "mesh dp=2\nzero stage=1\nprecision bf16\n",
    "zero2_bf16": "mesh dp=2\nzero stage=2\nprecision bf16 reduce=bf16\n",
    # bf16 ZeRO-3 keeps only fp32 ranges and gathers bf16 copies of them: the checkpoint holds the ranges gathered
    # in fp32, and a resume's first forward gathers bf16 from the loaded ranges
    "zero3_bf16": "mesh dp=2\nzero stage=3\nprecision bf16\n",
    # fp16 (runtime/loss_scale.py): the checkpoint holds the loss scaler too; from 2**20 this model overflows
    # at steps 0-1 and the scale has moved by each save, so a resume that restarted the scaler would differ
    "zero2_fp16": "mesh dp=2\nzero stage=2\nprecision fp16 initial_scale_power=20 loss_scale_window=2\n",
}
# micro=1: two micro-batches per step on dp=2 (ZeRO-2/3 reduce in each), four on pp=2
COMMON = "batch global=4 micro=1\noptimizer adamw lr=1e-2 clip=1.0\n"
EVERY, STEPS = 2, 6


def _order(seed: int) -> list[str]:
    out = subprocess.run([sys.executable, "-S", "-c", 'print(list({"exp_avg", "exp_avg_sq"}))'],
                         env={"PYTHONHASHSEED": str(seed)}, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.fixture(scope="module")
def seeds():
    """Two hash seeds under which a set of Adam's keys iterates in different orders."""
    first = _order(1)
    other = next(s for s in range(2, 50) if _order(s) != first)
    return "1", str(other)


def test_kill_resume_twice_is_bitwise_under_every_zero_stage_and_pp(tmp_path, seeds):
    compiled = {n: str(compile_text(p + COMMON, tmp_path / "c" / n).root) for n, p in PLANS.items()}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    a, b = seeds
    ab, ba = [{"PYTHONHASHSEED": a}, {"PYTHONHASHSEED": b}], [{"PYTHONHASHSEED": b}, {"PYTHONHASHSEED": a}]
    spawn(2, checkpoint_leg, compiled, str(whole), False, 0, STEPS, EVERY, start_env=ab)
    for name in PLANS:  # the interrupted run's first leg: killed after its step_2
        shutil.copytree(whole / name / "step_2", cut / name / "step_2")
        (cut / name / checkpoint.LATEST).write_text("step_2\n")
    spawn(2, checkpoint_leg, compiled, str(cut), True, 2, 4, EVERY, start_env=ab)
    spawn(2, checkpoint_leg, compiled, str(cut), True, 4, 6, EVERY, start_env=ba)
    bad = {f"{name} step_{s}": diff for name in PLANS for s in (4, 6)
           if (diff := checkpoint_differences(whole / name / f"step_{s}", cut / name / f"step_{s}"))}
    assert not bad, bad
    for name in ("dp_bf16", "zero1_bf16", "zero2_bf16"):
        held = checkpoint.read(whole / name / "step_2")
        assert {v.dtype for k, v in held.items() if k.startswith(("model.", "optim."))} >= {torch.float32}
        assert torch.bfloat16 not in {v.dtype for v in held.values()}, name  # the masters, not the bf16 copies
    for s in (2, 4):  # the scaler is saved, and had moved: a resume that lost it would differ
        assert checkpoint.read(whole / "zero2_fp16" / f"step_{s}")["scaler.scale"].item() < 2.0 ** 20
    for name in PLANS:
        assert checkpoint.resolve(cut / name).name == f"step_{STEPS}"
