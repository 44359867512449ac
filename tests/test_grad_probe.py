"""The gradient probe (parc/grad_probe.py): the net under parc/trace_guards.py's list. A model whose traced
backward differs from eager's is refused at compile, naming the parameter; correct models (HF Llama, models
with constants made in forward, a custom op with its own backward) pass; a model with dropout is not probed."""

import contextlib

import pytest

from helpers import ROOT
from parc import grad_probe, trace_guards
from parc.errors import TraceError
from parc.trace import load_user_module, trace

MODELS = ROOT / "tests" / "models"


@pytest.mark.parametrize("name", ["llama_tiny", "const_tiny", "index_tiny", "ste_op_tiny", "qwen3_tiny"])
def test_correct_models_pass(name):
    user = load_user_module(MODELS / f"{name}.py")
    assert grad_probe.probe(user, trace(user, micro_batch=2), micro_batch=2) is None  # ran, and agreed


def test_a_backward_the_list_misses_is_refused_naming_the_parameter(monkeypatch):
    """The straight-through estimator with parc/trace_guards.py switched off stands for any hand-made backward
    no rule names yet: export inlines the Function's forward (round), whose gradient is zero, so `fc` would
    train with no gradient where eager gives it the straight-through one."""
    monkeypatch.setattr("parc.trace.guarded", lambda model, path: contextlib.nullcontext())
    user = load_user_module(MODELS / "ste_tiny.py")
    traced = trace(user, micro_batch=2)
    with pytest.raises(TraceError) as err:
        grad_probe.probe(user, traced, micro_batch=2)
    assert "gradient of `fc.weight` differs from eager" in err.value.message, err.value.message
    assert "--no-grad-probe" in str(err.value)
    assert trace_guards.guarded is not None


def test_random_ops_are_not_probed():
    user = load_user_module(MODELS / "gpt_dropout.py")
    why = grad_probe.probe(user, trace(user, micro_batch=2), micro_batch=2)
    assert why is not None and "random numbers" in why
