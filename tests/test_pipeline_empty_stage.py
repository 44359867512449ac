"""A pipeline stage that uses no parameters is refused at the cut that makes it (passes/pipeline_split.py
`_check_parameters`), by `parc compile` and `parc check --model` alike.

`cut after "lm_head"` leaves the last stage only the loss: it was accepted and failed at step 0
(`optimizer got an empty parameter list`, issue 24). A stage of parameter-free operations between two
cuts is refused the same way. A cut that leaves parameters on both sides still compiles.
"""

from __future__ import annotations

import pytest

from helpers import GPT, compile_text
from parc.cli import main
from parc.compiler import compile_model
from parc.errors import ParcError
from parc.grammar.parser import parse

BATCH = "batch global=4 micro=1\n"


def _refusal(tmp_path, text: str) -> ParcError:
    with pytest.raises(ParcError) as err:
        compile_model(GPT, parse(text, file=str(tmp_path / "plan.par")), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything is written
    return err.value


def test_cut_after_the_last_module_is_refused_at_the_cut(tmp_path):
    err = _refusal(tmp_path, 'mesh pp=2\n' + BATCH + 'pipeline schedule=1f1b { cut after "lm_head" }\n')
    assert err.message.startswith('cut after "lm_head" leaves stage 1 of 2 (only top-level operations, such as the loss) without parameters')
    assert (err.span.line, err.span.col) == (3, 26)  # the cut statement
    assert err.diagnostics[0].hint.startswith('move the cut before "lm_head"')


def test_a_parameter_free_middle_stage_is_refused(tmp_path):
    # blocks.0's second residual add is all that runs between the end of its MLP and the end of the block
    text = 'mesh pp=3\n' + BATCH + 'pipeline schedule=gpipe {\n    cut after "blocks.0.mlp"\n    cut after "blocks.0"\n}\n'
    err = _refusal(tmp_path, text)
    assert err.message.startswith('cut after "blocks.0.mlp" leaves stage 1 of 3 (blocks.0) without parameters')
    assert (err.span.line, err.span.col) == (4, 5)


def test_check_reports_it_too(tmp_path, capsys):
    plan = tmp_path / "plan.par"
    plan.write_text('mesh pp=2\n' + BATCH + 'pipeline schedule=1f1b { cut after "lm_head" }\n')
    assert main(["check", str(plan), "--model", str(GPT)]) == 2
    assert f"{plan}:3:26: error: cut after \"lm_head\" leaves stage 1 of 2" in capsys.readouterr().err


def test_the_cut_the_hint_names_compiles(tmp_path):
    art = compile_text('mesh pp=2\n' + BATCH + 'pipeline schedule=1f1b { cut before "lm_head" }\n', tmp_path / "c")
    last = next(p for p in art.plan["programs"].values() if p["stage"] == 1)
    assert [e["fqn"] for e in last["state"] if e["kind"] == "param"] == ["lm_head.weight"]
