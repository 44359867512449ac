"""Grad-mode regions in forward (parc/trace_regions.py): a `torch.no_grad()` block is inlined with its
outputs detached, and trains like the serial model (tests/test_tp_ops.py, HF PhiMoE's router); an
autocast block is refused at its line in the user's file, never a traceback from the code generator."""

from __future__ import annotations

import textwrap

import pytest

from helpers import compile_text
from parc.errors import ParcError

MODEL = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            REGION
            return self.fc(x * w)

    def build_model():
        return M()

    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g)

    def loss_fn(model, x, y):
        return ((model(x) - y) ** 2).mean()
''')


def _model(tmp_path, region: str):
    path = tmp_path / "model.py"
    path.write_text(MODEL.replace("REGION", region))
    return path


def test_no_grad_block_is_inlined_and_detached(tmp_path):
    model = _model(tmp_path, "with torch.no_grad():\n                w = (self.fc(x).abs() < 1).float()")
    art = compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp_path / "c", model)
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    assert "wrap_with_set_grad_enabled" not in src and "aten.detach.default(" in src


def test_autocast_block_is_refused_at_its_line(tmp_path):
    model = _model(tmp_path, "with torch.autocast('cpu', dtype=torch.bfloat16):\n"
                             "                w = self.fc(x).sigmoid()")
    with pytest.raises(ParcError) as e:
        compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp_path / "c", model)
    (d,) = e.value.diagnostics
    assert "autocast" in d.message and d.span.file.endswith("model.py")
    assert "sigmoid" in model.read_text().splitlines()[d.span.line - 1]  # the region's first op
