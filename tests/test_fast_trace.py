"""Tests for parc.replicate: a 2-block export with the rest replicated equals the full export.

"Equals" means what the passes and the runtime can see: the same state (names,
FQNs, kinds, shapes, order), the same nodes (names, op targets, module paths),
the same generated code, and bitwise the same loss on the same real weights.
Models where replication does not apply must fall back to the full export.
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch

from parc.trace import load_user_module, trace
from parc.traced import module_path, state_values

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"  # 4 blocks by default
LLAMA4 = ROOT / "tests" / "models" / "llama_tiny4.py"
LLAMA2 = ROOT / "tests" / "models" / "llama_tiny.py"

_HEADER = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g))

def loss_fn(model, x, y):
    return F.mse_loss(model(x), y)
'''

# Blocks in an nn.Sequential, each with a persistent and a non-persistent buffer: state
# order is params of every block, then buffers of every block.
SEQUENTIAL = _HEADER + '''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("shift", torch.full((8,), 0.1), persistent=False)

    def forward(self, x):
        return x + torch.tanh(self.fc(x)) * self.scale + self.shift

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.Sequential(*[Block() for _ in range(5)])
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))

def build_model():
    return Net()
'''

NO_BLOCKS = _HEADER + '''
def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
'''

# Block i doubles its output when i is odd: blocks 0 and 1 run different ops.
ODD_BLOCKS_DIFFER = _HEADER + '''
class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.fc, self.odd = nn.Linear(8, 8), i % 2 == 1

    def forward(self, x):
        y = x + self.fc(x)
        return y * 2 if self.odd else y

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build_model():
    return Net()
'''

# Only block 3 differs (a sliding-window-style layer every few blocks): blocks 0 and 1
# agree, so only the per-block configuration shows that block 3 runs other code.
THIRD_BLOCK_DIFFERS = _HEADER + '''
class Block(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.fc, self.window = nn.Linear(8, 8), 2 if i == 3 else None

    def forward(self, x):
        y = self.fc(x)
        if self.window is not None:
            y = y[:, : self.window].repeat(1, 8 // self.window)
        return x + y

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(5))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build_model():
    return Net()
'''

# The head reads the first block's output: data skips from block 0 past the others.
SKIP_FROM_FIRST = _HEADER + '''
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        outs = []
        for b in self.blocks:
            x = b(x)
            outs.append(x)
        return outs[0] + outs[-1]

def build_model():
    return Net()
'''

# Block 0's value v is carried to every later block (a "value residual"): block 1 reads
# a block-0 value where block 0 read its own, so block 2 would read block 0's, not block 1's.
VALUE_RESIDUAL = _HEADER + '''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.v = nn.Linear(8, 8)

    def forward(self, x, v0):
        v = self.v(x)
        v0 = v if v0 is None else v0
        return x + v * v0, v0

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        v0 = None
        for b in self.blocks:
            x, v0 = b(x, v0)
        return x

def build_model():
    return Net()
'''

# Every block reads the first block's input (a "value residual"), not only the previous block.
READS_EMBEDDING = _HEADER + '''
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, x0):
        return x + self.fc(x) * x0

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        x0 = x
        for b in self.blocks:
            x = b(x, x0)
        return x

def build_model():
    return Net()
'''


def _model_file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def _both(path: Path, micro_batch: int = 2):
    user = load_user_module(path)
    return user, trace(user, micro_batch), trace(user, micro_batch, fast=False)


def _assert_same_graph(user, fast, full, micro_batch: int = 2):
    assert fast.state == full.state  # names, fqns, kinds, shapes, dtypes, requires_grad, order
    assert fast.inputs == full.inputs
    nodes_fast, nodes_full = list(fast.gm.graph.nodes), list(full.gm.graph.nodes)
    assert len(nodes_fast) == len(nodes_full)
    assert [n.target for n in nodes_fast] == [n.target for n in nodes_full]
    assert [n.name for n in nodes_fast] == [n.name for n in nodes_full]
    assert [module_path(n) for n in nodes_fast] == [module_path(n) for n in nodes_full]
    placeholders = [n.name for n in nodes_fast if n.op == "placeholder"]
    assert placeholders == [s.name for s in fast.state] + [i.name for i in fast.inputs]
    for a, b in zip(nodes_fast, nodes_full):
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (va.shape, va.dtype, va.device) == (vb.shape, vb.dtype, vb.device), a.name
    assert fast.gm.code == full.gm.code
    assert (fast.module_paths, fast.num_layers, fast.param_count) == \
        (full.module_paths, full.num_layers, full.param_count)
    assert fast.constants.keys() == full.constants.keys()

    torch.manual_seed(0)
    model = user.build_model().train()
    batch = user.get_batch(3, micro_batch)
    (loss_fast,) = fast.gm(*state_values(fast, model), *batch)
    (loss_full,) = full.gm(*state_values(full, model), *batch)
    # Bitwise: the same aten ops on the same tensors in the same order.
    assert torch.equal(loss_fast, loss_full), (loss_fast.item(), loss_full.item())
    assert torch.equal(loss_full, user.loss_fn(model, *batch))


@pytest.mark.parametrize("path", [GPT, LLAMA4], ids=["gpt4", "llama4"])
def test_replicated_graph_equals_full_export(path):
    user, fast, full = _both(path)
    assert fast.program is None and full.program is not None  # the fast path did replicate
    assert fast.num_layers == 4
    _assert_same_graph(user, fast, full)


def test_sequential_blocks_with_buffers(tmp_path):
    user, fast, full = _both(_model_file(tmp_path, "seq", SEQUENTIAL))
    assert fast.program is None
    assert [s.fqn for s in fast.state if s.kind == "buffer"] == \
        [f"blocks.{i}.{b}" for i in range(5) for b in ("scale", "shift")]
    _assert_same_graph(user, fast, full)


@pytest.mark.parametrize("name, text, why", [
    ("no_blocks", NO_BLOCKS, "0 repeated blocks"),
    ("odd_blocks_differ", ODD_BLOCKS_DIFFER, "block 2.odd = False but block 1 has True"),
    ("third_block_differs", THIRD_BLOCK_DIFFERS, "block 3.window = 2 but block 1 has None"),
    ("skip_from_first", SKIP_FROM_FIRST, "after the blocks reads block 0"),
    ("value_residual", VALUE_RESIDUAL, "does not line up with block 0"),
], ids=["no-blocks", "blocks-differ", "third-block-differs", "skip-from-first-block", "value-residual"])
def test_falls_back_to_full_export(tmp_path, caplog, name, text, why):
    with caplog.at_level(logging.DEBUG, logger="parc.trace"):
        user, fast, full = _both(_model_file(tmp_path, name, text))
    assert why in caplog.text
    assert fast.program is not None  # the full export ran
    _assert_same_graph(user, fast, full)


def test_two_blocks_are_exported_as_they_are(caplog):
    with caplog.at_level(logging.DEBUG, logger="parc.trace"):
        user, fast, full = _both(LLAMA2)
    assert fast.program is not None
    assert "2 repeated blocks" in caplog.text
    _assert_same_graph(user, fast, full)


def test_value_shared_by_all_blocks_from_before_them(tmp_path):
    # x0 is read by every block: outside both regions, so each copy shares it.
    user, fast, full = _both(_model_file(tmp_path, "x0", READS_EMBEDDING))
    assert fast.program is None
    _assert_same_graph(user, fast, full)
