"""Hand-made backward behaviour (parc/trace_guards.py): a custom autograd.Function or a backward hook, which
torch.export would drop, is refused at compile where it is made; the same straight-through estimator as a
torch.library custom op is carried with its own backward and trains under dp=2 equal to the serial model."""

from pathlib import Path

import pytest
import torch

from helpers import ROOT, compile_text, train_parallel
from parc.errors import ParcError, TraceError
from parc.grad_probe import probe
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


CUSTOM_OP_TP = """\
import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.library.custom_op("parc_tests::ste_tp_{tag}", mutates_args=(), tags={tags})
def round_ste(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 4) / 4


@round_ste.register_fake
def _(x):
    return torch.empty_like(x)


round_ste.register_autograd(lambda ctx, grad: grad)  # straight through


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 32)
        self.proj = nn.Linear(32, 4)

    def forward(self, x):  # (B, 8) → (B, 4)
        return self.proj(F.gelu(round_ste(self.fc(x))))


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)
"""
TP_PLAN = ('mesh tp=2\nbatch global=4 micro=2\noptimizer sgd lr=0.1\n'
           'tensor_parallel {\n    "fc" : column\n    "proj" : row\n}\n')


def test_pointwise_custom_op_on_a_column_shard_trains_equal_to_serial(tmp_path):
    """Tagged `torch.Tag.pointwise`, the op is elementwise by its author's word, forward and backward: the tp pass
    applies it to each rank's columns, as it does aten's pointwise ops."""
    path = tmp_path / "model.py"
    path.write_text(CUSTOM_OP_TP.format(tag="pw", tags="(torch.Tag.pointwise,)"))
    art = compile_text(TP_PLAN, tmp_path / "c", model=path)
    assert "torch.ops.parc_tests.ste_tp_pw.default" in (art.root / "programs" / "stage0_tp0.py").read_text()
    losses, state = train_parallel(art.root, steps=3)
    user = load_user_module(art.root / "model" / "model.py")
    serial_losses, serial_state = train_serial(user, art.plan, 0, 3)
    verdict = compare(losses, serial_losses, state, serial_state)
    # fp32 SGD: tp reorders only proj's partial sums (all-reduced), ~1e-7; the op on the wrong columns, or
    # autograd of round() instead of the straight-through backward, moves fc by its whole update (~1e-2)
    assert verdict.loss_rel < 1e-5 and verdict.param_rel < 1e-5, verdict.render()
    assert not torch.allclose(state["fc.weight"], build_reference(user, 0).fc.weight.detach())


def test_custom_op_without_a_sharding_rule_is_refused_located(tmp_path):
    """Untagged, parc knows nothing of how the op treats its input's columns: refused at the plan's rule, naming
    the op and the module it runs in."""
    path = tmp_path / "model.py"
    path.write_text(CUSTOM_OP_TP.format(tag="opaque", tags="()"))
    with pytest.raises(ParcError) as err:
        compile_text(TP_PLAN, tmp_path / "c", model=path)
    message = str(err.value)
    assert "ste_tp_opaque" in message and "no sharding rule" in message, message
    assert err.value.diagnostics[0].span.line == 5  # "fc" : column, the rule that shards its input
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("body, backward, words", [
    ("torch.softmax(x, dim=-1)", "lambda ctx, grad: grad", "its forward on chunk 0 of 2"),  # over the sharded dim
    ("torch.round(x * 4) / 4", "lambda ctx, grad: grad.flip(-1)", "its backward on chunk 0 of 2"),  # mixes elements
    ("x + torch.arange(32, dtype=x.dtype)", "lambda ctx, grad: grad", "it fails on chunk 0 of 2"),  # whole width only
])
def test_a_wrong_pointwise_tag_is_refused_at_the_rule(tmp_path, body, backward, words):
    """The tag is the author's word; parc checks it on the cut it makes, forward and backward, where the op has
    a CPU kernel: an op that is not elementwise along the sharded dim would train silently wrong under tp."""
    source = CUSTOM_OP_TP.format(tag="wrong", tags="(torch.Tag.pointwise,)")
    source = source.replace("return torch.round(x * 4) / 4", f"return {body}")
    source = source.replace("round_ste.register_autograd(lambda ctx, grad: grad)",
                            f"round_ste.register_autograd({backward})")
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(ParcError) as err:
        compile_text(TP_PLAN, tmp_path / "c", model=path)
    message = str(err.value)
    assert "tagged `torch.Tag.pointwise`, but " + words in message, message
    assert err.value.diagnostics[0].span.line == 5  # "fc" : column, the rule that shards its input


def test_a_pointwise_op_without_a_cpu_kernel_is_trusted(tmp_path):
    """A CUDA-only op cannot run on the compiling machine: its tag is taken at its word, as before the check
    (here a softmax, which the check would refuse had it a CPU kernel to run)."""
    source = CUSTOM_OP_TP.format(tag="cuda_only", tags="(torch.Tag.pointwise,)")
    source = source.replace("return torch.round(x * 4) / 4", "return torch.softmax(x, dim=-1)")
    source = source.replace("mutates_args=(), tags=", "mutates_args=(), device_types=\"cuda\", tags=")
    path = tmp_path / "model.py"
    path.write_text(source)
    art = compile_text(TP_PLAN, tmp_path / "c", model=path)
    assert "torch.ops.parc_tests.ste_tp_cuda_only.default" in (art.root / "programs" / "stage0_tp0.py").read_text()


NO_AUTOGRAD = """\
import torch
import torch.nn as nn


@torch.library.custom_op("parc_tests::square_no_grad", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@square.register_fake
def _(x):
    return torch.empty_like(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return square(self.fc(x)).mean()


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 4),)


def loss_fn(model, x):
    return model(x)
"""

FORWARD_BACKWARD = HOOKS.replace("{build}", "pass")


@pytest.mark.parametrize("source, where, words", [
    (NO_AUTOGRAD, (21, 16), "custom op `parc_tests::square_no_grad` has no registered autograd"),
    (FORWARD_BACKWARD.replace("{forward}", "g, = torch.autograd.grad(h.sum(), h, retain_graph=True); h = h + g"),
     (12, 14), "`torch.autograd.grad(..., create_graph=False)` in forward"),
    (FORWARD_BACKWARD.replace("{forward}", "h.sum().backward(retain_graph=True)"), (12, 9), "`backward()` in forward"),
    (FORWARD_BACKWARD.replace("{forward}", "h = torch.utils.checkpoint.checkpoint(torch.tanh, h, use_reentrant=True)"),
     (12, 13), "use_reentrant=True"),
    (FORWARD_BACKWARD.replace("{forward}", "h = h * h.data.abs().mean()"), (12, 17), "`.data` of a tensor that"),
])
def test_traced_backward_that_differs_is_refused_at_the_call(tmp_path, source, where, words):
    """Each of these traces, but its program would train differently from eager (or fail at the first
    backward): refused where the user's code calls it."""
    path = tmp_path / "model.py"
    path.write_text(source)
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), micro_batch=2)
    span = err.value.span
    assert (Path(span.file).resolve(), span.line, span.col) == (path.resolve(), *where), str(err.value)
    assert words in err.value.message


@pytest.mark.parametrize("forward", [
    "h = torch.utils.checkpoint.checkpoint(torch.tanh, h, use_reentrant=False)",
    "g, = torch.autograd.grad(h.pow(2).sum(), h, create_graph=True); h = h + g",
    "h.retain_grad()",
    "with torch.no_grad():\n            with torch.enable_grad():\n                s = torch.tanh(h)\n        h = h + s",
    "s = torch.tanh(x); s.requires_grad_(True); h = h * s",
    "s = h * 2; s.detach_(); h = h + s",
    "h = h.reshape(h.data.shape[0], -1)",  # `.data` for its shape only traces
])
def test_what_export_keeps_traces_and_matches_eager(tmp_path, forward):
    """What export traces with eager's backward is let through; the gradient probe confirms each."""
    path = tmp_path / "model.py"
    path.write_text(FORWARD_BACKWARD.replace("{forward}", forward))
    user = load_user_module(path)
    assert probe(user, trace(user, micro_batch=2), micro_batch=2) is None
