"""Every gradient complete under tensor parallelism (passes/tp_grads.py): replicated values that meet
sharded ones — per-head q/k norms, an unsharded linear and a LayerNorm on head-sharded values, a parameter
used on both sides, an activation broadcast onto a sharded hidden — train exactly like the serial model.

The check is on one SGD step with lr 1 (no momentum, no decay, no clipping): each parameter's change is
minus its gradient, so a gradient that is wrong on one tensor shows as that tensor's own relative error,
however small the tensor (a model-wide figure would drown a 16-element norm weight in the embedding)."""

from __future__ import annotations

import pytest
import torch

from helpers import ROOT, compile_text, llama_tp_rules, train_parallel
from parc import artifact
from parc.runtime.verify import train_serial
from parc.trace import load_user_module

MODELS = ROOT / "tests" / "models"
# fp32; one step; the tp ranks sum partial values in another order than the serial model (a norm's
# statistics and an all-reduce of 2 parts): rounding at ~1e-7 relative per element, far below a
# missing share, which is O(1) of the gradient (half of it, at tp 2)
TOL = 1e-4

PARTIAL_RULES = """tensor_parallel {
    "layers.*.q" : column
    "layers.*.k" : column
    "layers.*.v" : column
    "layers.*.o" : row
    "layers.*.up" : column
    "layers.*.down" : row
""" 


def _plan(rules: str, sp: bool, mesh: str = "mesh tp=2") -> str:
    rules = rules.rstrip().removesuffix("}") + ("    sequence_parallel\n" if sp else "") + "}\n"
    return f"{mesh}\nbatch global=4 micro=2\noptimizer sgd lr=1.0\n{rules}"


def _per_tensor(state: dict, serial: dict, before: dict) -> dict[str, float]:
    """Each tensor's error in its update, relative to the serial update's own size."""
    out = {}
    for k, ser in serial.items():
        step = ser - before[k]
        out[k] = ((state[k] - before[k]) - step).norm().item() / max(step.norm().item(), 1e-12)
    return out


CASES = {
    "qwen3_tp2": (MODELS / "qwen3_tiny.py", llama_tp_rules().replace('    "model.embed_tokens"              : vocab\n', ""), False),
    "qwen3_tp2_sp": (MODELS / "qwen3_tiny.py", llama_tp_rules(), True),
    "partial_tp2": (MODELS / "partial_grads.py", PARTIAL_RULES, False),
    "partial_tp2_sp": (MODELS / "partial_grads.py", PARTIAL_RULES, True),
}


@pytest.mark.parametrize("name", CASES)
def test_one_step_equals_serial_per_tensor(tmp_path, name):
    model, rules, sp = CASES[name]
    art = compile_text(_plan(rules, sp), tmp_path / "c", model)
    _, state = train_parallel(art.root, steps=1)
    user = load_user_module(art.root / "model" / "model.py")
    _, before = train_serial(user, art.plan, 0, 0)
    _, serial = train_serial(user, art.plan, 0, 1)
    errors = _per_tensor(state, serial, before)
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOL, f"{worst}: {errors[worst]:.2e} ({sorted(errors.items(), key=lambda kv: -kv[1])[:4]})"


def test_partial_edges_are_listed(tmp_path):
    """plan.json names what is summed per step and where an f was put, for the model above."""
    art = compile_text(_plan(PARTIAL_RULES, False), tmp_path / "c", MODELS / "partial_grads.py")
    prog = art.plan["programs"]["stage0_tp0"]
    per_step = {r["param"] for r in prog["tp_grad_reductions"] if r["how"] == "per step"}
    assert {f"layers.0.{m}" for m in ("q_norm.weight", "k_norm.weight", "head_mix.weight", "head_mix.bias",
                                      "head_ln.weight", "head_ln.bias")} <= per_step
    f_values = {r["value"]: r["module"] for r in prog["tp_grad_reductions"] if r["how"] == "per micro-batch"}
    assert "layers.0.scale" in f_values  # mixed: sharded and replicated uses
    assert any(m == "layers.0" for m in f_values.values())  # the gate's activation, at the multiply


def test_report_prices_the_sums(tmp_path):
    """`parc report compiled/` charges the per-step sum (fp32, one flat all-reduce) and the f's (per
    micro-batch, compute dtype) to the step, as rows of their own; volume = 2 (tp − 1) / tp × bytes."""
    from parc.analysis import report

    art = compile_text(_plan(PARTIAL_RULES, False), tmp_path / "c", MODELS / "partial_grads.py")
    reds = art.plan["programs"]["stage0_tp0"]["tp_grad_reductions"]
    per_step = sum(r["numel"] for r in reds if r["how"] == "per step")
    per_micro = sum(r["numel"] for r in reds if r["how"] == "per micro-batch")
    rep = report.build(art.root)
    rows = [r for r in rep["communication"]["rows"] if r["collective"] == "all-reduce (partial gradients)"]
    assert [r["bytes_per_rank"] for r in rows] == [round(per_step * 4), round(per_micro * 4 * 2)]  # fp32; 2 micro
    assert any("tp partial gradients" in n for n in rep["notes"])
