"""Expert parallelism composed with ZeRO-1/2, `clip=`, bf16 and fp16, exact against the serial MoE model.

tests/test_moe.py's tiny MoE GPT (block 1 top-1 at capacity factor 0.5: tokens dropped; block 3
top-2 at 2.0: none) trains 2 steps per plan; the serial reference (`PER_MICRO_BATCH`) runs the same
batches from the same weights under each plan's optimizer and precision. One spawned world per
size: 4 ranks (`mesh dp=4 ep=2 zero stage=2`, clipped: the experts' ZeRO partition is cut over
edp groups of 2, the dense one over dp 4), 2 ranks (ZeRO-1, clipping without ZeRO, bf16, fp16; there edp
is one rank, so the experts' partition is whole and their gradient only divided by dp). Under bf16 and
fp16 the all-to-alls carry 16-bit activations: half the bytes of the fp32 run's.

fp16 runs DeepSpeed's loss scaler (runtime/loss_scale.py) from two first scales: 2**4, where this model
never overflows, and 2**18 with hysteresis 1, where both steps overflow (skipped, the scale halved each
time). Each must match the serial run's scale history and skipped steps on every rank, and its losses and
parameters. Between the two (2**17 here) the ep run and the serial one part: an expert's weight gradient
is one fp16 matmul output over the tokens the all-to-all gathered from several ranks, where the serial
reference forms one rank's micro-batch at a time, so the two overflow at different scales (measured: the
serial run skipped step 0 at 2**17, the ep run did not). The run's own decision still holds on every
rank: the overflow flag is all-reduced over dp (runtime/parallel/grad_norm.py `nonfinite`), which
contains every ep and edp group.

The clipped plans use SGD (Adam would cancel a wrong clip coefficient) at `clip=1.0`, below this
model's gradient norm in both steps (checked), so the update is lr · clip · g / ‖g‖: a norm counting
only each ep rank's own experts (the bug the refusal guarded) measured 1.2e-3 on the parameters,
twelve times the tolerance.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from parc import artifact
from parc.compiler import compile_model
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import DEFAULT_TOLERANCE, compare, train_serial
from parc.trace import load_user_module
from test_moe import MICRO, MODEL, STEPS

CLIP = 1.0
# name → (dp, plan lines besides mesh/batch/expert_parallel)
PLANS = {
    "zero2_clip": (4, f"zero stage=2\noptimizer sgd lr=2 clip={CLIP}\n"),
    "zero1": (2, "zero stage=1\noptimizer adamw lr=1e-2\n"),
    "clip": (2, f"optimizer sgd lr=2 clip={CLIP}\n"),
    "bf16": (2, "precision bf16\noptimizer adamw lr=1e-3\n"),
    "fp16": (2, "precision fp16 initial_scale_power=4\noptimizer adamw lr=1e-3\n"),
    "fp16_overflow": (2, "precision fp16 initial_scale_power=18 hysteresis=1\noptimizer adamw lr=1e-3\n"),
}
# bf16: the serial run rounds the same fp32 masters to bf16 the same way; what differs is summation
# order (dp and edp reductions, the all-to-all's sources) through bf16 activations, then AdamW, as in
# tests/test_bf16_layout.py, whose lr 1e-3 and tolerance this takes (measured here: parameters 8.6e-4,
# losses 1.2e-5).
# fp16 rounds finer than bf16 (11 mantissa bits) and the loss scale is a power of two (it adds no rounding
# of its own), so bf16's reasons and tolerance hold (measured: parameters 3.4e-4, losses 1.8e-6).
TOLERANCES = {"bf16": 2e-3, "fp16": 2e-3, "fp16_overflow": 2e-3}


def _compile(name: str, tmp_path) -> str:
    dp, lines = PLANS[name]
    model = tmp_path / "moe_tiny.py"
    model.write_text(MODEL.format(k1=1, cf1=0.5, k3=2, cf3=2.0, examples=str(ROOT / "examples")))
    text = (f"mesh dp={dp} ep=2\nbatch global={2 * dp * MICRO} micro={MICRO}\n"
            'expert_parallel {\n    "blocks.*.moe.experts"\n}\n' + lines)
    out = tmp_path / name
    compile_model(model, parse(text, str(tmp_path / f"{name}.par")), out)
    return str(out)


def _body(ctx, roots: dict[str, str]):
    from parc.runtime.parallel import expert_parallel

    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        history, steps = [], []
        with expert_parallel.traffic() as sent:
            for s in range(STEPS):
                scale = trainer.scaler.scale.item() if trainer.scaler else None
                steps.append(trainer.step(s))
                history.append((scale, bool(steps[-1].skipped.item()) if trainer.scaler else None))
        layout = None
        if trainer.zero is not None:  # the experts' ranges: cut over edp, not dp
            experts = trainer.zero.experts
            layout = (experts.dp, sum(m.numel() for m in experts.master),
                      sum(b["padded"] for b in trainer.entry["expert_zero"]["buckets"]))
        out[name] = {"losses": trainer.global_losses([r.loss for r in steps]),
                     "norms": [float(r.grad_norm) for r in steps if r.grad_norm is not None],
                     "state": trainer.gathered_state(), "layout": layout, "sent": sum(b for _, b in sent),
                     "history": history}
        if ctx.rank:
            out[name]["state"] = None
    return out


@pytest.mark.parametrize("dp", [4, 2])
def test_ep_composes_exactly(dp, tmp_path):
    names = [n for n, (d, _) in PLANS.items() if d == dp]
    roots = {n: _compile(n, tmp_path) for n in names}
    results = spawn(dp, _body, roots)
    if dp == 2:  # bf16 activations on the all-to-all: half the bytes of the same fp32 exchange
        assert 2 * results[0]["bf16"]["sent"] == results[0]["clip"]["sent"] > 0
        assert results[0]["fp16"]["sent"] == results[0]["bf16"]["sent"]
    for name in names:
        art = artifact.load(roots[name])
        got = results[0][name]
        if "clip" in name:
            assert len(got["norms"]) == STEPS and min(got["norms"]) > CLIP, got["norms"]
        if got["layout"] is not None:  # each rank holds 1 / edp of its experts' flat buffer
            edp, held, padded = got["layout"]
            assert edp == dp // 2 and held * edp == padded, got["layout"]
            assert all(r[name]["layout"] == got["layout"] for r in results)
        user = load_user_module(art.root / "model" / "model.py")
        scale_log: list = []
        serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS, scale_log=scale_log)
        if name.startswith("fp16"):  # the same scales and skipped steps as serial, on every rank
            assert all(r[name]["history"] == scale_log for r in results), (scale_log, got["history"])
            skipped = [s for _, s in scale_log]
            assert skipped == ([True] * STEPS if name == "fp16_overflow" else [False] * STEPS), scale_log
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state,
                          TOLERANCES.get(name, DEFAULT_TOLERANCE))
        print(f"{name}: {verdict.render()} norms {got['norms']}")  # the measured figures, with -s
        assert verdict.ok, f"{name}: {verdict.render()}"
