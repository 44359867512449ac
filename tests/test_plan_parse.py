"""The plan language's happy path: examples parse, print canonically, and round-trip.

Start at `test_golden_round_trip`: each example in examples/ must print exactly as
tests/golden/<name>.par, and parsing that text must give back an equal Plan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from parc.errors import Span
from parc.grammar.parser import load_plan, parse
from parc.grammar.plan import Batch, Cut, Mesh, Pipeline, Plan, TPRule
from parc.grammar.printer import format_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["dp", "3d", "tp", "pp", "zero"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_golden_round_trip(name):
    plan = load_plan(ROOT / "examples" / f"{name}.par")
    text = format_plan(plan)
    assert text == (ROOT / "tests" / "golden" / f"{name}.par").read_text()
    again = parse(text)
    assert again == plan
    assert format_plan(again) == text  # the canonical form is a fixed point


def test_3d_plan_means_what_it_says():
    plan = load_plan(ROOT / "examples" / "3d.par")
    assert plan.mesh == Mesh(dp=2, pp=2, tp=2, order=("tp", "pp", "dp"))
    assert plan.world_size == 8
    assert plan.batch == Batch(32, 2) and plan.accumulation == 8  # 32 / (2 × dp 2)
    assert plan.topology.intra_bw == 900e9 and plan.topology.inter_bw == 50e9
    assert plan.tensor_parallel.rules[0] == TPRule("blocks.*.attn.qkv", "column")
    assert plan.tensor_parallel.sequence_parallel
    assert plan.pipeline == Pipeline("1f1b", stages=None, virtual=1, cuts=None)
    assert plan.zero.stage == 1 and plan.recompute.patterns == ("blocks.*",)
    assert plan.optimizer.betas == (0.9, 0.95) and plan.optimizer.grad_clip == 1.0


def test_every_node_has_its_span():
    plan = load_plan(ROOT / "examples" / "3d.par")
    file = str(ROOT / "examples" / "3d.par")
    assert plan.mesh.span == Span(file, 2, 1, 2, 35)
    assert plan.tensor_parallel.span.line == 7 and plan.tensor_parallel.span.end_line == 16
    assert plan.tensor_parallel.rules[1].span.line == 9 and plan.tensor_parallel.rules[1].span.col == 5
    assert plan.spans["batch.global"] == Span(file, 5, 14, 5, 16)
    assert plan.spans["precision"] == Span(file, 21, 11, 21, 15)  # the name, not the keyword
    for node in (plan.topology, plan.batch, plan.pipeline, plan.zero, plan.recompute, plan.optimizer):
        assert node.span is not None and node.span.file == file


def test_a_single_mesh_line_is_a_plan_with_defaults():
    plan = parse("mesh dp=2")
    assert plan == Plan(mesh=Mesh(dp=2))
    assert plan.pipeline is None and plan.batch is None and plan.precision == "fp32"


def test_pipeline_cuts_stages_and_virtual():
    plan = parse('mesh pp=2\npipeline schedule=gpipe { cut before "blocks.2" }\n')
    assert plan.pipeline.cuts == (Cut("blocks.2", "before"),) and plan.pipeline.stages is None
    plan = parse("mesh pp=2\npipeline schedule=interleaved_1f1b virtual=2 stages=4\n")
    assert plan.pipeline.virtual == 2 and plan.pipeline.stages == 4 and plan.pipeline.cuts is None
    assert parse("mesh\npipeline { }\n").pipeline.cuts == ()  # explicit: one stage, no cut


def test_precision_reduce_round_trips():
    plan = parse("mesh dp=2\nprecision bf16 reduce=bf16\n")
    assert (plan.precision, plan.grad_reduce) == ("bf16", "bf16")
    assert "precision bf16 reduce=bf16" in format_plan(plan) and parse(format_plan(plan)) == plan
    assert "reduce" not in format_plan(parse("mesh dp=2\nprecision bf16 reduce=fp32\n"))  # the default


def test_precision_accumulate_round_trips():
    plan = parse("mesh dp=2\nzero stage=2\nprecision bf16 reduce=bf16 accumulate=bf16\n")
    assert plan.grad_accumulate == "bf16"
    assert "precision bf16 reduce=bf16 accumulate=bf16" in format_plan(plan) and parse(format_plan(plan)) == plan
    assert "accumulate" not in format_plan(parse("mesh dp=2\nprecision bf16 accumulate=fp32\n"))  # the default


def test_bandwidth_units_are_decimal_and_bits_are_eighths():
    plan = parse("mesh\ntopology intra=1.5TB/s inter=400Gbit/s nodes=2 gpus_per_node=4\n")
    assert plan.topology.intra_bw == 1.5e12 and plan.topology.inter_bw == 50e9
    assert "intra=1500GB/s inter=50GB/s" in format_plan(plan)


def test_comments_blank_lines_crlf_and_no_final_newline():
    text = "# a plan\r\n\r\nmesh dp=2   # two ranks\r\n  # indented comment\r\nzero stage=1"
    assert parse(text) == Plan(mesh=Mesh(dp=2), zero=parse("mesh dp=2\nzero stage=1").zero)


def test_nothing_from_lark_escapes():
    plan = load_plan(ROOT / "examples" / "3d.par")

    def walk(x):
        assert not type(x).__module__.startswith("lark"), x
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, str):
            assert type(x) is str

    walk(plan)
