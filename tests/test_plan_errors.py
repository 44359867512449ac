"""One test per diagnostic of the plan language: the message (with its arithmetic),
the line and the column of the token it points at.

Start at `_errors`: it parses (and, given launch or model facts, validates) a plan
and returns (message, line, col) of every error, in file order.
"""

from __future__ import annotations

import pytest

from parc.errors import ParcError, PlanError, PlanSyntaxError
from parc.grammar.parser import parse
from parc.grammar.validate import validate


def _errors(text: str, **facts) -> list[tuple[str, int, int]]:
    with pytest.raises(ParcError) as info:
        plan = parse(text, "t.par")
        validate(plan, **facts)
    return [(d.message, d.span.line, d.span.col) for d in info.value.diagnostics]


def _only(text: str, **facts) -> tuple[str, int, int]:
    errors = _errors(text, **facts)
    assert len(errors) == 1, errors
    return errors[0]


# ---- syntax -----------------------------------------------------------------------

def test_syntax_missing_value_says_what_was_expected():
    assert _only("mesh dp=2 tp=\n") == ("unexpected end of line; expected a value", 1, 14)


def test_syntax_wrong_token_points_at_it():
    assert _only("mesh dp=2\nbatch global:4\n") == ("unexpected ':'; expected '='", 2, 13)


def test_syntax_unclosed_block_reaches_end_of_file():
    msg, line, col = _only('mesh\ntensor_parallel {\n  "wte" : vocab\n')
    assert msg.startswith("unexpected end of file; expected '}'") and (line, col) == (3, 16)


def test_syntax_error_is_a_plan_syntax_error_and_renders():
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh dp=2 @\n", "t.par")
    assert info.value.render().splitlines()[:3] == [
        "t.par:1:11: error: unexpected '@'; expected ',' or '{' or a name or a quoted \"pattern\" or end of line",
        "    mesh dp=2 @",
        "              ^",
    ]


# ---- unknown and duplicate --------------------------------------------------------

def test_unknown_key_with_did_you_mean():
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh dp=2 tpp=2\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.message, d.span.line, d.span.col) == ("unknown key `tpp` in `mesh`", 1, 11)
    assert d.hint.startswith("did you mean `tp`?")


def test_unknown_statement_with_did_you_mean():
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh\npipline schedule=1f1b\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.message, d.span.line, d.span.col) == ("unknown statement `pipline`", 2, 1)
    assert d.hint.startswith("did you mean `pipeline`?")


def test_duplicate_statement_points_at_the_second_and_names_the_first():
    with pytest.raises(PlanSyntaxError) as info:
        parse("mesh dp=2\nzero stage=1\n\nzero stage=2\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.message, d.span.line, d.span.col) == ("duplicate `zero` statement", 4, 1)
    assert "line 2" in d.hint


def test_duplicate_key():
    assert _only("mesh dp=2 dp=4\n") == ("duplicate key `dp` in `mesh`", 1, 11)


def test_missing_mesh():
    assert _only("zero stage=1\n") == ("the plan has no `mesh` statement", 1, 1)


def test_unknown_tp_flag_and_style():
    assert _errors('mesh tp=2\ntensor_parallel {\n  "wte" : vocabb\n  sequence_paralel\n}\n') == [
        ("unknown tensor_parallel style `vocabb` for \"wte\"", 3, 11),
        ("unknown flag `sequence_paralel` in `tensor_parallel`", 4, 3),
    ]


# ---- degrees ----------------------------------------------------------------------

@pytest.mark.parametrize("text, message, col", [
    ("mesh tp=0", "mesh tp must be a positive integer, got 0", 9),
    ("mesh dp=-2", "mesh dp must be a positive integer, got -2", 9),
    ("mesh pp=1.5", "mesh pp must be a positive integer, got 1.5", 9),
])
def test_degree_not_a_positive_integer(text, message, col):
    assert _only(text) == (message, 1, col)


def test_all_errors_of_a_file_are_reported_in_order():
    assert [e[1:] for e in _errors("mesh tp=0 dp=-2 pp=1.5\nzero stage=9\nprecision fp8\n")] == [
        (1, 9), (1, 14), (1, 20), (2, 12), (3, 11)]


def test_mesh_order_must_be_a_permutation():
    assert _only("mesh order=tp,dp") == ("mesh order must name each of dp, pp, tp once, got tp,dp", 1, 12)


# ---- launch and model facts -------------------------------------------------------

def test_world_size_mismatch():
    assert _only("mesh dp=2 pp=2 tp=2\n", world_size=4) == (
        "mesh dp 2 × pp 2 × tp 2 = 8 ≠ world size 4", 1, 1)


def test_pp_more_than_layers():
    assert _only("\nmesh pp=8\n", num_layers=4) == (
        "mesh pp 8 > 4 layers: each pp rank needs at least one layer", 2, 9)


def test_virtual_stages_more_than_layers():
    assert _only("mesh pp=2\npipeline schedule=interleaved_1f1b virtual=4\n", num_layers=6) == (
        "pipeline needs pp 2 × virtual 4 = 8 stages but the model has 6 layers", 2, 44)


def test_pattern_matching_no_module_is_a_warning_with_the_closest_paths():
    plan = parse('mesh tp=2\ntensor_parallel {\n  "blocks.*.atn.qkv" : column\n}\n', "t.par")
    paths = ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "blocks.0.mlp.fc", "wte", "lm_head"]
    [w] = validate(plan, module_paths=paths)
    assert (w.severity, w.message, w.span.line, w.span.col) == (
        "warning", 'tensor_parallel pattern "blocks.*.atn.qkv" matches no module', 3, 3)
    assert w.hint == "closest module paths: blocks.1.attn.qkv, blocks.0.attn.qkv, blocks.0.mlp.fc"


def test_recompute_pattern_matching_no_module_is_a_warning():
    plan = parse('mesh\nrecompute "blocks.*" "layers.*"\n', "t.par")
    [w] = validate(plan, module_paths=["blocks.0", "blocks.1"])
    assert (w.message, w.span.line, w.span.col) == ('recompute pattern "layers.*" matches no module', 2, 22)


# ---- batch arithmetic -------------------------------------------------------------

def test_batch_stated_accumulation_must_multiply_out():
    assert _only("mesh dp=8\nbatch global=1024 micro=4 accumulation=8\n") == (
        "global batch 1024 ≠ micro 4 × accumulation 8 × dp 8 = 256", 2, 14)


def test_batch_derived_accumulation_must_divide():
    assert _only("mesh dp=2\nbatch global=30 micro=4\n") == (
        "global batch 30 is not a multiple of micro 4 × dp 2 = 8", 2, 14)


def test_batch_needs_global_and_micro():
    assert _only("mesh\nbatch micro=4\n") == ("`batch` needs global=", 2, 1)


# ---- pipeline ---------------------------------------------------------------------

def test_interleaved_needs_virtual_at_least_two():
    assert _only("mesh pp=2\npipeline schedule=interleaved_1f1b virtual=1\n") == (
        "schedule interleaved_1f1b needs virtual ≥ 2, got virtual 1", 2, 44)


def test_non_interleaved_schedule_with_virtual():
    assert _only("mesh pp=2\npipeline schedule=gpipe virtual=2\n") == (
        "schedule gpipe holds one stage per pp rank, got virtual 2", 2, 33)


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(PlanError) as info:
        parse("mesh pp=2\npipeline schedule=1f1c\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.message, d.span.line, d.span.col) == ("unknown pipeline schedule `1f1c`", 2, 19)
    assert d.hint == "did you mean `1f1b`? valid: gpipe, 1f1b, interleaved_1f1b, zb_h1"


def test_stages_must_equal_pp_times_virtual():
    assert _only("mesh pp=2\npipeline stages=3\n") == ("pipeline stages 3 ≠ pp 2 × virtual 1 = 2", 2, 17)


def test_cut_count_and_globs():
    assert _errors('mesh pp=3\npipeline { cut after "blocks.*" }\n') == [
        ("1 cuts make 2 stages ≠ pp 3 × virtual 1 = 3", 2, 1),
        ('a cut names one module path, got "blocks.*"', 2, 12),
    ]


def test_cut_where_is_before_or_after():
    assert _only('mesh pp=2\npipeline { cut behind "blocks.1" }\n') == (
        "a cut is `before` or `after` a module, got `behind`", 2, 16)


# ---- zero, precision, optimizer ---------------------------------------------------

def test_zero_stage_out_of_range():
    assert _only("mesh\nzero stage=4\n") == ("zero stage must be 0, 1, 2 or 3, got 4", 2, 12)


def test_unknown_precision_and_optimizer():
    assert _errors("mesh\nprecision fp23\noptimizer adamx\n") == [
        ("unknown precision `fp23`", 2, 11), ("unknown optimizer `adamx`", 3, 11)]


def test_lr_must_be_positive():
    assert _only("mesh\noptimizer adamw lr=0\n") == ("optimizer lr must be > 0, got 0.0", 2, 20)


def test_betas_in_unit_interval():
    assert _only("mesh\noptimizer adamw betas=0.9,1.0\n") == (
        "optimizer betas must lie in [0, 1), got 0.9,1.0", 2, 23)


def test_value_types_are_checked_by_the_front_end():
    assert _errors("mesh\ntopology intra=fast\noptimizer adamw lr=big betas=0.9\n") == [
        ("topology intra must be a bandwidth such as 900GB/s or 400Gbit/s, got fast", 2, 16),
        ("optimizer lr must be a finite number, got big", 3, 20),
        ("optimizer betas takes two numbers (beta1,beta2), got 0.9", 3, 30),
    ]


def test_unreadable_file_is_a_parc_error(tmp_path):
    from parc.grammar.parser import load_plan

    with pytest.raises(PlanSyntaxError) as info:
        load_plan(tmp_path / "missing.par")
    assert info.value.message.startswith("cannot read plan") and info.value.span.line == 1
