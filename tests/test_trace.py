"""Tests for parc.trace: model files → exported loss graphs on meta, and the errors users see."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from parc.errors import TraceError
from parc.trace import load_user_module, trace
from parc.traced import module_path, normalize_path, num_layers, repeated_blocks, state_values

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
LLAMA = ROOT / "tests" / "models" / "llama_tiny.py"


@pytest.fixture(scope="module")
def gpt():
    user = load_user_module(GPT)
    return user, trace(user, micro_batch=2)


@pytest.fixture(scope="module")
def llama():
    user = load_user_module(LLAMA)
    return user, trace(user, micro_batch=2)


def _real_loss_and_graph_loss(user, traced, micro_batch=2):
    torch.manual_seed(0)
    model = user.build_model().train()
    batch = user.get_batch(3, micro_batch)
    ref = user.loss_fn(model, *batch)
    (out,) = traced.gm(*state_values(traced, model), *batch)
    return ref, out


def test_gpt_state_fqns_are_the_models_parameter_names(gpt):
    user, traced = gpt
    with torch.device("meta"):
        names = [n for n, _ in user.build_model().named_parameters()]
    assert [s.fqn for s in traced.state if s.kind == "param"] == names
    assert all(s.requires_grad for s in traced.state if s.kind == "param")
    qkv = next(s for s in traced.state if s.fqn == "blocks.0.attn.qkv.weight")
    assert (qkv.shape, qkv.dtype) == ((3 * 64, 64), "float32")
    assert traced.param_count == sum(p.numel() for p in user.build_model().parameters())


def test_gpt_graph_inputs_output_and_module_paths(gpt):
    _, traced = gpt
    placeholders = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    assert placeholders == [s.name for s in traced.state] + [i.name for i in traced.inputs]
    assert [(i.shape, i.dtype) for i in traced.inputs] == [((2, 32), "int64")] * 2
    out = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    assert len(out) == 1 and out[0].meta["val"].shape == ()
    known = set(traced.module_paths) | {""}  # '' is the root: embedding sums, the loss itself
    for node in traced.gm.graph.nodes:
        if node.op == "call_function":
            assert node.meta.get("nn_module_stack"), node.name
            assert module_path(node) in known, (node.name, module_path(node))
    qkv = [n for n in traced.gm.graph.nodes
           if n.target == torch.ops.aten.linear.default and module_path(n) == "blocks.0.attn.qkv"]
    assert len(qkv) == 1
    weight = qkv[0].args[1]
    assert weight.op == "placeholder" and module_path(weight) == "blocks.0.attn.qkv"
    assert "wte" in traced.module_paths and "blocks.3.mlp.proj" in traced.module_paths
    assert traced.num_layers == 4


def test_gpt_graph_loss_equals_eager_loss(gpt):
    # Exact: the graph runs the same aten kernels on the same CPU tensors in the same order.
    ref, out = _real_loss_and_graph_loss(*gpt)
    assert torch.equal(out, ref), (out.item(), ref.item())


def test_tiny_llama_traces_with_hf_module_names(llama):
    user, traced = llama
    paths = {module_path(n) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= paths
    buffers = {s.fqn: s for s in traced.state if s.kind == "buffer"}
    assert "model.rotary_emb.inv_freq" in buffers  # non-persistent: recovered by attribute, not state_dict
    assert traced.num_layers == 2
    ref, out = _real_loss_and_graph_loss(*llama)
    assert torch.equal(out, ref), (out.item(), ref.item())  # exact, as for GPT


DATA_DEPENDENT = """\
import torch
import torch.nn as nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            return h
        return -h


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Gate(), Gate()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(step)),)


def loss_fn(model, x):
    return model(x).mean()
"""


def test_data_dependent_control_flow_names_module_and_line(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(DATA_DEPENDENT)
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), micro_batch=2)
    span = err.value.span
    assert (Path(span.file), span.line, span.col) == (path.resolve(), 12, 12)  # `if h.sum() > 0:`
    assert "module `blocks.0`" in err.value.message
    text = str(err.value)
    assert "if h.sum() > 0:" in text and "torch.where" in text


def test_data_dependent_control_flow_in_a_library_is_located_in_the_library(tmp_path):
    """A model file that imports its model from a library (as the zoo's files import transformers families) has no
    frame of its own when the library's forward fails: the error points at the failing module's line in the
    library, not at the model file's 1:1."""
    lib, tail = DATA_DEPENDENT.split("def build_model")
    (tmp_path / "gate_lib.py").write_text(lib)
    path = tmp_path / "model.py"
    path.write_text("import sys\nfrom pathlib import Path\nsys.path.insert(0, str(Path(__file__).parent))\n"
                    "import torch\nfrom gate_lib import Net\n\n\ndef build_model" + tail)
    with pytest.raises(TraceError) as err:
        trace(load_user_module(path), micro_batch=2)
    span = err.value.span
    assert (Path(span.file).resolve(), span.line, span.col) == ((tmp_path / "gate_lib.py").resolve(), 12, 12)
    assert "module `blocks.0`" in err.value.message


def test_a_failed_trace_prints_parcs_error_alone_unless_debug(tmp_path, capsys):
    """torch printed the failing region's FX graph once per export attempt above parc's located error
    (issue 29: 98 lines); it is shown with --debug only."""
    path = tmp_path / "model.py"
    path.write_text(DATA_DEPENDENT)
    for debug in (False, True):
        with pytest.raises(TraceError):
            trace(load_user_module(path), micro_batch=2, debug=debug)
        printed = capsys.readouterr()
        assert ("def forward(" in printed.err + printed.out) == debug, printed


def test_missing_function_points_at_file_with_signature(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent("""\
        import torch
        def build_model():
            return torch.nn.Linear(2, 2)
        def loss_fn(model, x):
            return model(x).mean()
    """))
    with pytest.raises(TraceError) as err:
        load_user_module(path)
    assert "`get_batch` is missing" in err.value.message
    assert err.value.span.file == str(path.resolve()) and err.value.span.line == 1
    assert "def get_batch(step: int, batch_size: int)" in str(err.value)


def test_batch_dim0_must_equal_batch_size(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(DATA_DEPENDENT.replace("torch.randn(batch_size, 4", "torch.randn(3, 4"))
    with pytest.raises(TraceError, match=r"dim 0 = 3 ≠ batch_size 2"):
        trace(load_user_module(path), micro_batch=2)


def test_num_layers_is_longest_repeated_block_list():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2))
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(5))
            self.heads = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))

    assert num_layers(Net()) == 5
    assert repeated_blocks(Net()) == ("blocks", 5)  # stem is longer than heads but mixes classes
    assert num_layers(torch.nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("raw, fqn", [
    ("model.blocks.0.attn.qkv", "blocks.0.attn.qkv"),
    ("L['self'].model.blocks[0].attn", "blocks.0.attn"),
    ("model.model.layers.1.mlp", "model.layers.1.mlp"),  # HF: only the wrapper's `model.` goes
    ("model", ""),
    ("", ""),
])
def test_normalize_path(raw, fqn):
    assert normalize_path(raw) == fqn
