"""Hand-made backward behaviour (parc/trace_guards.py): a custom autograd.Function or a backward hook, which
torch.export would drop, is refused at compile where it is made; the same straight-through estimator as a
torch.library custom op is carried with its own backward and trains under dp=2 equal to the serial model."""

from pathlib import Path

import pytest
import torch

from helpers import ROOT, compile_text, train_parallel
from parc.errors import TraceError
from parc.runtime.checkpoint.state import build_reference
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module, trace

STE = ROOT / "tests" / "models" / "ste_tiny.py"
STE_OP = ROOT / "tests" / "models" / "ste_op_tiny.py"
PLAN = "mesh dp=2\nbatch global=8 micro=2\noptimizer sgd lr=0.1\n"


def test_autograd_function_is_refused_at_its_apply_call(tmp_path):
    with pytest.raises(TraceError) as err:
        compile_text(PLAN, tmp_path / "c", model=STE)
    span = err.value.span
    assert (Path(span.file), span.line, span.col) == (STE, 36, 13)  # h = RoundSTE.apply(self.fc(x))
    assert "autograd.Function `RoundSTE`" in err.value.message and "backward would not run" in err.value.message
    text = str(err.value)
    assert "RoundSTE.apply(self.fc(x))" in text
    assert "torch.library.custom_op" in text and "register_autograd" in text
    assert not (tmp_path / "c").exists()
    assert torch.autograd.Function.apply.__func__.__qualname__ == "Function.apply"  # restored after the refusal


def test_custom_op_carries_its_backward_under_dp(tmp_path):
    art = compile_text(PLAN, tmp_path / "c", model=STE_OP)
    assert "torch.ops.parc_tests.round_ste.default" in (art.root / "programs" / "stage0_tp0.py").read_text()
    losses, state = train_parallel(art.root, steps=3)
    user = load_user_module(art.root / "model" / "model.py")
    serial_losses, serial_state = train_serial(user, art.plan, 0, 3)
    verdict = compare(losses, serial_losses, state, serial_state)
    # fp32 SGD: dp only reorders the sums of the batch mean (~1e-7); autograd of round() instead of the
    # registered backward would leave fc without gradient, an error of the size of fc's update (~1e-2)
    assert verdict.loss_rel < 1e-5 and verdict.param_rel < 1e-5, verdict.render()
    start = build_reference(user, 0).fc.weight.detach()
    assert not torch.allclose(state["fc.weight"], start)  # the straight-through gradient reached fc


HOOKS = """\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        {forward}
        return h.mean()


def halve(module, grad_in, grad_out):
    return (grad_in[0] / 2,)


def build_model():
    net = Net()
    {build}
    return net


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 4),)


def loss_fn(model, x):
    return model(x)
"""


@pytest.mark.parametrize("forward, build, where, words", [
    ("h.register_hook(lambda g: g * 2)", "pass", (12, 9), "`Tensor.register_hook` in forward"),
    ("pass", "net.fc.register_full_backward_hook(halve)", (16, 1), "module `fc`'s backward hook `halve`"),
    ("pass", "net.fc.weight.register_hook(lambda g: g * 2)", (22, 1), "gradient hook on `fc.weight`"),
])
def test_backward_hooks_are_refused_located(tmp_path, forward, build, where, words):
    path = tmp_path / "model.py"
    path.write_text(HOOKS.format(forward=forward, build=build))
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), micro_batch=2)
    span = err.value.span
    assert (Path(span.file).resolve(), span.line, span.col) == (path.resolve(), *where), str(err.value)
    assert words in err.value.message
    assert torch.Tensor.register_hook.__qualname__ == "Tensor.register_hook"  # restored


FUNCTION_WITHOUT_GRAD = """\
import torch
import torch.nn as nn


class Clamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, g):
        return g


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        x = Clamp.apply(x)  # on the input, which needs no gradient
        with torch.no_grad():
            scale = Clamp.apply(self.fc.weight).abs().mean()
        return (self.fc(x) * scale).mean()


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 4),)


def loss_fn(model, x):
    return model(x)
"""


def test_function_whose_backward_never_runs_is_traced(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(FUNCTION_WITHOUT_GRAD)
    traced = trace(load_user_module(path), micro_batch=2)
    assert any(n.target == torch.ops.aten.clamp.default for n in traced.gm.graph.nodes)
