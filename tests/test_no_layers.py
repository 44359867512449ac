"""A model without a repeated block list (num_layers 0) compiles and trains at pp 1: only a pipeline placing its
stages automatically needs layers (grammar/validate.py `_check_pipeline`; once refused as "mesh pp 1 > 0 layers")."""

from __future__ import annotations

from helpers import compile_text, parallel_vs_serial
from parc.cli import main

MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):  # two linears, no ModuleList: num_layers is 0
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))  # (B, 4)


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)
'''


def test_a_model_without_layers_trains_at_pp1(tmp_path, capsys):
    model = tmp_path / "net.py"
    model.write_text(MODEL)
    plan = "mesh dp=2\nbatch global=8 micro=2\noptimizer adamw lr=1e-2\n"
    (tmp_path / "p.par").write_text(plan)
    assert main(["check", str(tmp_path / "p.par"), "--model", str(model)]) == 0, capsys.readouterr().err
    art = compile_text(plan, tmp_path / "c", model)
    assert art.plan["model"]["num_layers"] == 0
    verdict = parallel_vs_serial(art.root, steps=2)  # tolerance: runtime/verify.py's fp32 default (1e-4)
    assert verdict.ok, verdict.render()
    (tmp_path / "pp.par").write_text("mesh pp=2\nbatch global=8 micro=2\n")
    assert main(["check", str(tmp_path / "pp.par"), "--model", str(model)]) == 2
    assert "placing the stages needs repeated layers" in capsys.readouterr().err
