"""Parameters the traced forward never reads are held by exactly one pipeline stage (passes/pipeline_split.py
`unused_owners`), trained as serial trains them, and saved.

tests/models/unused_params.py owns a submodule no block calls, a projection whose output is dropped, a
parameter only block 0 reads, and one the model never reads: what transformers' deepseek_v4 does at short
sequences. Under pp the stages took only the parameters their nodes read, so these were in no stage: the run
trained and saved a model without them (the zoo's CRASH `parallel run lacks parameters […compressor…]` under
pp2 and 3d). AdamW with weight decay: the serial model's optimizer skips a parameter whose gradient is None
(no decay, no moments), so a stage that decayed it, or gave it a zero gradient where serial has None, would
differ from serial by lr × wd × the parameter after each step (1e-2 × 0.1 × ~1 = 1e-3, far above the
tolerance below).
"""

from __future__ import annotations

import pytest
import torch

from helpers import ROOT, compile_text
from parc import artifact
from parc.export import load_model_state
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

MODEL = ROOT / "tests" / "models" / "unused_params.py"
STEPS = 2
COMMON = "batch global=4 micro=1\noptimizer adamw lr=1e-2 weight_decay=0.1\npipeline schedule=1f1b stages=auto\n"
TP = 'tensor_parallel {\n    "blocks.*.up" : column\n    "blocks.*.down" : row\n}\n'
PLANS = {"pp2": (2, "mesh pp=2\n"),
         "dp2_pp2_zero1": (4, "mesh dp=2 pp=2\nzero stage=1\n"),
         "pp2_tp2": (4, "mesh pp=2 tp=2\n" + TP),
         "dp2_zero3": (2, "mesh dp=2\nzero stage=3\n")}  # no pipeline: ZeRO-3's flat ranges hold them
UNREAD = ["spare", "blocks.0.unused.weight", "blocks.0.unused.bias", "blocks.1.unused.weight",
          "blocks.1.unused.bias", "blocks.1.first_only"]
# fp32, the same weights and batches: the pipeline's micro-batches sum the gradients in another order than
# serial's one batch (about 1e-7 relative); AdamW's division by √v can carry that to ~1e-6 on near-zero entries
TOLERANCE = 1e-4


def _body(ctx, root: str, ckpt: str):
    trainer = Trainer.load(root, 0)
    losses = trainer.global_losses([trainer.step(s).loss for s in range(STEPS)])
    checkpoint.save(trainer, ckpt, STEPS)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state} if ctx.rank == 0 else None


@pytest.fixture(scope="module", params=list(PLANS))
def run(request, tmp_path_factory):
    name = request.param
    world, mesh = PLANS[name]
    tmp = tmp_path_factory.mktemp(name)
    art = compile_text(mesh + COMMON, tmp / "compiled", MODEL)
    got = spawn(world, _body, str(art.root), str(tmp / "ckpt"))[0]
    loaded = artifact.load(art.root)
    serial = train_serial(load_user_module(loaded.root / "model" / "model.py"), loaded.plan, 0, STEPS)
    return name, art, got, serial, load_model_state(tmp / "ckpt")


def test_every_parameter_has_one_stage(run):
    name, art, *_ = run
    held: dict[str, list[int]] = {}
    for prog in art.plan["programs"].values():
        if prog["tp_rank"] == 0:
            for e in prog["state"]:
                if e["kind"] == "param":
                    held.setdefault(e["fqn"], []).append(prog["stage"])
    serial = dict(load_user_module(MODEL).build_model().named_parameters())
    assert sorted(held) == sorted(serial), sorted(set(serial) ^ set(held))
    assert all(len(stages) == 1 for stages in held.values()), held  # no tied weights here: one owner each
    if art.plan["mesh"]["pp"] > 1:  # each where its module computes; `spare` at the root, in stage 0
        assert held["spare"] == [0] and held["blocks.0.unused.weight"] == [0] and held["blocks.1.unused.weight"] == [1]
    assert sorted(art.plan["unread_params"]) == sorted(UNREAD + ["blocks.0.dropped.weight", "blocks.0.dropped.bias",
                                                                 "blocks.1.dropped.weight", "blocks.1.dropped.bias"])


def test_trains_like_serial(run):
    name, art, got, (serial_losses, serial_state), _ = run
    verdict = compare(got["losses"], serial_losses, got["state"], serial_state, TOLERANCE)
    assert verdict.ok, (name, verdict.render())
    for fqn in art.plan["unread_params"]:  # no gradient, so AdamW (decay included) leaves them as built, in both runs
        assert torch.equal(got["state"][fqn], serial_state[fqn]), fqn


def test_checkpoint_holds_every_parameter(run):
    name, art, got, _, saved = run
    for fqn, value in got["state"].items():
        assert fqn in saved and torch.equal(saved[fqn], value), fqn
