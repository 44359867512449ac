"""No host synchronisation in a training step, and `--on-nonfinite skip` decided on the device.

A step that reads a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`) stalls
the CPU until the GPU has caught up, and the next step's kernels cannot be queued meanwhile. This
box has no GPU, so the test counts the calls themselves: every such call made from parc's code or
a generated program while two ranks run bf16 steps with clipping and the skip flag under dp, ZeRO-2 and pp. Not counted:
calls from inside torch (its CPU optimizer loop reads CPU step counters; on CUDA the fused kernel
keeps them on the device) and from the user's get_batch, which builds the batch on the host. Then `step_unless`, which makes
the skip, is held to exactness on both optimizer paths: a skipped step leaves parameters and state
bit-identical, a kept one equals a plain `step()`.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from helpers import compile_text
from parc.runtime.launch import spawn
from parc.runtime.optim_step import kernel_kwargs, step_unless
from parc.runtime.train import Trainer

COMMON = "batch global=4 micro=1\nprecision bf16\noptimizer adamw lr=1e-3 clip=1.0\n"
PLANS = {"dp": "mesh dp=2\n", "zero2": "mesh dp=2\nzero stage=2\n", "pp": "mesh pp=2\npipeline schedule=1f1b\n"}
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
TORCH = os.path.dirname(torch.__file__)


def _count_syncs(calls: list, user_file: str):
    """Patch the host-reading Tensor methods; record (name, caller file:line) of calls from parc's code."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def patched(name):
        fn = originals[name]

        def call(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if not caller.startswith(TORCH) and caller != user_file:
                calls.append((name, f"{caller}:{sys._getframe(1).f_lineno}"))
            return fn(self, *args, **kwargs)
        return call

    for name in SYNCS:
        setattr(torch.Tensor, name, patched(name))
    return originals


def _body(ctx, roots: dict[str, str]):
    return {name: _steps(root) for name, root in roots.items()}


def _steps(root: str) -> dict:
    trainer = Trainer.load(root, 0)
    trainer.step(0, skip_nonfinite=True)  # warm: optimizer state exists, as in every later step
    calls: list = []
    originals = _count_syncs(calls, str(trainer.art.root / "model" / "model.py"))
    try:
        results = [trainer.step(s, skip_nonfinite=skip) for s, skip in ((1, True), (2, False))]
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
    return {"calls": calls, "kinds": [(type(r.skipped).__name__, type(r.grad_norm).__name__) for r in results]}


def test_a_step_reads_nothing_on_the_host(tmp_path):
    roots = {name: str(compile_text(mesh + COMMON, tmp_path / name).root) for name, mesh in PLANS.items()}
    for rank in spawn(2, _body, roots):
        for name, res in rank.items():
            assert res["calls"] == [], (name, res["calls"])
            # the skip flag and the norm stay tensors, read later with the losses (runtime/divergence.py)
            assert res["kinds"] == [("Tensor", "Tensor"), ("bool", "Tensor")], (name, res["kinds"])


def _adamw(fused: bool):
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused or None)
    return params, opt


def _step(params, opt, found, seed):
    torch.manual_seed(seed)
    for p in params:
        p.grad = torch.randn_like(p)
    step_unless(opt, found)


def _snapshot(params, opt):
    return [p.detach().clone() for p in params] + \
        [v.clone() for p in params for v in opt.state.get(p, {}).values()]


@pytest.mark.parametrize("fused", [False, True])  # the CPU's loop + torch.where, and the fused kernel's found_inf
def test_step_unless_skips_exactly(fused):
    params, opt = _adamw(fused)
    _step(params, opt, torch.tensor(1.0), 0)  # a skipped first step: state goes back to zeros and step 0
    plain, plain_opt = _adamw(fused)
    assert all(torch.equal(p, q) for p, q in zip(params, plain))
    for seed in (1, 2):
        _step(params, opt, torch.tensor(0.0), seed)  # kept steps equal plain ones, bit for bit
        _step(plain, plain_opt, None, seed)
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(params, opt), _snapshot(plain, plain_opt)))
    before = _snapshot(params, opt)
    _step(params, opt, torch.tensor(1.0), 3)  # a skipped later step changes nothing, Adam's step count included
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(params, opt)))


def test_kernel_kwargs_fuse_only_on_cuda():
    assert kernel_kwargs("adamw", [torch.zeros(2)]) == {}  # the CPU keeps torch's default loop
    assert kernel_kwargs("adamw", []) == {}
