"""Tensors made in forward or held outside parameters and buffers (parc/trace_constants.py): each one's
value reaches every rank, so tests/models/const_tiny.py trains under dp and tp exactly like the serial model;
a data constant too large to carry in plan.json is refused where it is made."""

import textwrap
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compile_text, parallel_vs_serial
from parc.cli import parser
from parc.compiler import pass_errors
from parc.errors import TraceError
from parc.grammar.parser import parse
from parc.passes import pipeline_split
from parc.trace import load_user_module, trace
from parc.trace_constants import MAX_CARRIED_ELEMENTS
from parc.traced import state_values

CONST = ROOT / "tests" / "models" / "const_tiny.py"
INDEX = ROOT / "tests" / "models" / "index_tiny.py"

# fp32, SGD. dp: the same sums in another order (mean of micro-batch means), ~1e-7 relative; tp: the row
# projections' partial sums are all-reduced, again a reordering. Either stays far below 1e-5; a constant with
# the wrong value on a rank (zeros, block 1's table on block 2) moves the loss by 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5


@pytest.fixture(scope="module")
def const():
    user = load_user_module(CONST)
    return user, trace(user, micro_batch=2)


def test_every_constant_has_a_source(const):
    user, traced = const
    constants = {s.fqn for s in traced.state if s.kind == "constant"}
    # attributes: read from each rank's own build, by the path that holds the tensor
    assert {"out_scale", "blocks.0.tables.0", "blocks.2.tables.0", "blocks.1.freqs.gain"} <= constants
    # made in forward from data: real CPU values, carried in plan.json
    carried = traced.constants
    assert len(carried) == 1 + 3  # new_tensor in the root, torch.tensor in each block
    assert all(v.device.type == "cpu" for v in carried.values())
    assert any(v.tolist() == user.module.FEATURE_SCALE for v in carried.values())
    # made from shapes (mask, positions): ops of the graph, not constants
    assert not any(s.shape == (6, 6) for s in traced.state if s.kind == "constant")
    # exact: the graph runs the same CPU kernels as eager, on the real constants
    torch.manual_seed(0)
    model = user.build_model().train()
    batch = user.get_batch(3, 2)
    (out,) = traced.gm(*state_values(traced, model), *batch)
    assert torch.equal(out, user.loss_fn(model, *batch))
    plan = parse("mesh dp=2\nbatch global=4 micro=2\n", file="t.par")
    pipeline_split.assign_stages(traced, plan, 1)
    assert pass_errors(traced, plan) == []  # what `parc check --model` runs


@pytest.mark.parametrize("model, carried", [(CONST, 4), (INDEX, 7)], ids=["const", "index"])
@pytest.mark.parametrize("mesh, rules", [
    ("dp=2", ""),
    ("tp=2", 'tensor_parallel {\n    "blocks.*.fc" : column\n    "blocks.*.proj" : row\n}\n'),
])
def test_trains_equal_to_serial(tmp_path, mesh, rules, model, carried):
    dp = 2 if "dp" in mesh else 1
    plan = f"mesh {mesh}\nbatch global={2 * dp} micro=2\n{rules}optimizer sgd lr=0.1\n"
    art = compile_text(plan, tmp_path / "c", model=model)
    entries = art.plan["programs"]["stage0_tp0"]["state"]
    # the forward-made data constants travel in plan.json: const_tiny's new_tensor and one torch.tensor per block;
    # index_tiny's [-2], [-1] and PERM in each of its two blocks, and KEEP
    assert sum("value" in e for e in entries) == carried
    verdict = parallel_vs_serial(art.root, steps=3)
    assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]


BIG = f"""\
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        table = torch.tensor([[0.5] * 8] * {MAX_CARRIED_ELEMENTS // 8 + 1}, device=x.device)
        return (self.fc(x) @ table.T).mean()


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 8),)


def loss_fn(model, x):
    return model(x)
"""


def test_too_large_data_constant_is_refused_where_it_is_made(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(BIG)
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), micro_batch=2)
    span = err.value.span
    assert (Path(span.file).resolve(), span.line) == (path.resolve(), 11)  # table = torch.tensor(...)
    assert f"{(MAX_CARRIED_ELEMENTS // 8 + 1) * 8} elements > {MAX_CARRIED_ELEMENTS}" in err.value.message
    assert "register_buffer" in str(err.value)
    assert f"--max-carried-constant {(MAX_CARRIED_ELEMENTS // 8 + 1) * 8}" in str(err.value)


INDEXING = """\
import numpy as np
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)  # (B, 8)
        {line}
        return out.pow(2).sum()


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(step)),)


def loss_fn(model, x):
    return model(x)
"""


@pytest.mark.parametrize("line, dtypes", [
    ("out = h[..., [-2]]", ["int64"]),
    ("out = h[:, [0, 3, 5]]", ["int64"]),
    ("out = h[[1, 0]]", ["int64"]),
    ("out = h[:, range(3)]", ["int64"]),
    ("out = h[:, (1, 2)]", ["int64"]),
    ("out = h[:, [True, False] * 4]", ["int64"]),  # a mask: its positions, so the shape stays concrete
    ("out = h[([[True] * 8, [False, True] * 4],)]", ["int64", "int64"]),  # a 2-d mask: one tensor per dim
    ("out = h[[[0], [1]], [[0, 1]]]", ["int64", "int64"]),  # broadcast advanced indices
    ("out = h[[slice(None), [1, 2]]]", ["int64"]),  # a short list holding a slice: NumPy's legacy tuple
    ("out = h[:, list(range(8)) * 5]", ["int64"]),  # 40 ≥ 32 entries: one index, not a tuple
    ("out = h.clone(); out[:, [0, 2]] = 0.5", ["int64"]),  # __setitem__
    ("out = h[:, np.array([0, 2])]", ["int64"]),  # numpy: made on CPU by torch itself
])
def test_list_indexing_keeps_its_value(tmp_path, line, dtypes):
    """Every way Python data reaches an index tensor: the constant is real (CPU) and the traced graph computes
    exactly what eager does (the same CPU kernels on the same values, so bit for bit)."""
    path = tmp_path / "model.py"
    path.write_text(INDEXING.format(line=line))
    user = load_user_module(path)
    traced = trace(user, micro_batch=2)
    assert [str(v.dtype).removeprefix("torch.") for v in traced.constants.values()] == dtypes
    assert all(isinstance(d, int) for n in traced.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               for d in n.meta["val"].shape)  # no symbolic size: the passes and the cost model need numbers
    assert all(v.device.type == "cpu" for v in traced.constants.values())
    torch.manual_seed(0)
    model = user.build_model().train()
    batch = user.get_batch(3, 2)
    (out,) = traced.gm(*state_values(traced, model), *batch)
    assert torch.equal(out, user.loss_fn(model, *batch))


def test_large_data_constant_carried_with_the_option(tmp_path):
    """`parc compile --max-carried-constant N`, the way out for a library's forward: the constant travels in
    plan.json and the program computes what eager does."""
    path = tmp_path / "model.py"
    path.write_text(BIG)
    n = (MAX_CARRIED_ELEMENTS // 8 + 1) * 8
    user = load_user_module(path)
    traced = trace(user, micro_batch=2, max_carried=n)
    (value,) = traced.constants.values()
    assert value.numel() == n and value.device.type == "cpu"
    torch.manual_seed(0)
    model = user.build_model().train()
    batch = user.get_batch(0, 2)
    (out,) = traced.gm(*state_values(traced, model), *batch)
    assert torch.equal(out, user.loss_fn(model, *batch))
    assert parser().parse_args(["compile", "m.py", "--plan", "p.par"]).max_carried_constant == MAX_CARRIED_ELEMENTS
    args = parser().parse_args(["compile", "m.py", "--plan", "p.par", "--max-carried-constant", str(n)])
    assert args.max_carried_constant == n and args.grad_probe  # the probe is on unless --no-grad-probe
