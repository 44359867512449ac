"""`--verify` points at the problem: tensors ranked by their error relative to their own scale, and the first
step's gradients compared directly (runtime/verify.py, runtime/verify_grads.py).

The end-to-end tests run `parc.run` itself on gloo ranks: a correct tp plan passes every check, and the same
artifact with its per-step tp reduction of the q/k norm weights struck out of plan.json (what main did before
passes/tp_grads.py inserted it) fails the gradient check, naming a q_norm or k_norm weight, though its loss
agrees. The gathering tests take step 0's gradients whole from ZeRO ranges and pipeline stages and match
them with the serial model's. The ranking tests need no processes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
import torch

from helpers import ROOT, compile_text, llama_tp_rules
from parc import artifact
from parc.run import parser, run
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import SCALE_FLOOR, Verdict, Worst, compare_low_precision, rank_tensors, spreads
from parc.runtime.verify_grads import FP32_GRAD_TOLERANCE, FirstGrads, check
from parc.trace import load_user_module

QWEN3 = ROOT / "tests" / "models" / "qwen3_tiny.py"


def test_a_small_tensor_off_by_half_outranks_a_big_one_with_larger_absolute_error():
    serial = {"embed.weight": torch.full((64, 8), 10.0), "q_norm.weight": torch.ones(4)}
    parallel = {"embed.weight": serial["embed.weight"] + 1e-3,          # 1e-4 of its scale, |Δ| 1e-3
                "q_norm.weight": torch.tensor([1.0, 1.0, 0.5, 1.0])}    # 0.5 of its scale, |Δ| 0.5
    ranked = rank_tensors(parallel, serial)
    assert [w.name for w in ranked] == ["q_norm.weight", "embed.weight"]
    assert math.isclose(ranked[0].rel, 0.5) and math.isclose(ranked[0].abs, 0.5)
    assert math.isclose(ranked[1].rel, 1e-4, rel_tol=1e-3) and math.isclose(ranked[1].abs, 1e-3, rel_tol=1e-3)


def test_the_floor_keeps_rounding_noise_on_a_zero_tensor_below_a_real_error():
    """A gradient that is zero in exact arithmetic (a key bias) holds only noise: against its own scale it
    would read 1.0, against the floor (SCALE_FLOOR × the largest element, 1e-3 × 2) it reads 5e-6."""
    serial = {"w": torch.tensor([2.0, -1.0]), "k_bias": torch.tensor([1e-8, 0.0]), "b": torch.tensor([1.0])}
    parallel = {"w": torch.tensor([2.0, -1.0001]), "k_bias": torch.tensor([0.0, -1e-8]), "b": torch.tensor([1.0])}
    by_name = {w.name: w for w in rank_tensors(parallel, serial)}
    assert math.isclose(by_name["k_bias"].rel, 1e-8 / (SCALE_FLOOR * 2.0), rel_tol=1e-6)
    assert by_name["w"].rel > by_name["k_bias"].rel and by_name["b"].rel == 0.0
    assert rank_tensors(parallel, serial, floor=0.0)[0].name == "k_bias"  # without a floor: noise first


def test_tied_names_are_one_tensor_and_nan_ranks_first():
    shared = torch.ones(3)
    serial = {"wte.weight": shared, "lm_head.weight": shared, "ln.weight": torch.ones(2)}
    ranked = rank_tensors({"lm_head.weight": torch.ones(3), "ln.weight": torch.tensor([1.0, math.nan])}, serial)
    assert [w.name for w in ranked] == ["ln.weight", "lm_head.weight"] and ranked[0].rel == math.inf


def test_the_verdict_names_the_failed_check_and_the_worst_tensor():
    grad = Worst("model.layers.0.self_attn.q_norm.weight", 0.89, 1.9e-3)
    param = Worst("model.embed_tokens.weight", 2e-2, 4e-3)
    bad = Verdict(9e-5, 1.1e-2, param, 1e-4, [1.0], grad, 1e-4)
    text = bad.render()
    assert not bad.ok and bad.failed == ["gradients", "parameters"]
    assert text.startswith("verify FAIL (gradients, parameters):")
    assert "verify: worst tensor model.layers.0.self_attn.q_norm.weight — its first-step gradient differs by " \
           "8.9e-01 of its scale (max |Δ| 1.9e-03)" in text
    good = Verdict(1e-7, 1e-7, param, 1e-4, [1.0], Worst("x", 1e-7, 1e-9), 1e-4)
    assert good.ok and good.render().startswith("verify PASS:") and "\n" not in good.render()
    assert Verdict(math.nan, 0.0, None, 1e-4, [1.0]).failed == ["loss"]  # nan fails; no gradient check made
    assert "first-step gradients not compared" in Verdict(0.0, 0.0, None, 1e-4, [1.0]).render()


def _verify_body(ctx, compiled: str, metrics: str):
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        status = run(parser().parse_args([compiled, "--steps", "1", "--verify", "--metrics", metrics]))
    return status, said.getvalue()


def _without_tp_partial_grads(src, dst) -> list[str]:
    """A copy of artifact `src` at `dst` whose programs sum nothing over tp after the dp sync (runtime/train.py
    `_complete_grads`); returns the names struck out. The manifest is rewritten, so the copy loads."""
    files = {line.split("  ", 1)[1]: (src / line.split("  ", 1)[1]).read_bytes()
             for line in (src / "MANIFEST").read_text().splitlines()}
    plan = json.loads(files["plan.json"])
    struck = sorted({n for prog in plan["programs"].values() for n in prog.pop("tp_partial_grads", [])})
    files["plan.json"] = artifact.dumps(plan)
    artifact.write(dst, files)
    return struck


def test_verify_passes_a_correct_tp_plan_and_names_a_broken_gradient(tmp_path):
    art = compile_text("mesh tp=2\nbatch global=4 micro=2\n" + llama_tp_rules(), tmp_path / "c", QWEN3)
    status, said = spawn(2, _verify_body, str(art.root), str(tmp_path / "m.jsonl"))[0]
    assert status == 0 and "verify PASS" in said, said
    # gradients compared (not skipped) and within FP32_GRAD_TOLERANCE 1e-4 (runtime/verify_grads.py's figures)
    assert re.search(r"first-step gradients \d\.\d\de-0[5-9] \(worst ", said), said

    struck = _without_tp_partial_grads(art.root, tmp_path / "broken")
    assert struck and all(re.search(r"[qk]_norm_weight$", n) for n in struck), struck
    status, said = spawn(2, _verify_body, str(tmp_path / "broken"), str(tmp_path / "m2.jsonl"))[0]
    assert status == 1 and "verify FAIL (" in said and "gradients" in said.split("verify FAIL (")[1].split(")")[0], said
    worst = re.search(r"verify: worst tensor (\S+) — its first-step gradient differs by (\S+) of its scale", said)
    assert worst and re.fullmatch(r"model\.layers\.\d\.self_attn\.[qk]_norm\.weight", worst[1]), said
    assert float(worst[2]) > 0.1  # a missing tp share: O(1) of the tensor's scale, not rounding


def _first_grads_body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 0)
    trainer.grad_observer = (grads := FirstGrads()).of_trainer
    trainer.step(0)
    return grads


GATHERS = {  # each a way a gradient is split across ranks: ZeRO ranges over dp, pipeline stages, bf16 masters
    "zero3": "mesh dp=2\nbatch global=8 micro=2\nzero stage=3\n",
    "pp2": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=1f1b stages=auto\n",
    "zero2_bf16": "mesh dp=2\nbatch global=8 micro=2\nzero stage=2\nprecision bf16\n",
}


@pytest.mark.parametrize("name", GATHERS)
def test_first_step_gradients_gather_whole_under_zero_and_pp(tmp_path, name):
    art = compile_text(GATHERS[name], tmp_path / "c")
    grads = spawn(art.world_size, _first_grads_body, str(art.root))[0]
    worst = check(grads, load_user_module(art.root / "model" / "model.py"), art.plan, 0)
    assert set(grads.grads) >= {"wte.weight", "blocks.0.attn.qkv.weight", "ln_f.bias"}
    # examples/gpt.py measures ≤ 2e-7 in all three (bf16: the serial step runs per micro-batch, so dp's sums
    # round as serial's do); FP32_GRAD_TOLERANCE 1e-4 as --verify uses, for bf16 too: no tp partial sums here
    assert worst is not None and worst.rel < FP32_GRAD_TOLERANCE, worst


# ---------------------------------------------------------------- bf16: both runs measured from serial fp32


def test_low_precision_passes_rounding_noise_and_fails_a_missing_share():
    """Measured from the fp32 reference: a tensor both bf16 runs round far from fp32 (a gradient that cancels to
    little: diffllama's `lambda_q2`, 0.49 of its scale apart between the two bf16 runs) passes; a tensor serial
    bf16 gets to 1e-2 of fp32 while the parallel run lost half of it fails, and is named."""
    reference = {"lambda": torch.tensor([1.0, -1.0]), "q_norm": torch.ones(4), "w": torch.full((3,), 2.0)}
    serial = {"lambda": torch.tensor([1.5, -1.0]), "q_norm": torch.ones(4) * 1.01, "w": torch.full((3,), 2.0)}
    parallel = {"lambda": torch.tensor([1.0, -0.5]), "q_norm": torch.tensor([1.0, 1.0, 0.5, 1.0]),
                "w": torch.full((3,), 2.01)}
    # the direct comparison calls the noise an error of the real one's size (0.5 / 1.5 of serial's scale)
    assert {w.name: round(w.rel, 2) for w in rank_tensors(parallel, serial)}["lambda"] == 0.33
    ranked = {s.name: s for s in spreads(parallel, serial, reference, floor=1e-2)}
    assert ranked["lambda"].ratio <= 1.0                   # 0.5 ≤ 3 × 0.5 + 1e-2
    assert ranked["w"].ratio <= 1.0                        # 5e-3 ≤ 3 × 0 + 1e-2: the floor
    assert ranked["q_norm"].ratio > 10                      # 0.5 > 3 × 1e-2 + 1e-2 = 4e-2
    assert spreads(parallel, serial, reference, floor=1e-2)[0].name == "q_norm"
    assert "q_norm: 5.0e-01 of its scale from fp32, serial 1.0e-02; allowed 3 × 1.0e-02 + 1e-02 = 4.0e-02" \
        in ranked["q_norm"].render()
    verdict = compare_low_precision("bf16", [2.0], [2.0005], [2.0], (parallel, serial, reference))
    assert verdict.failed == ["gradients"] and verdict.worst_grad.name == "q_norm"
    assert "verify: worst tensor q_norm — its first-step gradient is 5.0e-01 of its scale from fp32 where serial " \
           "bf16's is 1.0e-02" in verdict.render()
    ok = compare_low_precision("bf16", [2.001], [2.0005], [2.0], None)
    assert ok.ok and ok.worst_grad is None and "first-step gradients not compared" in ok.render()
    assert "parameters not compared" in ok.render()


def test_verify_under_bf16_passes_a_tp_plan_and_fails_a_missing_tp_sum(tmp_path):
    """`parc.run --verify` under bf16 (runtime/verify.py `compare_low_precision`): the tp plan passes, and the same
    artifact without its tp sums of the q/k norm weights' gradients fails the gradient check, naming one: a
    missing share is still caught though the bound is relative to serial bf16's own distance from fp32."""
    art = compile_text("mesh tp=2\nbatch global=4 micro=2\nprecision bf16\n" + llama_tp_rules(), tmp_path / "c",
                       QWEN3)
    status, said = spawn(2, _verify_body, str(art.root), str(tmp_path / "m.jsonl"))[0]
    assert status == 0 and "verify PASS: bf16 against serial bf16, both from serial fp32" in said, said
    struck = _without_tp_partial_grads(art.root, tmp_path / "broken")
    assert struck, struck
    status, said = spawn(2, _verify_body, str(tmp_path / "broken"), str(tmp_path / "m2.jsonl"))[0]
    assert status == 1 and "gradients" in said.split("verify FAIL (")[1].split(")")[0], said
    worst = re.search(r"verify: worst tensor (\S+) — its first-step gradient is (\S+) of its scale from fp32 "
                      r"where serial bf16's is (\S+)", said)
    assert worst and re.fullmatch(r"model\.layers\.\d\.self_attn\.[qk]_norm\.weight", worst[1]), said
    assert float(worst[2]) > 10 * float(worst[3]), said  # a missing share, not rounding
