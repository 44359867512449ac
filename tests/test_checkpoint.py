"""Checkpoints: SIGKILL then resume is bitwise exact; a checkpoint reshards onto another plan; export.

The crash test runs the real command line (`torchrun -m parc.run`) in its own
session and kills the whole process group with SIGKILL at a random moment
after the first checkpoint is complete, then resumes and compares the final
parameters with an uninterrupted run with `torch.equal`: resuming must restore
weights, optimizer state, step (data position) and RNG exactly.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers import compile_text, gpt_tp_rules
from parc.export import export, load_model_state
from parc.runtime import checkpoint
from parc.runtime.launch import free_port, spawn
from parc.runtime.train import Trainer
from parc.trace import load_user_module

STEPS, EVERY = 12, 2


def _torchrun(compiled: Path, tmp: Path, *extra: str, session: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "parc.run", str(compiled), "--steps", str(STEPS),
           "--metrics", str(tmp / f"metrics-{time.monotonic_ns()}.jsonl"), "--log-every", str(STEPS), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=session)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out


def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    compiled = compile_text("mesh dp=2\nbatch global=8 micro=2\nzero stage=3\noptimizer adamw lr=1e-2 clip=0.5\n",
                            tmp_path / "compiled").root
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    _finish(_torchrun(compiled, tmp_path, "--save-every", str(STEPS), "--checkpoint-dir", str(whole)))

    proc = _torchrun(compiled, tmp_path, "--save-every", str(EVERY), "--checkpoint-dir", str(crashed), session=True)
    deadline = time.monotonic() + 300
    while not (crashed / checkpoint.LATEST).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.5))  # a random step after the first checkpoint
    victims = [proc.pid, *_descendants(proc.pid)]
    for pid in victims:  # every rank and the launcher, no cleanup
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    while any(_running(pid) for pid in victims[1:]):  # orphaned workers are reaped by init, not by us
        time.sleep(0.05)
    saved = checkpoint.resolve(crashed)
    done = int(saved.name.removeprefix("step_"))
    print(f"\nkilled after checkpoint {saved.name}; resuming from step {done} of {STEPS}")
    assert done < STEPS, "the run finished before the kill: the test proved nothing"

    _finish(_torchrun(compiled, tmp_path, "--resume", str(crashed), "--save-every", str(EVERY),
                      "--checkpoint-dir", str(crashed)))
    want, got = load_model_state(whole), load_model_state(crashed)
    assert checkpoint.resolve(crashed).name == f"step_{STEPS}"
    assert want.keys() == got.keys()
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different


def _train_save(ctx, compiled: str, steps: int, out: str):
    trainer = Trainer.load(compiled, 0)
    for s in range(steps):
        trainer.step(s)
    checkpoint.save(trainer, out, steps)
    state = trainer.gathered_state()  # collective at ZeRO-3: every rank gathers
    return state if ctx.rank == 0 else None


def _load(ctx, compiled: str, ckpt: str):
    trainer = Trainer.load(compiled, 0)
    step = checkpoint.load(trainer, ckpt)
    first_opt = trainer.optimizer.optimizer.state if trainer.zero else trainer.optimizer.state
    return {"step": step, "state": trainer.gathered_state(), "has_opt_state": len(first_opt) > 0}


def test_reshard_zero3_dp4_to_dp2_and_export(tmp_path):
    batch = "batch global=8 micro=2\noptimizer adamw lr=1e-2\n"
    src = compile_text(f"mesh dp=4\nzero stage=3\n{batch}", tmp_path / "dp4").root
    dst = compile_text(f"mesh dp=2\nzero stage=1\n{batch}", tmp_path / "dp2").root
    ckpts = tmp_path / "ckpt"
    saved = spawn(4, _train_save, str(src), 2, str(ckpts))[0]
    # a crash mid-save leaves only a temporary directory: never picked up by --resume
    (ckpts / "step_9.tmp-123").mkdir()
    assert checkpoint.resolve(ckpts).name == "step_2"
    loaded = spawn(2, _load, str(dst), str(ckpts))
    for r in loaded:
        assert r["step"] == 2 and r["has_opt_state"]
    state = loaded[0]["state"]
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in saved), [k for k in saved if not torch.equal(saved[k],
                                                                                                   state[k])]
    out = export(ckpts, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    flat = load_file(str(out))
    assert flat.keys() == saved.keys() and all(torch.equal(flat[k], saved[k]) for k in saved)
    # and the consolidated file loads into the user's own model
    model = load_user_module(src / "model" / "model.py").build_model()
    model.load_state_dict(flat, strict=False)
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])


# --- resharding across tp and pp -----------------------------------------------------------------------------
# After loading, parameters must be bitwise those saved (DCP copies bytes; tp slicing and ZeRO ranges are exact).
# The next step runs under another plan, so its loss and update differ from the saving run's only by reduction
# order: ~1e-7 on the loss, and ~1e-5 model-wide on parameters after an AdamW step (Adam divides each gradient
# by its own magnitude, see runtime/verify.py). A missing optimizer state (Adam restarting at step 1) or a
# wrong data position moves parameters by ~1e-2.
NEXT_LOSS_TOL, NEXT_PARAM_TOL = 1e-5, 1e-4
GPT_TP = gpt_tp_rules()


def _session(ctx, compiled: str, resume: str | None, steps: int, save_to: str):
    """Train (or resume) to `steps` steps, save, note the state; then one more step under this plan."""
    trainer = Trainer.load(compiled, 0)
    first = checkpoint.load(trainer, resume) if resume else 0
    for s in range(first, steps):
        trainer.step(s)
    checkpoint.save(trainer, save_to, steps)
    saved = {k: v.clone() for k, v in trainer.gathered_state().items()}  # on CPU it may alias the live params
    loss = trainer.global_losses([trainer.step(steps).loss])[0]
    after = trainer.gathered_state()
    return {"first": first, "saved": saved, "loss": loss, "after": after} if ctx.rank == 0 else None


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a)
    return (num / sum(float(b[k].double().square().sum()) for k in a)) ** 0.5


def _check_reshard(src: dict, dst: dict) -> None:
    assert dst["first"] == 2
    assert src["saved"].keys() == dst["saved"].keys()
    bad = {k: float((src["saved"][k] - dst["saved"][k]).abs().max()) for k in src["saved"]
           if not torch.equal(src["saved"][k], dst["saved"][k])}
    assert not bad, bad
    assert abs(dst["loss"] - src["loss"]) / abs(src["loss"]) < NEXT_LOSS_TOL, (src["loss"], dst["loss"])
    assert _rel(dst["after"], src["after"]) < NEXT_PARAM_TOL, _rel(dst["after"], src["after"])


def _exported(ckpt: Path, want: dict, tmp: Path) -> None:
    from safetensors.torch import load_file

    flat = load_file(str(export(ckpt, tmp / f"{ckpt.name}.safetensors")))
    assert flat.keys() == want.keys() and all(torch.equal(flat[k], want[k]) for k in want)


def test_reshard_zero3_to_tp_and_pp_to_dp(tmp_path):
    batch = "batch global=8 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n"
    zero3 = compile_text(f"mesh dp=4\nzero stage=3\n{batch}", tmp_path / "zero3").root
    tp = compile_text(f"mesh dp=2 tp=2\n{batch}{GPT_TP}", tmp_path / "tp").root
    pp = compile_text(f"mesh pp=2\n{batch}pipeline schedule=1f1b\n", tmp_path / "pp").root
    dp = compile_text(f"mesh dp=2\n{batch}", tmp_path / "dp").root
    a, b, c, d = (tmp_path / n for n in ("ck_zero3", "ck_tp", "ck_pp", "ck_dp"))

    src = spawn(4, _session, str(zero3), None, 2, str(a))[0]
    dst = spawn(4, _session, str(tp), str(a), 2, str(b))[0]    # dp=4 ZeRO-3 → dp=2 tp=2
    _check_reshard(src, dst)
    _exported(b, dst["saved"], tmp_path)                       # saved by tp ranks: whole tensors

    src = spawn(2, _session, str(pp), None, 2, str(c))[0]
    dst = spawn(2, _session, str(dp), str(c), 2, str(d))[0]    # pp=2 → dp=2
    _check_reshard(src, dst)
    _exported(c, src["saved"], tmp_path)                       # saved by pp ranks: every stage's tensors
