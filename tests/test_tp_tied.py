"""Tied embeddings under tensor parallelism (passes/tp_shared.py): one [V/tp, H] shard serves the
vocab-parallel embedding and the vocab-parallel head; both uses' gradients land in it. Parallel equals
serial for the tied GPT at tp=2, tp=2 + SP, pp=2 × tp=2 (the table held by the first and last stage) and
HF Llama with `tie_word_embeddings`; any other rule on a shared weight is an error at the rule."""

import textwrap

import pytest

from helpers import ROOT, compile_text, gpt_tp_rules, llama_tp_rules, parallel_vs_serial
from parc.errors import ParcError

MODELS = ROOT / "tests" / "models"
TIED_GPT, TIED_LLAMA = MODELS / "gpt_tied.py", MODELS / "llama_tied.py"
# fp32, dropout 0: the same tolerances and reasons as tests/test_tensor_parallel.py (row layers and the
# vocab-parallel softmax sum in another order; Adam magnifies the rounding of near-zero gradients). A tied
# table updated from one use only, or read whole by one use and sliced by the other, is off by 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
HEAD = '    "lm_head"            : vocab\n'
WTE = '    "wte"                : vocab\n'


def _plan(mesh: str, rules: str, tail: str = "") -> str:
    return f"mesh {mesh}\nbatch global=4 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n" + rules + tail


def _check(verdict):
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained


def _shard(art, fqn, program="stage0_tp1"):
    return {e["fqn"]: e["shard"] for e in art.plan["programs"][program]["state"]}[fqn]


@pytest.mark.parametrize("rules", [gpt_tp_rules(),                       # vocab on both uses
                                   gpt_tp_rules(True).replace(HEAD, "")])  # on the embedding only, with SP
def test_tied_gpt_tp2_matches_serial(tmp_path, rules):
    """(A rule on the head only is HF Llama's case below.)"""
    art = compile_text(_plan("tp=2", rules), tmp_path / "c", TIED_GPT)
    assert _shard(art, "lm_head.weight") == {"dim": 0, "parts": 2, "index": 1}  # the one table, rows split
    src = (art.root / "programs" / "stage0_tp1.py").read_text()
    assert "vocab_parallel_cross_entropy" in src and "aten.embedding" in src
    _check(parallel_vs_serial(art.root, steps=3))


def test_tied_gpt_pp2_tp2_matches_serial(tmp_path):
    """The table sits on the first stage (embedding) and the last (head), each holding rows [V/tp·r, V/tp·(r+1));
    runtime/parallel/pipeline.py sums each tp rank's two copies' gradients over pp."""
    art = compile_text(_plan("pp=2 tp=2", gpt_tp_rules(), "pipeline schedule=1f1b\n"), tmp_path / "c", TIED_GPT)
    assert art.plan["tied"] == [{"fqn": "lm_head.weight", "stages": [0, 1], "pp_ranks": [0, 1]}]
    assert _shard(art, "lm_head.weight", "stage0_tp1") == _shard(art, "lm_head.weight", "stage1_tp1")
    _check(parallel_vs_serial(art.root, steps=3))


def test_tied_llama_tp2_matches_serial(tmp_path):
    rules = llama_tp_rules().replace('    "model.embed_tokens"              : vocab\n', "")
    art = compile_text(_plan("tp=2", rules), tmp_path / "c", TIED_LLAMA)
    (fqn,) = [e["fqn"] for e in art.plan["programs"]["stage0_tp0"]["state"] if "embed" in e["fqn"] or "lm_head" in e["fqn"]]
    assert _shard(art, fqn) == {"dim": 0, "parts": 2, "index": 1}
    _check(parallel_vs_serial(art.root, steps=3))


TWO_LINEARS = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.layers[1].weight = self.layers[0].weight  # tied: `b.weight = a.weight`
    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))

def build_model(): return Net()
def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randn(batch_size, 16, generator=g)
def loss_fn(model, x, y): return F.mse_loss(model(x), y)
'''


@pytest.mark.parametrize("rule,line,needles", [
    ('"layers.1" : column', 4, ["`column` on `layers.1`", "`layers.0` reads it as its linear weight (no rule)",
                                "`layers.1` reads it as its linear weight (rule `column`)"]),
    ('"layers.0" : row', 4, ["`row` on `layers.0`", "`layers.1` reads it as its linear weight"]),
])
def test_other_rules_on_a_shared_weight_are_located_errors(tmp_path, rule, line, needles):
    """The use the rule names may come before or after the other use in the graph: both are caught."""
    model = tmp_path / "two.py"
    model.write_text(textwrap.dedent(TWO_LINEARS))
    plan = f"mesh tp=2\nbatch global=4 micro=2\ntensor_parallel {{\n    {rule}\n}}\n"
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c", model)
    for needle in needles:
        assert needle in e.value.message, e.value.message
    assert e.value.span is not None and e.value.span.line == line


@pytest.mark.parametrize("edit,needles,hint", [
    (lambda r: r.replace(WTE, "").replace('"lm_head"            : vocab', '"lm_head" : column'),
     ["`column` on `lm_head`", "`wte` reads it as its embedding table"], "mark `lm_head` `vocab`"),
    (lambda r: r.replace(WTE, '    "wte" : replicate\n'),
     ["`vocab` on `lm_head`", "`wte` reads it as its embedding table (rule `replicate`)"], "drop the `replicate`"),
])
def test_tied_gpt_rule_conflicts_are_located(tmp_path, edit, needles, hint):
    plan = _plan("tp=2", edit(gpt_tp_rules()))
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c", TIED_GPT)
    for needle in needles:
        assert needle in e.value.message, e.value.message
    assert hint in e.value.diagnostics[0].hint
    lines = plan.splitlines()
    assert "lm_head" in lines[e.value.span.line - 1]  # the rule that shards the shared weight
