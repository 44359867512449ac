"""Host randomness in forward (parc/trace_host_random.py): a number drawn from Python's `random` or numpy in
forward would be one constant of the compiled program, replayed every step where eager draws anew. Compile
refuses it at the user's call, located; randomness drawn with torch, and host randomness outside forward,
compile as before."""

import pytest

from helpers import compile_text
from parc.errors import TraceError
from parc.trace import load_user_module, trace

MODEL = """\
import random

import numpy as np
import torch
import torch.nn as nn

FILE_RNG = np.random.default_rng(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.rng = random.Random(0)
        self.np_state = np.random.RandomState(0)

    def forward(self, x):
        h = self.fc(x)
        return h * {scale}


def build_model():
    random.random()  # host randomness while building is the model's business, not the program's
    return Net()


def get_batch(step, n):
    g = torch.Generator().manual_seed(step + random.randint(0, 0))
    return (torch.randn(n, 4, generator=g),)


def loss_fn(model, x):
    return model(x).pow(2).mean()
"""

DRAWS = {  # forward's scale expression -> how the refusal names the generator
    "random.random()": "Python's `random`",
    "random.choice([1.0, 2.0])": "Python's `random`",  # through random.py's wrappers: located at the user's line
    "random.gauss(1.0, 0.1)": "Python's `random`",  # a second call only empties gauss's cache: a change all the same
    "self.rng.uniform(1, 2)": "a `random.Random`",
    "np.random.rand()": "`numpy.random`",
    "float(self.np_state.normal())": "a numpy generator",
    "float(FILE_RNG.random())": "a numpy generator",  # a generator the model file holds as a global
}


def _model(tmp_path, scale: str):
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(scale=scale))
    return path


@pytest.mark.parametrize("scale", list(DRAWS))
def test_a_host_draw_in_forward_is_refused_at_its_call(tmp_path, scale):
    path = _model(tmp_path, scale)
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), 2)
    span = err.value.span
    line = MODEL.splitlines().index("        return h * {scale}") + 1
    assert (span.file, span.line, span.col) == (str(path.resolve()), line, 9)  # the line that drew
    message = err.value.message
    assert f"a draw from {DRAWS[scale]} in forward" in message and "replay this one draw" in message
    assert "torch.rand" in str(err.value)


def test_torch_randomness_in_forward_and_host_randomness_outside_it_compile(tmp_path):
    path = _model(tmp_path, "torch.rand((), device=x.device)")
    art = compile_text("mesh dp=2\nbatch global=4 micro=2\noptimizer sgd lr=0.1\n", tmp_path / "c", model=path)
    assert "torch.ops.aten.rand" in (art.root / "programs" / "stage0_tp0.py").read_text()


def test_the_refusal_reaches_compile_and_writes_nothing(tmp_path):
    path = _model(tmp_path, "random.gauss(1.0, 0.1)")
    with pytest.raises(TraceError, match="a draw from Python's `random` in forward"):
        compile_text("mesh dp=2\nbatch global=4 micro=2\noptimizer sgd lr=0.1\n", tmp_path / "c", model=path)
    assert not (tmp_path / "c").exists()
