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


ASCII = "in ASCII digits 0-9, without a sign or leading zeros"


@pytest.mark.parametrize("text, message", [  # issue 29: each was read as 2 (or 0), without a word
    ("mesh dp=２", f"mesh dp must be a positive integer {ASCII}, got ２"),  # full width
    ("mesh dp=٢", f"mesh dp must be a positive integer {ASCII}, got ٢"),  # Arabic-Indic
    ("mesh dp=+2", f"mesh dp must be a positive integer {ASCII}, got +2"),
    ("mesh dp=08", f"mesh dp must be a positive integer {ASCII}, got 08"),
    ("mesh dp=2\nzero stage=-0", "zero stage must be an integer 0..3, got -0"),
])
def test_integers_are_ascii_decimal_only(text, message):
    assert _errors(text)[0][0] == message


def test_repeated_recompute_pattern_is_an_error_like_a_repeated_tp_pattern():
    assert _errors('mesh dp=2\nrecompute "blocks.*" "blocks.*"\n') == [
        ('duplicate recompute pattern "blocks.*"', 2, 22)]


def test_absurd_lr_is_warned_about():
    plan = parse("mesh dp=2\noptimizer adamw lr=18446744073709551618\n")
    warnings = [d.message for d in validate(plan) if d.severity == "warning"]
    assert any("far above any usual learning rate" in w for w in warnings), warnings


def test_control_characters_in_messages_are_spelled_out():
    from parc.errors import Diagnostic

    assert 'pattern "blocks\\x00.*"' in Diagnostic('pattern "blocks\x00.*" matches no module').render()


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


def test_a_model_without_layers_is_refused_only_for_an_automatic_pipeline():
    """A model with no repeated block list (num_layers 0) trains at pp 1; pp > 1 needs layers or explicit cuts."""
    for text in ("mesh dp=2\n", "mesh pp=1\n"):
        assert validate(parse(text), num_layers=0) == []
    assert validate(parse('mesh pp=2\npipeline { cut after "fc1" }\n'), num_layers=0) == []
    assert _only("mesh pp=2\n", num_layers=0) == (
        "mesh pp 2: placing the stages needs repeated layers (an nn.ModuleList of one block class) to cut between, "
        "and the model has none", 1, 9)


def test_virtual_stages_more_than_layers():
    assert _only("mesh pp=2\npipeline schedule=interleaved_1f1b virtual=4\n", num_layers=6) == (
        "pipeline needs pp 2 × virtual 4 = 8 stages but the model has 6 layers", 2, 44)


def test_pattern_matching_no_module_is_an_error_with_the_closest_paths():
    plan = parse('mesh tp=2\ntensor_parallel {\n  "blocks.*.atn.qkv" : column\n}\n', "t.par")
    paths = ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "blocks.0.mlp.fc", "wte", "lm_head"]
    with pytest.raises(ParcError) as info:
        validate(plan, module_paths=paths)
    [e] = info.value.diagnostics
    assert (e.severity, e.message, e.span.line, e.span.col) == (
        "error", 'tensor_parallel pattern "blocks.*.atn.qkv" matches no module', 3, 3)
    assert e.hint == ('closest module paths: blocks.1.attn.qkv, blocks.0.attn.qkv, blocks.0.mlp.fc; '
                      'mark it "blocks.*.atn.qkv"? if it may match none')


def test_recompute_glob_reaching_inside_modules_it_skips_is_warned_about():
    """`*` matches dots: "layers.*[13579]" meant for the odd layers also makes the even layers' `w1` and `w3`
    regions of their own. Warned at the pattern, naming one region of each depth; one depth is quiet."""
    paths = [p for i in range(4) for p in (f"layers.{i}", f"layers.{i}.attention", f"layers.{i}.attention.wq",
                                           f"layers.{i}.feed_forward", f"layers.{i}.feed_forward.w1",
                                           f"layers.{i}.feed_forward.w3")]
    plan = parse('mesh\nrecompute "layers.*[13579]"\n', "t.par")
    [w] = validate(plan, module_paths=paths)
    assert (w.severity, w.span.line, w.span.col) == ("warning", 2, 11)
    assert w.message == ('recompute pattern "layers.*[13579]" makes regions of modules at 2 depths (`layers.1`, '
                         '`layers.0.feed_forward.w1`): a glob\'s `*` also matches dots')
    assert validate(parse('mesh\nrecompute "layers.[13579]"\n'), module_paths=paths) == []
    assert validate(parse('mesh\nrecompute "layers.*"\n'), module_paths=paths) == []   # outermost: the layers


def test_recompute_pattern_matching_no_module_is_an_error():
    assert _only('mesh\nrecompute "blocks.*" "layers.*"\n', module_paths=["blocks.0", "blocks.1"]) == (
        'recompute pattern "layers.*" matches no module', 2, 22)


def test_a_pattern_marked_optional_may_match_nothing():
    """`"glob"?`: a plan written for several models (or transformers versions) names modules some lack."""
    text = 'mesh tp=2\ntensor_parallel {\n  "embed_out"? : vocab\n  "lm_head"? : vocab\n}\nrecompute "layers.*"?\n'
    plan = parse(text, "t.par")
    assert [r.optional for r in plan.tensor_parallel.rules] == [True, True] and plan.recompute.optional == ("layers.*",)
    assert validate(plan, module_paths=["lm_head", "blocks.0"]) == []


def test_rules_on_a_tp1_mesh_are_a_warning_but_unmatched_ones_still_errors():
    """A plan written for tp 2 and run at tp 1 is a fair reuse: said, not refused; a typo is refused either way."""
    plan = parse('mesh\ntensor_parallel {\n  "lm_head" : vocab\n}\n', "t.par")
    [w] = validate(plan, module_paths=["lm_head"])
    assert (w.severity, w.message, w.span.line) == ("warning", "with mesh tp 1, 1 tensor_parallel rule has no effect", 2)
    assert _errors('mesh\ntensor_parallel {\n  "lm_hed" : vocab\n}\n', module_paths=["lm_head"]) == [
        ("with mesh tp 1, 1 tensor_parallel rule has no effect", 2, 1),
        ('tensor_parallel pattern "lm_hed" matches no module', 3, 3)]


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


def test_precision_reduce_dtype():
    """`reduce=` names the dp reduction's dtype: fp32 or bf16, and bf16 only over bf16 compute."""
    assert _only("mesh\nprecision bf16 reduce=fp16\n") == ("precision reduce must be fp32 or bf16, got `fp16`", 2, 23)
    assert _only("mesh\nprecision fp32 reduce=bf16\n") == (
        "precision fp32 reduce=bf16: a bf16 gradient reduction needs bf16 compute", 2, 23)
    assert parse("mesh\nprecision bf16 reduce=bf16\n", "t.par").grad_reduce == "bf16"


def test_precision_accumulate_dtype():
    """`accumulate=bf16` (ZeRO-1/2's bf16 gradient accumulators) only where the runtime has it, at the key."""
    z1 = "mesh dp=2\nzero stage=1\n"
    assert _only(z1 + "precision bf16 reduce=bf16 accumulate=fp16\n") == (
        "precision accumulate must be fp32 or bf16, got `fp16`", 3, 39)
    assert _only(z1 + "precision bf16 accumulate=bf16\n") == (
        "precision bf16 reduce=fp32 accumulate=bf16: bf16 gradient accumulation needs bf16 compute and a bf16 "
        "reduction", 3, 27)
    assert _only("mesh dp=2\nzero stage=3\nprecision bf16 reduce=bf16 accumulate=bf16\n") == (
        "precision accumulate=bf16 under zero stage 3: bf16 gradient accumulators are implemented for ZeRO-1 and "
        "ZeRO-2 only", 3, 39)
    assert _only("mesh dp=2\nprecision bf16 reduce=bf16 accumulate=bf16\n") == (
        "precision accumulate=bf16 under zero stage 0: bf16 gradient accumulators are implemented for ZeRO-1 and "
        "ZeRO-2 only", 2, 39)
    assert _only("mesh dp=2\nzero stage=2 offload=cpu\nprecision bf16 reduce=bf16 accumulate=bf16\n") == (
        "precision accumulate=bf16 with zero offload=cpu is not implemented: its gradients take another path "
        "(runtime/parallel/offload.py, expert_parallel.py)", 3, 39)
    assert _only("mesh dp=4\nzero stage=2 shard=2\nprecision bf16 reduce=bf16 accumulate=bf16\n") == (
        "precision accumulate=bf16 with zero shard=2: no test holds bf16 gradient accumulation to the serial run "
        "under HSDP (its replicas' all-reduce)", 3, 39)
    for mesh in ("dp=2 tp=2", "dp=2 pp=2", "dp=2 cp=2"):  # tests/test_bf16_accumulate_meshes.py
        text = f"mesh {mesh}\nzero stage=1\nprecision bf16 reduce=bf16 accumulate=bf16\n"
        assert parse(text, "t.par").grad_accumulate == "bf16"
    assert parse(z1 + "precision bf16 reduce=bf16 accumulate=bf16\n", "t.par").grad_accumulate == "bf16"


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


def test_missing_file_is_a_parc_error(tmp_path):
    from parc.grammar.parser import load_plan

    with pytest.raises(PlanSyntaxError) as info:
        load_plan(tmp_path / "missing.par")
    assert info.value.message == f"plan {tmp_path / 'missing.par'}: no such file"


# ---- reading the file: encodings, special files, line splitting, limits (issue 10) ----

def _load_error(tmp_path, data: bytes) -> tuple[str, int, int, str]:
    from parc.grammar.parser import load_plan

    (tmp_path / "x.par").write_bytes(data)
    with pytest.raises(PlanSyntaxError) as info:
        load_plan(tmp_path / "x.par")
    d = info.value.diagnostics[0]
    return d.message, d.span.line, d.span.col, info.value.render()


def test_invalid_utf8_is_located_not_a_traceback(tmp_path):
    msg, line, col, text = _load_error(tmp_path, b"mesh dp=2\nbatch global=8 \xff micro=2\n")
    assert (msg, line, col) == ("the plan is not UTF-8 text: byte ff (invalid start byte)", 2, 16)
    assert text.splitlines()[1:3] == ["    batch global=8 \ufffd micro=2", "                   ^"]


def test_invalid_utf8_after_wide_characters_counts_code_points(tmp_path):
    _, line, col, _ = _load_error(tmp_path, "mesh # é日".encode() + b"\xc3(\n")
    assert (line, col) == (1, 10)


def test_a_byte_order_mark_is_accepted_and_moves_no_column(tmp_path):
    from parc.grammar.parser import load_plan

    (tmp_path / "bom.par").write_bytes(b"\xef\xbb\xbfmesh dp=2\r\nbatch global=8 micro=2\r\n")
    assert load_plan(tmp_path / "bom.par").mesh.dp == 2
    assert _errors("\ufeffmesh tp=0\n") == [("mesh tp must be a positive integer, got 0", 1, 9)]


def test_crlf_files_give_the_same_diagnostics_as_lf():
    text = "mesh dp=2 tp=0\nbatch global=30 micro=4\nzero stage=7 # x\n"
    assert _errors(text.replace("\n", "\r\n")) == _errors(text)


@pytest.mark.parametrize("kind", ["directory", "fifo", "devnull"])
def test_special_files_are_named_for_what_they_are(tmp_path, kind):
    import os

    from parc.grammar.parser import load_plan

    path = {"directory": tmp_path, "devnull": "/dev/null"}.get(kind, tmp_path / "pipe.par")
    if kind == "fifo":
        os.mkfifo(path)  # never opened: load_plan would block on it until a writer came
    what = {"directory": "a directory", "fifo": "a FIFO (named pipe)", "devnull": "a character device"}[kind]
    with pytest.raises(PlanSyntaxError) as info:
        load_plan(path)
    assert info.value.message == f"plan {path}: is {what}, not a file"


@pytest.mark.parametrize("sep", ["\x0c", "\x85", "\u2028", "\u2029", "\x1c", "\x0b"])
def test_line_separators_in_a_comment_do_not_shift_the_echoed_line(sep):
    with pytest.raises(ParcError) as info:
        parse(f"mesh dp=2 # a{sep}b\nzero stage=7\n", "t.par")
    lines = info.value.render().splitlines()
    assert lines[0].startswith("t.par:2:12: error: zero stage must be 0, 1, 2 or 3")
    assert lines[1:3] == ["    zero stage=7", "               ^"]


def test_caret_sits_under_the_token_after_tabs_wide_and_control_characters():
    with pytest.raises(ParcError) as info:
        parse("mesh\tdp=2 # 日本\nbatch\tglobal=8 micro=3 # \x0c\u202e\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (2, 14)  # code points: the tab is one column
    echoed, caret = d.render().splitlines()[1:3]
    assert echoed == "    batch\tglobal=8 micro=3 #  \ufffd"  # \f as a space, the bidi override as U+FFFD
    assert caret == "    " + " " * 5 + "\t" + " " * 7 + "^"
    with pytest.raises(ParcError) as info:
        parse("mesh # 日本語\nmesh 日本\n", "t.par")
    assert info.value.render().splitlines()[1:3] == ["    mesh 日本", "         ^~~~"]
    with pytest.raises(ParcError) as info:
        parse("mesh\n# 日本語\nzero stage=日本 tp=\n", "t.par")
    d = info.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (3, 18)  # end of line: 17 code points, 19 cells
    assert d.render().splitlines()[1:3] == ["    zero stage=日本 tp=", "    " + " " * 19 + "^"]


def test_long_lines_and_many_errors_print_a_bounded_amount():
    from parc.errors import MAX_ECHO, MAX_SHOWN

    line = "mesh " + " ".join(["dp=1"] * 700) + "\n"  # 699 duplicate keys on a 3.5 KB line
    with pytest.raises(PlanSyntaxError) as info:
        parse(line, "t.par")
    assert len(info.value.diagnostics) == 699
    text = info.value.render()
    assert text.endswith("… and 649 more errors not shown") and text.count("error: duplicate key") == MAX_SHOWN
    assert max(len(t) for t in text.splitlines()) <= MAX_ECHO + 10
    last = info.value.diagnostics[MAX_SHOWN - 1]
    echoed, caret = last.render().splitlines()[1:3]
    assert echoed[caret.index("^"):caret.index("^") + 2] == "dp"  # the caret still under the key, inside the window


def test_over_long_lines_and_files_are_refused_before_parsing():
    from parc.grammar.parser import MAX_LINE_CHARS, MAX_PLAN_BYTES

    assert _only("mesh\n# " + "x" * 5000 + "\n") == (
        f"line 2 is 5002 characters long, over {MAX_LINE_CHARS}, the most parc reads in one line", 2, 4097)
    msg, line, col = _only("mesh\n" + ("# comment\n" * (MAX_PLAN_BYTES // 10 + 1)))
    assert msg.startswith("the plan is 65545 bytes, over 65536 (64 KiB)") and (line, col) == (1, 1)


@pytest.mark.parametrize("text, expected", [
    ("mesh dp=1000000000000 tp=2\n",
     ("mesh dp 1000000000000 × pp 1 × tp 2 = 2000000000000 ranks > 65536, the most parc compiles for", 1, 9)),
    ("mesh\ntopology nodes=100000\n", ("topology nodes 100000 > 65536, the most parc plans for", 2, 16)),
    ("mesh dp=2\nbatch global=20000000 micro=10000000\n",
     ("batch micro 10000000 > 65536 samples, the most parc traces in one micro-batch", 2, 29)),
    ("mesh pp=2\nbatch global=20000000 micro=1\n",
     ("batch global 20000000 / (micro 1 × dp 1) = 20000000 micro-batches per step > 65536, "
      "the most parc schedules", 2, 14)),
    ("mesh pp=128\nbatch global=4096 micro=1\n",
     ("pipeline schedule of pp 128 × virtual 1 × 4096 micro-batches = 524288 slots > 262144, the most parc "
      "schedules in one step", 2, 14)),
    ("mesh pp=2\npipeline schedule=interleaved_1f1b virtual=2000\n",
     ("pipeline virtual 2000 > 1024, the most parc schedules", 2, 44)),
])
def test_sizes_past_the_limits_are_located_errors(text, expected):
    assert _only(text) == expected


def test_the_largest_plan_within_the_limits_is_accepted():
    plan = parse("mesh dp=4096 pp=4 tp=4\nbatch global=4194304 micro=4\n", "t.par")
    assert plan.world_size == 65536 and plan.accumulation == 256  # pp 4 × 256 = 1024 slots


def test_a_published_deep_pipeline_is_within_the_schedule_limit():
    """Megatron-LM 2021 Table 2's 530B on 560 GPUs (tp 8 × pp 35 × dp 2, 3 virtual stages, batch 2240 of micro 1):
    1120 micro-batches a pipeline, 117,600 slots, past the old bound of 65,536; bench/published.py prices it."""
    plan = parse("mesh dp=2 pp=35 tp=8\nbatch global=2240 micro=1\n"
                 "pipeline schedule=interleaved_1f1b virtual=3\n", "t.par")
    assert plan.mesh.pp * plan.pipeline.virtual * plan.accumulation == 117600
