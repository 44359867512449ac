"""Fuzzing the front end: mangled plans fail only with a ParcError that points somewhere.

Start at `test_mutated_plans_fail_cleanly_or_round_trip`. Hypothesis starts from the
example plans and applies random edits (characters and tokens inserted, deleted,
swapped, numbers changed), then parses and validates with random launch and model
facts. Every outcome must be either a plan that round-trips through the printer, or
a ParcError whose diagnostics all have a span with line ≥ 1 and col ≥ 1 and render.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parc.errors import ParcError
from parc.grammar.parser import parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [(ROOT / "examples" / f"{n}.par").read_text() for n in ("dp", "3d", "tp", "pp", "zero")]
TOKENS = ["mesh", "topology", "batch", "tensor_parallel", "pipeline", "zero", "recompute",
          "precision", "optimizer", "compile", "inductor", "cut", "before", "after", "sequence_parallel", "dp=", "pp=",
          "tp=", "order=", "stage=", "global=", "micro=", "accumulation=", "virtual=", "stages=",
          "schedule=", "auto", "interleaved_1f1b", "gpipe", "column", "row", "1e999", "-0",
          "900GB/s", "3Gbit/s", '"blocks.*"', "{", "}", "=", ",", ":", "#", "\n", "\r\n", " ", "\t"]
CHARS = st.characters(codec="utf-8", exclude_categories=("Cs",))
NUMBERS = st.one_of(st.integers(-3, 2**70).map(str), st.floats(allow_nan=True).map(repr),
                    st.sampled_from(["0", "1", "2", "4", "8", "0.5", "1e-9", "08", "+3"]))

edit = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.one_of(st.sampled_from(TOKENS), st.text(CHARS, max_size=3))),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 8)),
    st.tuples(st.just("swap"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("number"), st.integers(0, 10**6), NUMBERS),
)


def _apply(text: str, op) -> str:
    kind, at, arg = op
    n = len(text) + 1
    if kind == "insert":
        i = at % n
        return text[:i] + arg + text[i:]
    if kind == "delete":
        i = at % n
        return text[:i] + text[i + arg:]
    if kind == "swap" and text:
        i, j = sorted((at % len(text), arg % len(text)))
        return text[:i] + text[j] + text[i + 1:j] + text[i] + text[j + 1:]
    numbers = list(re.finditer(r"\d+(\.\d+)?", text))
    if kind == "number" and numbers:
        m = numbers[at % len(numbers)]
        return text[:m.start()] + arg + text[m.end():]
    return text


facts = st.fixed_dictionaries({
    "world_size": st.one_of(st.none(), st.integers(-1, 64)),
    "num_layers": st.one_of(st.none(), st.integers(-1, 12)),
    "module_paths": st.one_of(st.none(), st.lists(st.sampled_from(
        ["wte", "lm_head", "blocks.0", "blocks.1.attn.qkv", "blocks.2", "blocks.0.mlp.fc"]), max_size=6)),
})


def _check(text: str, kwargs: dict) -> None:
    try:
        plan = parse(text, "fuzz.par")
        validate(plan, **kwargs)
    except ParcError as e:
        for d in e.diagnostics:
            assert d.span is not None and d.span.line >= 1 and d.span.col >= 1, d
            assert d.span.file == "fuzz.par"
        e.render()
        return
    assert parse(format_plan(plan)) == plan


# ~10 ms a parse on a loaded CI core: 1000 plans keep the file near 20 s.
@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.sampled_from(SEEDS), edits=st.lists(edit, min_size=1, max_size=6), kwargs=facts)
def test_mutated_plans_fail_cleanly_or_round_trip(seed, edits, kwargs):
    text = seed
    for op in edits:
        text = _apply(text, op)
    _check(text, kwargs)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(list("mesh dp=2\n{}\"#:,.*-ez") + TOKENS), max_size=30).map("".join),
       kwargs=facts)
def test_token_soup_fails_cleanly(text, kwargs):
    _check(text, kwargs)
