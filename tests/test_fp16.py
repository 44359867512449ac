"""`precision fp16` with DeepSpeed's dynamic loss scaling (runtime/loss_scale.py), against the serial fp16 run.

One spawned 2-rank world trains every plan below for STEPS steps from a first scale of 2**20, which overflows
fp16 on examples/gpt.py (its gradients overflow above 2**18 here): step 0 overflows and spends the hysteresis,
steps 1 and 2 overflow and halve the scale, then it trains, doubles after `loss_scale_window=2` clean steps,
overflows again and spends the reset hysteresis. Every plan must match the serial run with the same scaler
(runtime/serial_reference.py: fp16 copies of fp32 masters, each micro-batch's loss scaled as a rank scales
it): the losses and final parameters within TOLERANCE, and exactly the same scale before every step and the
same skipped steps. The skip decision is a device flag all-reduced over dp, tp and pp, so all ranks agree.
"""

from __future__ import annotations

import pytest
import torch

from helpers import compile_text, gpt_tp_rules
from parc import artifact
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

STEPS = 7
SCALER = " initial_scale_power=20 loss_scale_window=2 hysteresis=2"
COMMON = "batch global=8 micro=2\n{extra}precision fp16" + SCALER + "\noptimizer adamw lr=1e-3 clip=0.5\n"
PLANS = {
    "dp": ("mesh dp=2\n", ""),
    "zero1": ("mesh dp=2\n", "zero stage=1\n"),   # fp32 master ranges beside an fp16 flat buffer
    "zero2": ("mesh dp=2\n", "zero stage=2\n"),
    "zero3": ("mesh dp=2\n", "zero stage=3\n"),   # fp16 gathers of fp32 ranges
    "zero2_offload": ("mesh dp=2\n", "zero stage=2 offload=cpu\n"),  # unscaled grads down, skipped on the host
    "pp_1f1b": ("mesh pp=2\n", "pipeline schedule=1f1b\n"),  # the scale reaches the last stage's backward
    "tp_sp": ("mesh tp=2\n", gpt_tp_rules(sequence_parallel=True)),
}
# fp16 rounds each matmul's inputs to 11 mantissa bits (~5e-4 relative), finer than bf16's 8; the loss scale
# is a power of two, so scaling and unscaling add no rounding. What differs from the serial run is summation
# order (dp/tp reductions, tp's partial products rounded to fp16 before their sum) pushed through AdamW,
# which moves an entry whose gradient is mostly rounding noise by ±lr either way: bf16's tolerances at the
# same lr (tests/test_bf16_layout.py) hold with room to spare.
TOLERANCE = 2e-3
TOLERANCES = {"tp_sp": 4e-3}


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        local, history = [], []
        for s in range(STEPS):
            scale = trainer.scaler.scale.item()
            result = trainer.step(s)
            local.append(result.loss)
            history.append((scale, bool(result.skipped.item())))
        res = {"losses": trainer.global_losses(local), "state": trainer.gathered_state(), "history": history,
               "masters": {p.dtype for g in (trainer.zero or trainer).optimizer.param_groups for p in g["params"]}}
        out[name] = res if ctx.rank == 0 else history  # every rank's history: they must agree
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    roots = {name: compile_text(mesh + COMMON.format(extra=extra), tmp / name).root
             for name, (mesh, extra) in PLANS.items()}
    results = spawn(2, _body, {n: str(r) for n, r in roots.items()})
    serial = {}
    for name, root in roots.items():  # the serial run scales as a rank does: per dp and accumulation
        art = artifact.load(root)
        log: list = []
        losses, state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS,
                                     scale_log=log)
        serial[name] = (losses, state, log)
    return results, serial


@pytest.mark.parametrize("name", PLANS)
def test_matches_serial_fp16(runs, name):
    results, serial = runs
    res, (losses, state, log) = results[0][name], serial[name]
    assert res["history"] == log, (name, res["history"], log)  # the same scales, the same skipped steps
    assert results[1][name] == log, name                       # on every rank
    verdict = compare(res["losses"], losses, res["state"], state, TOLERANCES.get(name, TOLERANCE))
    print(name, log, verdict.render())
    assert verdict.ok, (name, verdict.render())
    assert res["masters"] == {torch.float32}, name


def test_the_history_exercises_the_scaler(runs):
    """The schedule above is what the module docstring promises: skips, hysteresis, backoff and growth."""
    _, serial = runs
    log = serial["dp"][2]
    scales = [s for s, _ in log]
    skipped = [k for k in range(STEPS) if log[k][1]]
    assert scales[:3] == [2.0 ** 20, 2.0 ** 20, 2.0 ** 19], log  # hysteresis 2: the first overflow keeps it
    assert skipped[:3] == [0, 1, 2] and len(skipped) < STEPS, log
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), log  # grown after a clean window
