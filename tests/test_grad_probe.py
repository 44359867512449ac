"""The gradient probe (parc/grad_probe.py): the net under parc/trace_guards.py's list. A model whose traced
backward differs from eager's is refused at compile, naming the parameter; correct models (HF Llama, models
with constants made in forward, a custom op with its own backward, dropout) pass. Dropout is keyed alike in both runs
(passes/dropout.py, runtime/dropout.py's serial_keys), so a model with dropout is probed, and a wrong backward in
it is still found; a random op parc does not key is not probed."""

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


def test_dropout_is_probed_with_the_same_masks():
    """gpt with dropout 0.1 on embeddings, attention and residuals: 0.1 of the elements dropped in one run and
    not the other would move gradients by O(1); keyed, the two runs agree to rounding."""
    user = load_user_module(MODELS / "gpt_dropout.py")
    assert grad_probe.probe(user, trace(user, micro_batch=2), micro_batch=2) is None  # ran, and agreed


def test_hf_attention_dropout_is_probed(tmp_path):
    """HF Qwen3 with attention dropout 0.2: its SDPA's dropout is keyed in both runs (two sites), and they agree."""
    text = (MODELS / "qwen3_tiny.py").read_text().replace("attention_dropout=0.0", "attention_dropout=0.2")
    assert "attention_dropout=0.2" in text
    (tmp_path / "qwen3_dropout.py").write_text(text)
    user = load_user_module(tmp_path / "qwen3_dropout.py")
    traced = trace(user, micro_batch=2)
    assert len(grad_probe._runnable(traced, 2)[1]) == 2  # one keyed attention per layer
    assert grad_probe.probe(user, traced, micro_batch=2) is None


STE = MODELS / "ste_tiny.py"


def test_a_wrong_backward_is_found_under_dropout(monkeypatch, tmp_path):
    """ste_tiny with a dropout (p 0.3) after its straight-through estimator, the trace guards off: still refused,
    naming `fc.weight`, so keying the masks does not hide a dropped backward."""
    text = STE.read_text().replace("self.head = nn.Linear(WIDTH, CLASSES)",
                                           "self.head = nn.Linear(WIDTH, CLASSES)\n        self.drop = nn.Dropout(0.3)")
    text = text.replace("return self.head(torch.tanh(h))", "return self.head(self.drop(torch.tanh(h)))")
    assert "self.drop(" in text
    (tmp_path / "ste_dropout.py").write_text(text)
    monkeypatch.setattr("parc.trace.guarded", lambda model, path: contextlib.nullcontext())
    user = load_user_module(tmp_path / "ste_dropout.py")
    with pytest.raises(TraceError) as err:
        grad_probe.probe(user, trace(user, micro_batch=4), micro_batch=4)
    assert "gradient of `fc.weight` differs from eager" in err.value.message, err.value.message


def test_unkeyed_random_ops_are_not_probed(tmp_path):
    """`torch.rand` noise in forward: parc does not key it, so the two runs would draw different values."""
    text = STE.read_text().replace("h = RoundSTE.apply(self.fc(x))",
                                           "h = self.fc(x) + 0.1 * torch.rand(x.shape[0], WIDTH, device=x.device)")
    assert "torch.rand(" in text
    (tmp_path / "noisy.py").write_text(text)
    user = load_user_module(tmp_path / "noisy.py")
    why = grad_probe.probe(user, trace(user, micro_batch=2), micro_batch=2)
    assert why is not None and "random numbers parc does not key" in why, why
