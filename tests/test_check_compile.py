"""`parc check --model` finds everything `parc compile` would refuse, all at once (parc/cli.py `cmd_check`,
parc/compiler.py `pass_errors`): over a corpus of plans, every error compile stops with is among check's,
and check fails exactly when compile does. Every shipped example passes its own check at its world size."""

import re
from pathlib import Path

import pytest

from helpers import GPT, ROOT, gpt_tp_rules, llama_tp_rules
from parc.cli import main
from parc.grammar.parser import load_plan

MODELS = ROOT / "tests" / "models"
TP3 = (ROOT / "examples" / "tp.par").read_text().replace("mesh tp=2", "mesh tp=3")
RULES = gpt_tp_rules()
CORPUS = {  # name → (model, plan text)
    "tp3_every_width": (GPT, TP3),
    "tp3_and_bad_batch": (GPT, TP3.replace("accumulation=2", "accumulation=3")),
    "qkv_column_alone": (GPT, 'mesh tp=2\ntensor_parallel {\n    "blocks.*.attn.qkv" : column\n}\n'),
    "column_on_embedding": (GPT, 'mesh tp=2\ntensor_parallel {\n    "wte" : column\n}\n'),
    "tied_head_column": (MODELS / "gpt_tied.py", "mesh tp=2\n" + RULES.replace('"lm_head"            : vocab',
                                                                               '"lm_head" : column')),
    # fewer kv heads than tp: k/v kept whole by the pass and warned (passes/tp_gqa.py), no longer refused
    "gqa_heads_below_tp_ok": (MODELS / "llama_tiny.py", "mesh tp=4\n" + llama_tp_rules()),
    "zero3_with_pp": (GPT, "mesh dp=2 pp=2\nbatch global=8 micro=2\nzero stage=3\n"),
    "fp16_and_tp3": (GPT, TP3 + "precision fp16\n"),
    "pp_over_layers": (GPT, "mesh pp=8\nbatch global=8 micro=1\n"),
    "unknown_preset": (GPT, "mesh dp=2\ntopology nodes=1 gpus_per_node=2 preset=h\n"),
    "typo_leaves_row_alone": (GPT, RULES.replace("attn.qkv", "attn.qkvv").replace("tensor_parallel", "mesh tp=2\ntensor_parallel")),
    "sp_plain_head_ok": (GPT, "mesh tp=2\n" + gpt_tp_rules(True).replace('    "lm_head"            : vocab\n', "")),
    "tied_pp_tp_ok": (MODELS / "gpt_tied.py", "mesh pp=2 tp=2\nbatch global=4 micro=1\n" + RULES),
}
ERROR = re.compile(r"^(?:(\S+:\d+:\d+): )?error: (.*)$", re.M)


def _errors(text: str) -> set[tuple]:
    return set(ERROR.findall(text))


def _run(argv, capsys) -> tuple[int, set[tuple]]:
    code = main(argv)
    return code, _errors(capsys.readouterr().err)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_check_finds_what_compile_refuses(tmp_path, capsys, name):
    model, text = CORPUS[name]
    plan = tmp_path / f"{name}.par"
    plan.write_text(text)
    compiled, compile_errors = _run(["compile", str(model), "--plan", str(plan), "-o", str(tmp_path / "c")], capsys)
    checked, check_errors = _run(["check", str(plan), "--model", str(model)], capsys)
    assert (compiled == 0) == (checked == 0), (compile_errors, check_errors)
    assert compile_errors <= check_errors, compile_errors - check_errors
    assert all(where for where, _ in check_errors)  # every error located at file:line:col
    if name.endswith("_ok"):
        assert checked == 0
    else:
        assert checked == 2 and compile_errors


def test_all_at_once(tmp_path, capsys):
    """A launch that is not the mesh and exceeds the topology, and every rule whose widths tp=3 does not
    divide: one check says all. (A plan inconsistent in itself stops at parsing, with all of those errors.)"""
    plan = tmp_path / "p.par"
    plan.write_text(TP3)
    code, errors = _run(["check", str(plan), "--model", str(GPT), "--world-size", "16"], capsys)
    assert code == 2
    text = "\n".join(f"{w}: {m}" for w, m in sorted(errors))
    assert "mesh dp 1 × pp 1 × tp 3 = 3 ≠ world size 16" in text
    assert "world size 16 > topology nodes 1 × gpus_per_node 8 = 8 devices" in text
    for rule in ("wte", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "lm_head"):
        assert f"on `{rule}`: " in text, rule
    assert text.count("not divisible by") == 7  # six rules' widths, and the sequence length once
    code, errors = _run(["check", str(plan), "--model", str(GPT), "--world-size", "4"], capsys)
    assert "topology" not in str(errors)  # 4 ranks on a one-node H100 topology (8 devices) is a fine launch


EXAMPLES = sorted((ROOT / "examples").glob("*.par"))


@pytest.mark.parametrize("par", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_passes_its_own_check(capsys, par: Path):
    world = load_plan(par).mesh.world_size
    model = par.with_suffix(".py") if par.with_suffix(".py").is_file() else GPT  # moe.par is for moe.py
    code = main(["check", str(par), "--model", str(model), "--world-size", str(world)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "error" not in out.err and f"{par}: ok" in out.out
