"""Models with a size that depends on the data (parc/trace_sizes.py): tests/models/routed_rows.py routes the
tokens a gate scores above zero through one more linear, `h[keep]`, rows torch.export traces as an unbacked
size. parc compiled such a model to a traceback (GuardOnDataDependentSymNode from its memory estimate, or from the
pipeline's auto split); now dp with ZeRO-3 and a pipeline train it equal to serial, the report says how its
sizes are priced, and the plans that would need the sizes themselves (tp, cp, a cut through the routed rows)
are refused at their plan line."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from helpers import ROOT, compile_text, parallel_vs_serial
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from parc.analysis import report
from parc.errors import ParcError, TraceError
from parc.trace import load_user_module, trace
from parc.trace_sizes import bound_sizes, bounded_nodes

MODEL = ROOT / "tests" / "models" / "routed_rows.py"


def test_traced_sizes_are_bounded_by_every_token():
    traced = trace(load_user_module(MODEL), 2)
    assert bounded_nodes(traced.gm)
    for n in traced.gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert all(isinstance(s, int) for s in val.shape), n
    linears = traced.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    routed = [n for n in linears if n.meta.get("parc_bounded")]
    assert routed and all(n.meta["val"].shape == (2 * 8, 16) for n in routed)  # every token of micro 2 × T 8


@pytest.mark.parametrize("name,plan", [
    ("dp2_zero3", "mesh dp=2\nbatch global=4 micro=1\nzero stage=3\n"),
    ("pp2_auto", "mesh pp=2\nbatch global=4 micro=1\npipeline schedule=1f1b stages=auto\n"),
])
def test_trains_like_serial(tmp_path, name, plan):
    verdict = parallel_vs_serial(compile_text(plan, tmp_path / name, MODEL).root)
    assert verdict.ok, verdict.render()


@pytest.mark.parametrize("plan,line,needle", [
    ('mesh tp=2\nbatch global=4 micro=2\ntensor_parallel {\n  "blocks.*.fc" : column\n  "blocks.*.proj" : row\n}\n',
     3, "tensor parallelism needs every size known at compile time"),
    ("mesh cp=2\nbatch global=4 micro=1\n", 1, "context parallelism needs every size known at compile time"),
    ('mesh pp=2\nbatch global=4 micro=1\npipeline schedule=1f1b stages=2 { cut after "blocks.0.routed" }\n',
     3, "its size depends on the data: a pipeline sends tensors of a size known at compile time"),
])
def test_what_needs_the_sizes_is_refused_at_its_line(tmp_path, plan, line, needle):
    with pytest.raises(ParcError) as e:  # a traceback (any other exception) fails the test
        compile_text(plan, tmp_path / "c", MODEL)
    d = e.value.diagnostics[0]
    assert needle in d.message and d.span is not None and d.span.line == line, e.value.render()


def test_report_says_the_sizes_are_upper_bounds(tmp_path):
    plan = tmp_path / "dp.par"
    plan.write_text("mesh dp=2\nbatch global=4 micro=1\n")
    out = report.build(model=MODEL, plan=plan)
    assert any("depend on the data" in n and "upper bounds" in n for n in out["notes"]), out["notes"]


def _graph_of(size) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(size, 4)
    g.output(x)
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_size_is_bounded_by_its_range_and_refused_without_one():
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        bounded, unbounded = env.create_unbacked_symint(), env.create_unbacked_symint()
        torch._check(bounded >= 0)
        torch._check(bounded <= 10)
        torch._check(unbounded >= 0)
        gm = _graph_of(bounded)
        assert bound_sizes(gm) == ["x"] and gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape == (10, 4)
        with pytest.raises(TraceError, match="depends on the data and has no upper bound"):
            bound_sizes(_graph_of(unbounded))
