"""The plan language's expert parallelism: `mesh ... ep=`, `expert_parallel { ... }`, the ep and
edp groups carved out of dp (parc/mesh.py), and every ep diagnostic, located and all at once."""

from __future__ import annotations

import pytest

from parc import mesh as meshlib
from parc.errors import ParcError
from parc.grammar.parser import parse
from parc.grammar.plan import Mesh
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate

EP = 'mesh dp=4 ep=2\nexpert_parallel {\n    "blocks.*.moe.experts"\n}\n'
# examples/moe.py's module paths, abridged: 4 experts in blocks 1 and 3
PATHS = ["blocks", "blocks.0", "blocks.1", "blocks.1.moe", "blocks.1.moe.router", "blocks.1.moe.experts",
         *[f"blocks.1.moe.experts.{e}" for e in range(4)], "blocks.3.moe.experts",
         *[f"blocks.3.moe.experts.{e}" for e in range(4)]]


def _errors(text: str, **facts) -> list[tuple[str, int, int]]:
    with pytest.raises(ParcError) as info:
        validate(parse(text, "t.par"), **facts)
    return [(d.message, d.span.line, d.span.col) for d in info.value.diagnostics if d.severity == "error"]


def test_round_trip_and_canonical_form():
    plan = parse(EP)
    assert plan.mesh.ep == 2 and plan.expert_parallel.patterns == ("blocks.*.moe.experts",)
    assert format_plan(plan) == 'mesh dp=4 pp=1 tp=1 ep=2\nexpert_parallel {\n    "blocks.*.moe.experts"\n}\n'
    assert parse(format_plan(plan)) == plan
    assert "ep=" not in format_plan(parse("mesh dp=4\n"))  # ep 1 is the default, not printed


def test_groups_are_carved_out_of_dp():
    # dp 4 ep 2: ep groups are runs of 2 consecutive dp ranks; edp groups take every 2nd
    assert meshlib.expert_groups(Mesh(dp=4, ep=2)) == {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]}
    # with tp 2 inner, dp ranks are 2 apart: each tp rank has its own ep and edp groups
    groups = meshlib.expert_groups(Mesh(dp=4, tp=2, ep=2))
    assert groups == {"ep": [[0, 2], [1, 3], [4, 6], [5, 7]], "edp": [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert [meshlib.ep_rank(Mesh(dp=4, tp=2, ep=2), r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert meshlib.expert_groups(Mesh(dp=2, ep=2)) == {"ep": [[0, 1]], "edp": [[0], [1]]}


def test_plan_only_mistakes_reported_together():
    errors = _errors('mesh dp=6 ep=4\nexpert_parallel { "" }\n')
    assert errors == [
        ("mesh ep 4 does not divide dp 6: ep groups are carved out of the dp group, and dp 6 / ep 4 = 1.5 is "
         "not a whole number of groups", 1, 14),
        ("empty expert_parallel pattern", 2, 19)]
    assert _errors("mesh dp=4 ep=2\n") == [
        ("mesh ep 2 but no `expert_parallel` rule names the experts to spread", 1, 14)]


def test_ep_one_with_rules_warns():
    (warning,) = validate(parse('mesh dp=2\nexpert_parallel { "blocks.*.moe.experts" }\n'))
    assert warning.severity == "warning" and "has no effect" in warning.message


def test_model_mistakes_located_at_their_glob():
    text = ('mesh dp=6 ep=3\nexpert_parallel {\n    "blocks.*.moe.experts"\n    "blocks.*.mo.experts"\n'
            '    "blocks.1.moe"\n}\n')
    errors = _errors(text, module_paths=PATHS)
    assert errors == [
        ("`blocks.1.moe.experts` holds 4 experts, not a multiple of mesh ep 3: each ep rank holds experts / ep "
         "= 4 / 3", 3, 5),
        ("`blocks.3.moe.experts` holds 4 experts, not a multiple of mesh ep 3: each ep rank holds experts / ep "
         "= 4 / 3", 3, 5),
        ('expert_parallel pattern "blocks.*.mo.experts" matches no module', 4, 5),
        ("expert_parallel pattern \"blocks.1.moe\" matches `blocks.1.moe`, which has no numbered children: parc "
         "expects the ModuleList of experts", 5, 5)]


def test_untested_compositions_refused_at_their_token():
    from parc.analysis import support

    text = ('mesh dp=4 pp=2 tp=2 ep=2\nexpert_parallel { "blocks.*.moe.experts" }\nzero stage=2\n'
            'precision bf16\noptimizer adamw clip=1.0\n')
    with pytest.raises(ParcError) as info:
        support.check(parse(text, "t.par"))
    got = [(d.message.split(":")[0], d.span.line, d.span.col) for d in info.value.diagnostics]
    assert got == [("expert parallelism (mesh ep 2) with zero stage=2", 3, 12),
                   ("expert parallelism (mesh ep 2) with precision bf16", 4, 11),
                   ("expert parallelism (mesh ep 2) with clip", 5, 22)]
    support.check(parse(EP))  # dp × ep in fp32: proven by tests/test_moe.py
    support.check(parse(EP + "zero stage=2\nprecision bf16\noptimizer adamw clip=1.0\n"))
    with pytest.raises(ParcError, match=r"mesh ep 2\) with zero stage=3: its per-layer gather"):
        support.check(parse(EP + "zero stage=3\n"))


def test_hf_mixtral_refused_at_the_rule():
    """HF Mixtral (transformers ≥ 5) fuses a layer's experts into one module's 3-D weights: no list
    of experts for the pass to spread; the refusal names the form it expected, at the glob."""
    import torch

    from parc.trace import load_user_module
    from helpers import ROOT

    user = load_user_module(ROOT / "tests" / "models" / "mixtral_tiny.py")
    with torch.device("meta"):
        paths = [n for n, _ in user.build_model().named_modules() if n]
    text = 'mesh dp=2 ep=2\nexpert_parallel {\n    "model.layers.*.mlp.experts"\n}\n'
    with pytest.raises(ParcError) as info:
        validate(parse(text, "t.par"), module_paths=paths)
    (first, second) = info.value.diagnostics
    assert (first.span.line, first.span.col) == (3, 5)
    assert first.message.endswith("matches `model.layers.0.mlp.experts`, which has no numbered children: parc "
                                  "expects the ModuleList of experts")
    assert "Mixtral" in first.hint and "layers.1" in second.message


BAD_MOE = '''"""Experts that each read all the tokens and are summed: not the dispatch form passes/expert_parallel.py spreads."""
import torch
import torch.nn as nn


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        return sum(expert(x) for expert in self.experts)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Dense() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def build_model():
    return Net()


def get_batch(step, batch_size):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(step)),)


def loss_fn(model, x):
    return model(x).square().mean()
'''


def test_pass_refuses_another_form_at_the_rule(tmp_path):
    from parc.compiler import compile_model

    model = tmp_path / "bad_moe.py"
    model.write_text(BAD_MOE)
    text = 'mesh dp=2 ep=2\nbatch global=4 micro=2\nexpert_parallel {\n    "blocks.*.experts"\n}\n'
    with pytest.raises(ParcError) as info:
        compile_model(model, parse(text, "t.par"), tmp_path / "out")
    (d,) = info.value.diagnostics
    assert (d.span.line, d.span.col) == (4, 5)
    assert d.message.startswith("expert_parallel: `blocks.0.experts` is not in the form parc spreads over ep: "
                                "expert 0's input is")
    assert "not X[0] (select dim 0 index 0) of the dispatched tokens" in d.message
    assert "torch.stack" in d.hint
    assert not (tmp_path / "out").exists()


def test_pass_is_a_no_op_without_ep():
    import torch
    import torch.fx as fx

    from parc.passes import PassCtx, expert_parallel

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    before = gm.code
    for text in ("mesh dp=2\n", 'mesh dp=2\nexpert_parallel { "blocks.*.moe.experts" }\n'):  # ep 1
        ctx = PassCtx(traced=None)
        assert expert_parallel.run(gm, parse(text), ctx) is gm and gm.code == before and not ctx.rewrites
