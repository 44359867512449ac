"""`--verify`'s parameter check under bf16/fp16: the serial optimizer replayed on the parallel run's own gradients
(runtime/verify_replay.py).

Sound for noise: tests/models/norm_cast.py under dp 1, bf16, AdamW lr 1e-3, failed the three-way parameter check it
replaces (its zero-initialised `model.layers.1.input_layernorm.bias` 0.48 of its scale from fp32 where serial
bf16's was 7.8e-3: one element's gradient, below bf16's rounding, took the other sign, and Adam moved it 2·lr the
other way); through `parc.run --verify` it now passes, its parameters equal to the replay's bit for bit. Sharp for
bugs: the same model under ZeRO-1 dp 2 with one rank's update of its shard lost at step 1 (its AdamW step skipped
there) fails the parameter check, naming a tensor of that shard (measured: 5,902× the allowance, on
`model.layers.1.input_layernorm.bias`), while its losses and first-step gradients pass.
Measured noise (max |Δ| after 3 steps, examples/gpt.py, AdamW lr 1e-3, weight decay 0.1, clip 0.5, bf16): 0 at
dp 1; 7.5e-9 (half an ulp of the elements) under dp 2, ZeRO-1, ZeRO-3, pp 2 and fp16 ZeRO-2, 0.02 of allowed; fp16 ZeRO-2 with 5 of 7 steps skipped on overflow
0.03; cp 2 ZeRO-1 clip 1.0, 2 steps, 1.2e-7 (one ulp of a LayerNorm weight), 0.18; examples/moe.py dp 2 × ep 2, 0.
The unit test needs no processes: the replay's arithmetic, a lost step, fp16's skipped step.
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest
import torch

from helpers import ROOT, compile_text
from parc.run import parser, run
from parc.runtime.launch import spawn
from parc.runtime.verify_replay import TOLERANCE, OptimizerReplay
from parc.trace import load_user_module

NORM_CAST = ROOT / "tests" / "models" / "norm_cast.py"
BF16 = "batch global=8 micro=2\nprecision bf16\noptimizer adamw lr=1e-3\n"


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    return compile_text("mesh dp=1\n" + BF16, tmp_path_factory.mktemp("dp1") / "c", NORM_CAST)


def _grads(model, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    return {n: torch.randn(p.shape, generator=g) * 1e-2 for n, p in model.named_parameters()}


def test_the_replay_reproduces_its_own_steps_and_names_a_lost_one(dp1):
    user = load_user_module(dp1.root / "model" / "model.py")
    a, b = OptimizerReplay(user, dp1.plan, 0), OptimizerReplay(user, dp1.plan, 0)
    for k in range(3):
        a.feed(k, _grads(a.model, k))
        kept = b.model.lm_head.weight.detach().clone()
        b.feed(k, _grads(b.model, k))
        if k == 1:  # b's lm_head loses its step-1 update, as a stale shard would
            b.model.lm_head.weight.data.copy_(kept)
    same = a.check(a.state())
    assert same[0].abs == 0.0 and same[0].ratio == 0.0
    drifts = a.check(b.state())
    worst = drifts[0]
    # one Adam step of lr 1e-3 lost: ~1e-3 against 1e-4 × a movement of ~3e-3 plus a few ulps
    assert worst.name == "lm_head.weight" and worst.ratio > 100, worst.render()
    assert all(d.abs == 0.0 for d in drifts[1:])
    assert f"allowed {TOLERANCE:.0e} × " in worst.render()
    with pytest.raises(RuntimeError, match="got step 0's gradients after 3 steps"):
        a.feed(0, _grads(a.model, 0))


def test_the_replay_skips_the_steps_whose_gradients_overflowed(dp1):
    user = load_user_module(dp1.root / "model" / "model.py")
    replay = OptimizerReplay(user, dp1.plan, 0, skips=True)
    before = replay.state()["lm_head.weight"].clone()
    grads = _grads(replay.model, 0)
    grads["lm_head.weight"][0, 0] = float("inf")  # fp16's overflow: the parallel run skips this step
    replay.feed(0, grads)
    assert torch.equal(replay.state()["lm_head.weight"], before)
    replay.feed(1, _grads(replay.model, 1))
    assert not torch.equal(replay.state()["lm_head.weight"], before)


def _verify_body(ctx, compiled: str, lose_rank: int | None):
    """parc.run --verify for 3 steps; on rank `lose_rank` every AdamW step but the second runs (its shard's
    step-1 update is lost)."""
    if ctx.rank == lose_rank:
        real, calls = torch.optim.AdamW.step, []

        def step(self, *args, **kwargs):
            calls.append(1)
            return None if len(calls) == 2 else real(self, *args, **kwargs)
        torch.optim.AdamW.step = step
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        status = run(parser().parse_args([compiled, "--steps", "3", "--verify", "--metrics", "/dev/null"]))
    return status, said.getvalue()


def test_norm_cast_dp1_bf16_verify_passes(dp1):
    status, said = spawn(1, _verify_body, str(dp1.root), None)[0]
    assert status == 0 and "verify PASS: bf16 against serial bf16" in said, said
    # the optimizer on one rank is the serial one: the parameters equal the replay's bit for bit
    assert "parameters 0.00 of allowed, against the serial optimizer replayed" in said, said
    assert "max |Δ| 0.0e+00 from the replay" in said, said


def test_a_shard_whose_update_is_lost_fails_naming_its_tensor(tmp_path):
    art = compile_text("mesh dp=2\nzero stage=1\n" + BF16, tmp_path / "c", NORM_CAST)
    status, said = spawn(2, _verify_body, str(art.root), 1)[0]
    assert status == 1 and "verify FAIL (parameters)" in said, said  # losses and gradients pass
    worst = re.search(r"verify: worst tensor (\S+) — its parameter is (\S+) from what the serial optimizer makes "
                      r"of this run's own gradients, (\S+)× the rounding allowed", said)
    assert worst and float(worst[3]) > 100, said
    # rank 1 holds the second half of ZeRO-1's flat ranges: the later layers and the head
    assert re.fullmatch(r"model\.layers\.1\..*|lm_head\.weight", worst[1]), said


def test_fp16_steps_skipped_on_overflow_leave_the_first_applied_step_to_compare(tmp_path):
    """fp16 from a loss scale of 2**21: step 0 overflows in the parallel run and in serial fp16 alike and both skip
    it. The fp32 reference skips it too, and the gradients compared are step 1's, the first step applied; before,
    step 0's gradients (inf in both fp16 runs) read "inf of allowed" and failed a correct run."""
    art = compile_text("mesh dp=1\nbatch global=8 micro=2\nprecision fp16 initial_scale_power=21 hysteresis=1\n"
                       "optimizer adamw lr=1e-3\n", tmp_path / "c", NORM_CAST)
    status, said = spawn(1, _verify_body, str(art.root), None)[0]
    assert re.search(r"step +0 .* grad norm (inf|nan)\n", said) and status == 0, said  # step 0 overflowed
    assert re.search(r"step 1's gradients \(steps before it overflowed in serial fp16 and were skipped\) "
                     r"[0-9.]+ of allowed", said), said


def test_a_run_that_overflows_elsewhere_than_serial_fails():
    from parc.runtime.verify import compare_low_precision
    verdict = compare_low_precision("fp16", [1.0], [1.0], [1.0], None, None, 1,
                                    "the serial fp16 run's first step with finite gradients is step 1, this run's is "
                                    "step 0")
    assert not verdict.ok and verdict.failed == ["gradients"]
    assert "step 1's gradients (steps before it overflowed in serial fp16 and were skipped) not compared" in \
        verdict.render()
    assert "this run's is step 0" in verdict.render()
