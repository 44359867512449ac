"""bf16 gradient accumulation (`precision bf16 reduce=bf16 accumulate=bf16`) beside tp, pp and cp.

tests/test_zero_bf16_accumulate.py holds it to the serial run on dp alone. Here, on 4 gloo ranks each (dp 2
and one more axis), examples/gpt.py, three micro-batches a step:

- tp 2 with sequence parallelism under ZeRO-1: the layer norms' partial gradients are summed over tp after the
  dp reduce-scatter, on the fp32 range the step reads (runtime/parallel/zero.py `grad_ranges`), as with fp32
  accumulators;
- pp 2, 1F1B, under ZeRO-1: each stage its own buckets, the tied embedding and head summed over the pp ranks
  after the reduce-scatter, likewise;
- cp 2 (ring) under ZeRO-2: the sum over dp × cp is the reduce-scatter itself.

Each trains as the serial bf16 run does (fp32 accumulation, runtime/serial_reference.py) within
test_zero_bf16_accumulate's `TOLERANCE`, whose derivation holds here (the same model, optimizer and lr; each
of the two bf16 additions a step rounds the running sum once), and as its twin with fp32 accumulators within
`TWIN_TOLERANCE`; its accumulators are bf16; and the state it holds is, byte for byte, what `parc report` says.
"""

from __future__ import annotations

import pytest
import torch

from helpers import compile_text, gpt_tp_rules
from parc.analysis import report
from parc.runtime.launch import spawn
from parc.runtime.memory import held_state
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module
from test_zero_bf16_accumulate import TOLERANCE, accumulator_dtypes

STEPS = 3
# Against the same plan with fp32 accumulators: the two bf16 additions a step and nothing else. Measured over the
# 3 steps, model-wide: 4.7e-4 (tp), 4.9e-4 (pp), 4.4e-4 (cp), losses ≤ 2.3e-5; against the serial run both the bf16
# and the fp32-accumulator runs are at 1.5e-3 (tp, cp) and 6.3e-4 (pp): the layout's bf16 wire and these meshes'
# other summation orders, which accumulate=bf16 does not move. 1e-3 holds the twins' distance with room.
TWIN_TOLERANCE = 1e-3
COMMON = "batch global=12 micro=2\nprecision bf16 reduce=bf16 accumulate=bf16\noptimizer adamw lr=1e-3 clip=0.5\n"
PLANS = {
    "tp2_sp_zero1": "mesh dp=2 tp=2\nzero stage=1\n" + COMMON + gpt_tp_rules(True),
    "pp2_zero1": "mesh dp=2 pp=2\npipeline schedule=1f1b\nzero stage=1\n" + COMMON,
    "cp2_zero2": "mesh dp=2 cp=2\ncontext_parallel ring\nzero stage=2\n" + COMMON,
}


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        dtypes = accumulator_dtypes(trainer)
        losses = [trainer.step(s).loss for s in range(STEPS)]
        out[name] = {"losses": trainer.global_losses(losses), "state": trainer.gathered_state(),
                     "memory": {"pp": trainer.ctx.coord["pp"], **held_state(trainer)}, "grad_dtypes": dtypes}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_acc_meshes")
    arts = {n: compile_text(text, tmp / n) for n, text in PLANS.items()}
    # each plan's twin with fp32 accumulators: what accumulate=bf16 itself changes
    arts |= {f"{n}_fp32acc": compile_text(text.replace(" accumulate=bf16", ""), tmp / f"{n}_fp32acc")
             for n, text in PLANS.items()}
    ranks = spawn(4, _body, {n: str(a.root) for n, a in arts.items()})
    return arts, ranks


@pytest.mark.parametrize("name", PLANS)
def test_matches_serial_bf16(runs, name):
    arts, ranks = runs
    serial_losses, serial_state = train_serial(load_user_module(arts[name].root / "model" / "model.py"),
                                               arts[name].plan, 0, STEPS)
    res = ranks[0][name]
    verdict = compare(res["losses"], serial_losses, res["state"], serial_state, TOLERANCE)
    print(name, verdict.render())
    assert verdict.ok, (name, verdict.render())
    assert serial_losses[0] != serial_losses[-1]  # it trained
    twin = ranks[0][f"{name}_fp32acc"]
    alike = compare(res["losses"], twin["losses"], res["state"], twin["state"], TWIN_TOLERANCE)
    print(name, "against fp32 accumulators:", alike.render())
    assert alike.ok, (name, alike.render())


@pytest.mark.parametrize("name", PLANS)
def test_accumulators_are_bf16_and_the_state_is_the_report(runs, name):
    arts, ranks = runs
    rows = report.build(arts[name].root)["memory"]["per_pp_rank"]
    for r in ranks:
        assert r[name]["grad_dtypes"] == {torch.bfloat16}, r[name]["grad_dtypes"]
        assert r[f"{name}_fp32acc"]["grad_dtypes"] == {torch.float32}
        mem, row = r[name]["memory"], rows[r[name]["memory"]["pp"]]
        assert (mem["params"], mem["grads"], mem["optimizer"]) == \
            (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]), (name, mem, row)
