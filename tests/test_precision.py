"""`precision fp16`'s plan keys and its loss scaler's rule (runtime/loss_scale.py).

What fp16 trains against the serial run (dp, ZeRO-1/2/3, pp, tp + SP, skipped steps and the scale's history)
is tests/test_fp16.py; a resumed fp16 run is tests/test_resume_exact.py. `precision bf16` (bf16 copies of fp32
masters, fp32 gradients; DP, ZeRO-2/3, TP + SP, PP against the serial bf16 model) is tests/test_bf16_layout.py.
"""

import json
import random

import pytest
import torch

from helpers import GPT
from parc.compiler import compile_model
from parc.errors import PlanError
from parc.grammar.parser import parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate
from parc.runtime.loss_scale import LossScaler


def _errors(text: str) -> list[tuple[str, int, int]]:
    try:
        validate(parse(text, file="p.par"))
    except PlanError as e:
        return [(d.message, d.span.line, d.span.col) for d in e.diagnostics if d.severity == "error"]
    return []


def test_fp16_compiles_with_deepspeeds_defaults(tmp_path):
    plan = parse("mesh dp=2\nbatch global=8 micro=2\nprecision fp16\n", file=str(tmp_path / "fp16.par"))
    compile_model(GPT, plan, tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "plan.json").read_text())["plan"]
    assert summary["precision"] == "fp16"
    assert summary["loss_scaling"] == {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                                       "min_loss_scale": 1.0, "loss_scale": 0.0}


def test_scaler_keys_round_trip():
    text = "mesh dp=2\nprecision fp16 initial_scale_power=12 loss_scale_window=500 hysteresis=1 min_loss_scale=0.25\n"
    plan = parse(text)
    assert parse(format_plan(plan)) == plan
    assert "initial_scale_power=12 loss_scale_window=500 hysteresis=1 min_loss_scale=0.25" in format_plan(plan)


@pytest.mark.parametrize("line, message, col", [
    ("precision bf16 hysteresis=1", "precision bf16 hysteresis=: loss scaling is fp16's", 27),
    ("precision fp16 initial_scale_power=70", "precision initial_scale_power must be an integer 0..64, got 70", 36),
    ("precision fp16 min_loss_scale=0", "precision min_loss_scale must be > 0, got 0", 31),
    ("precision fp16 initial_scale_power=2 min_loss_scale=8", "precision min_loss_scale 8 is above the first scale", 53),
    ("precision fp16 loss_scale=-1", "precision loss_scale must be 0 (dynamic)", 27),
    ("precision fp16 hysteresis=0", "precision hysteresis must be a positive integer", 27),
    ("precision fp16 reduce=bf16", "precision fp16 reduce=bf16: a bf16 gradient reduction needs bf16 compute", 23),
])
def test_scaler_keys_are_validated_at_their_token(line, message, col):
    errors = _errors(f"mesh dp=2\n{line}\n")
    assert len(errors) == 1 and errors[0][0].startswith(message) and errors[0][1:] == (2, col), errors


def _deepspeed(overflows: list[bool], init: float, window: int, hysteresis: int, min_scale: float) -> list[float]:
    """DeepSpeed's DynamicLossScaler.update_scale (consecutive_hysteresis false, scale_factor 2), transcribed in
    host Python: the scale before each step."""
    cur, cur_iter, last_overflow, left, out = init, 0, -1, hysteresis, []
    for overflow in overflows:
        out.append(cur)
        if overflow:
            if hysteresis == 1 or left == 1:
                cur = max(cur / 2, min_scale)
            else:
                left -= 1
            last_overflow = cur_iter
        elif (cur_iter - last_overflow) % window == 0:
            left = hysteresis
            cur *= 2
        cur_iter += 1
    return out


@pytest.mark.parametrize("window, hysteresis, min_scale", [(1, 1, 1.0), (3, 2, 1.0), (4, 3, 64.0), (2, 1, 0.5)])
def test_the_device_scaler_is_deepspeeds_rule(window, hysteresis, min_scale):
    rng = random.Random(window * 7 + hysteresis)
    overflows = [rng.random() < 0.4 for _ in range(200)]
    cfg = {"initial_scale_power": 10, "loss_scale_window": window, "hysteresis": hysteresis,
           "min_loss_scale": min_scale, "loss_scale": 0.0}
    scaler, seen = LossScaler(cfg, "cpu"), []
    for overflow in overflows:
        seen.append(scaler.scale.item())
        scaler.update(torch.tensor(float(overflow)))
    assert seen == _deepspeed(overflows, 2.0 ** 10, window, hysteresis, min_scale)
    assert min(seen) >= min_scale


def test_a_static_scale_never_moves_and_unscaling_is_exact():
    scaler = LossScaler({"initial_scale_power": 16, "loss_scale_window": 1, "hysteresis": 1,
                         "min_loss_scale": 1.0, "loss_scale": 128.0}, "cpu")
    for overflow in (1.0, 0.0, 0.0, 1.0):
        scaler.update(torch.tensor(overflow))
    assert scaler.scale.item() == 128.0
    g = torch.randn(100)
    scaled = g * scaler.loss_factor(1)
    scaler.unscale_([scaled])
    assert torch.equal(scaled, g)  # a power of two: no rounding either way


@pytest.mark.parametrize("plan", ["mesh dp=2\nbatch global=8 micro=2\nzero stage=1\n",
                                  "mesh dp=2\nbatch global=8 micro=2\nzero stage=3\n", "mesh pp=2\nbatch global=8 micro=2\n"])
def test_report_prices_fp16_as_bf16(tmp_path, plan):
    """fp16 is bf16's layout in another 16-bit dtype (same bytes, same tensor-core rate on the presets): `parc
    report` gives the same memory, traffic and step time; its layout note names fp16 and the loss scaling."""
    from parc.analysis import report

    reps = {}
    for p in ("bf16", "fp16"):
        path = tmp_path / f"{p}.par"
        path.write_text(plan + f"precision {p}\n")
        reps[p] = report.build(model=GPT, plan=path)
    bf16, fp16 = reps["bf16"], reps["fp16"]
    assert fp16["memory"] == bf16["memory"] and fp16["communication"] == bf16["communication"]
    assert fp16["utilization"] == bf16["utilization"]
    note = next(n for n in fp16["notes"] if n.startswith("precision layout"))
    assert "fp16 compute" in note and "dynamic loss scaling" in note
