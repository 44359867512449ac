"""Divergence and bad batches under `parc.run`: a nan/inf stops the run with one line and exit 2 before it
is saved (or, with --on-nonfinite skip, the step changes nothing); a get_batch returning the wrong thing is
named, with the arithmetic, before the program runs.

The model is a linear layer whose get_batch turns bad at step 2, as chosen by an environment variable:
`loss` puts an inf in the input (loss nan), `grad` feeds zeros through a square root, so the loss stays
finite and only the gradient is nan (sqrt'(0) = inf, times 0), `rows` drops a row. Every scenario runs
`parc.run.main` on the same two spawned gloo ranks one after another (start-up is most of the time).
"""

import contextlib
import io
import os

import pytest
import torch

from helpers import compile_text
from parc.errors import ParcError
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.train import check_batch

MODEL = '''
import os
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 1)])  # parc counts layers in a ModuleList (pp ≤ layers)

    def forward(self, x):
        return self.layers[0](x)


def build_model():
    return Net()


def get_batch(step, batch_size):
    x = torch.randn(batch_size, 4, generator=torch.Generator().manual_seed(step))
    bad = os.environ.get("PARC_TEST_BAD", "") if step == 2 else ""
    if bad == "loss":
        x[0, 0] = float("inf")
    elif bad == "grad":
        x = torch.zeros(batch_size, 4)
    elif bad == "rows":
        x = x[1:]
    return (x,)


def loss_fn(model, x):
    # sqrt(|x·w|): finite at x = 0, but its gradient there is inf · 0 = nan
    return (x @ model.layers[0].weight.T).abs().sqrt().mean() + (model(x) - 1.0).square().mean()
'''
PLAN = "mesh dp=2\nbatch global=4 micro=2\noptimizer adamw lr=1e-2{clip}\n"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    (tmp / "linear.py").write_text(MODEL)
    return {name: str(compile_text(PLAN.format(clip=clip), tmp / name, model=tmp / "linear.py").root)
            for name, clip in (("clip", " clip=1.0"), ("noclip", ""))}


def _main(argv: list[str], bad: str) -> tuple[int, str]:
    from parc.run import main

    os.environ["PARC_TEST_BAD"] = bad
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
        code = main(argv)
    return code, err.getvalue()


def _scenarios(ctx, compiled: dict, tmp: str):
    out = {}
    common = ["--steps", "4", "--save-every", "1", "--metrics", f"{tmp}/m{ctx.rank}.jsonl"]
    out["loss"] = _main([compiled["clip"], *common, "--checkpoint-dir", f"{tmp}/loss"], "loss")
    out["norm"] = _main([compiled["clip"], *common, "--checkpoint-dir", f"{tmp}/norm"], "grad")
    # the norm is computed at log points only (without clip=): between them, a nan gradient under a finite
    # loss reaches the parameters, and the save refuses them
    out["state"] = _main([compiled["noclip"], *common, "--checkpoint-dir", f"{tmp}/state", "--log-every", "4"],
                         "grad")
    out["logged"] = _main([compiled["noclip"], *common, "--checkpoint-dir", f"{tmp}/logged"], "grad")
    out["rows"] = _main([compiled["clip"], *common, "--checkpoint-dir", f"{tmp}/rows"], "rows")
    # last: a run that finishes destroys the process group. Its directory holds an earlier run's step_9,
    # which --overwrite-checkpoints lets the first save replace
    out["skip"] = _main([compiled["noclip"], *common, "--checkpoint-dir", f"{tmp}/skip", "--on-nonfinite", "skip",
                         "--overwrite-checkpoints"], "grad")
    return out


@pytest.fixture(scope="module")
def runs(compiled, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    (tmp / "skip" / "step_9").mkdir(parents=True)
    (tmp / "skip" / "latest").write_text("step_9\n")
    return tmp, spawn(2, _scenarios, compiled, str(tmp))[0]


def _one_error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("case, words", [
    ("loss", "training diverged at step 2: loss inf"),  # inf in, inf out: x @ w and (y − 1)² overflow
    ("norm", "training diverged at step 2: loss "),  # a finite loss, a nan norm
    ("state", "after step 3 the parameters or optimizer state hold nan/inf; not saved"),
    ("logged", "training diverged at step 2: loss "),  # no clip=, but the norm of each logged step is checked
])
def test_nonfinite_stops_before_saving(runs, case, words):
    tmp, out = runs
    code, text = out[case]
    assert code == 2, text
    line = _one_error_line(text)
    assert words in line, line
    if case in ("norm", "logged"):
        assert "gradient norm nan" in line, line
    # steps 0 and 1 were saved; the diverged step 2 never was, and `latest` still names the good one
    assert sorted(p.name for p in (tmp / case).glob("step_*")) == ["step_1", "step_2"]
    assert checkpoint.resolve(tmp / case).name == "step_2"


def test_skip_leaves_parameters_and_optimizer_state_untouched(runs):
    tmp, out = runs
    code, text = out["skip"]
    assert code == 0, text
    assert "step 2 skipped" in text, text
    before, after = checkpoint.read(tmp / "skip" / "step_2"), checkpoint.read(tmp / "skip" / "step_3")
    kept = [k for k in before if k.startswith(("model.", "optim."))]
    assert kept and all(torch.equal(before[k], after[k]) for k in kept)  # Adam's step count included
    final = checkpoint.read(tmp / "skip" / "step_4")  # and training went on after the skip
    assert not torch.equal(final["model.layers.0.weight"], after["model.layers.0.weight"])
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())
    # --overwrite-checkpoints: the earlier run's step_9 went at the first save, and `latest` followed this run
    assert sorted(p.name for p in (tmp / "skip").glob("step_*")) == ["step_1", "step_2", "step_3", "step_4"]
    assert checkpoint.resolve(tmp / "skip").name == "step_4"


def test_get_batch_rows_named_in_the_run(runs):
    code, text = runs[1]["rows"]
    assert code == 2, text
    line = _one_error_line(text)
    assert "get_batch(2, 4): tensor 0 has 3 rows" in line and "4 = micro 2 × accumulation 1 × dp 2" in line, line


INPUTS = [{"name": "batch_0", "shape": [2, 32], "dtype": "int64"}, {"name": "batch_1", "shape": [2, 32],
                                                                  "dtype": "int64"}]
BATCH = {"global": 8, "micro": 2, "accumulation": 2}


@pytest.mark.parametrize("batch, words", [
    (torch.zeros(8, 32, dtype=torch.int64), "get_batch(5, 8) returned a Tensor; it must return a tuple"),
    ((torch.zeros(8, 32, dtype=torch.int64),) * 3, "get_batch(5, 8) returned 3 values; the program was compiled for 2"),
    ((torch.zeros(6, 32, dtype=torch.int64),) * 2,
     "tensor 0 has 6 rows (dim 0) but a step takes the global batch, 8 = micro 2 × accumulation 2 × dp 2 rows"),
    ((torch.zeros(8, 32, dtype=torch.int64), torch.zeros(8, 16, dtype=torch.int64)),
     "tensor 1 has shape (8, 16), samples of shape (16,); the program was compiled for samples of shape (32,)"),
    ((torch.zeros(8, 32), torch.zeros(8, 32, dtype=torch.int64)),
     "tensor 0 is float32; the program was compiled for int64"),
    ((torch.zeros(8, 32, dtype=torch.int64), [1, 2]), "value 1 is a list, not a tensor"),
])
def test_get_batch_checked_against_the_compiled_inputs(batch, words):
    with pytest.raises(ParcError) as e:
        check_batch(batch, INPUTS, 5, BATCH, 2)
    assert words in str(e.value), str(e.value)


def test_get_batch_as_compiled_passes():
    check_batch([torch.zeros(8, 32, dtype=torch.int64)] * 2, INPUTS, 5, BATCH, 2)
