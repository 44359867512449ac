"""HSDP checkpoints stay plan-independent, and kill-and-resume under `shard=` is bitwise.

A checkpoint holds whole tensors (runtime/checkpoint/sharded.py gathers ZeRO's ranges over the group
they are cut over, here the shard group), so one saved under `zero stage=3 shard=2` resumes under plain
ZeRO-3 and under dp without ZeRO, and checkpoints saved under those resume under `shard=2`. The resumed
parameters must be bitwise the saved ones; the next step, run under another plan, differs from the
saving plan's only by reduction order (tests/test_checkpoint.py's NEXT_* tolerances, for its reasons).

Kill-and-resume follows tests/test_resume_exact.py: an uninterrupted run saves after steps 2 and 4; a
fresh world of fresh processes (what a SIGKILL after step_2 leaves) resumes from its step_2 and saves
step_4, with each rank under its own PYTHONHASHSEED (swapped between worlds); both step_4 checkpoints
must be equal tensor for tensor, parc.json included.
"""

import shutil

import torch

from helpers import checkpoint_differences, checkpoint_leg, checkpoint_sessions, compile_text
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from test_checkpoint import _check_reshard
from test_resume_exact import _order

BATCH = "batch global=8 micro=1\noptimizer adamw lr=1e-2 clip=1.0\n"  # two micro-batches a step on dp 4
PLANS = {"hsdp": "mesh dp=4\nzero stage=3 shard=2\n", "zero3": "mesh dp=4\nzero stage=3\n", "dp": "mesh dp=4\n"}
# (plan, the checkpoint it resumes from, or None to train from scratch): a chain within one world
SESSIONS = [("hsdp", None), ("zero3", "hsdp"), ("dp", "hsdp"), ("hsdp", "zero3"), ("hsdp", "dp")]


def test_hsdp_checkpoint_resumes_under_zero3_and_dp_and_back(tmp_path):
    compiled = {n: str(compile_text(p + BATCH, tmp_path / n).root) for n, p in PLANS.items()}
    res = spawn(4, checkpoint_sessions, SESSIONS, compiled, str(tmp_path / "ck"))[0]
    src = res[0]
    assert src["first"] == 0
    for dst in res[1:]:
        # every checkpoint in the chain holds the state of session 0 after step 2, whichever plan saved it
        _check_reshard(src, dst)


def test_kill_resume_is_bitwise_under_shard(tmp_path):
    plans = {f"zero{s}": f"mesh dp=4\nzero stage={s} shard=2\n" for s in (1, 2, 3)}
    plans["zero2_bf16"] = "mesh dp=4\nzero stage=2 shard=2\nprecision bf16 reduce=bf16\n"
    plans["zero3_bf16"] = "mesh dp=4\nzero stage=3 shard=2\nprecision bf16\n"
    compiled = {n: str(compile_text(p + BATCH, tmp_path / "c" / n).root) for n, p in plans.items()}
    first = _order(1)
    other = str(next(s for s in range(2, 50) if _order(s) != first))
    seeds = [{"PYTHONHASHSEED": s} for s in ("1", other, "1", other)]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    spawn(4, checkpoint_leg, compiled, str(whole), False, 0, 4, start_env=seeds)
    for name in plans:  # the interrupted run: killed after its step_2
        shutil.copytree(whole / name / "step_2", cut / name / "step_2")
        (cut / name / checkpoint.LATEST).write_text("step_2\n")
    spawn(4, checkpoint_leg, compiled, str(cut), True, 2, 4, start_env=seeds[::-1])
    bad = {name: diff for name in plans
           if (diff := checkpoint_differences(whole / name / "step_4", cut / name / "step_4"))}
    assert not bad, bad
    held = checkpoint.read(whole / "zero2_bf16" / "step_2")
    assert torch.bfloat16 not in {v.dtype for v in held.values()}  # the fp32 masters, gathered over the shard group
