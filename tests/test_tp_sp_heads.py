"""Sequence parallelism with any head (passes/tp_layouts.py `_linear`, `propagate`): a head no rule shards gets
the whole sequence first (`parc.allgather_split`: all-gather forward, this rank's chunk of the gradient
backward), as Megatron gathers before its output layer; a column head gathers at its input like any column
layer. Parallel equals serial on HF Qwen2 and examples/gpt.py with a plain lm head."""

import pytest

from helpers import GPT, ROOT, compile_text, gpt_tp_rules, llama_tp_rules, parallel_vs_serial
from parc.runtime.parallel import ops
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer

QWEN2 = ROOT / "tests" / "models" / "qwen2_tiny.py"
# fp32, dropout 0: the same tolerances and reasons as tests/test_tensor_parallel.py. A gradient summed
# instead of split at the gather would double the head's input gradient: off by far more than 1e-2.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
GPT_HEAD = '    "lm_head"            : vocab\n'
LLAMA_HEAD = '    "lm_head"                         : vocab\n'


def _plan(rules: str) -> str:
    return "mesh tp=2\nbatch global=4 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n" + rules


def _check(verdict):
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained


def _head_input(src: str) -> str:
    """The line of the program that computes the logits with lm_head's weight."""
    return next(line for line in src.splitlines() if "lm_head_weight" in line and "linear" in line and "=" in line)


def _reads_gather(art, gather: str) -> None:
    src = (art.root / "programs" / "stage0_tp1.py").read_text()
    assert f"torch.ops.parc.{gather}.default(" in src
    assert _head_input(src).split("linear.default(")[1].startswith(f"{gather}_default")  # the head reads the gather


@pytest.mark.parametrize("model,rules", [(QWEN2, llama_tp_rules(True).replace(LLAMA_HEAD, "")),
                                         (GPT, gpt_tp_rules(True).replace(GPT_HEAD, ""))], ids=["qwen2", "gpt"])
def test_sp_plain_head_matches_serial(tmp_path, model, rules):
    art = compile_text(_plan(rules), tmp_path / "c", model)
    _reads_gather(art, "allgather_split")
    _check(parallel_vs_serial(art.root, steps=3))


def test_sp_column_head_gathers_at_its_input(tmp_path):
    """A column head is the vocab head's linear (trained in tests/test_tensor_parallel.py): its input is gathered
    like any column layer's, and its logits reach the vocab-parallel cross-entropy."""
    art = compile_text(_plan(gpt_tp_rules(True).replace(GPT_HEAD, '    "lm_head" : column\n')), tmp_path / "c", GPT)
    _reads_gather(art, "allgather_reducescatter")
    assert "vocab_parallel_cross_entropy" in (art.root / "programs" / "stage0_tp1.py").read_text()


def _count_body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 0)
    with ops.record() as log:
        trainer.step(0)
    return log


def test_plain_head_gathers_once_each_way(tmp_path):
    """One all-gather of the head's input forward; backward takes a chunk (no communication), where a
    column head's reduce-scatter would sum the gradients of ranks that each computed the whole head."""
    plan = _plan(gpt_tp_rules(True).replace(GPT_HEAD, "")).replace("global=4", "global=2")
    with_vocab = _plan(gpt_tp_rules(True)).replace("global=4", "global=2")
    plain = spawn(2, _count_body, str(compile_text(plan, tmp_path / "p").root))[0]
    vocab = spawn(2, _count_body, str(compile_text(with_vocab, tmp_path / "v").root))[0]
    # the vocab head gathers its input too (1 fwd, 1 bwd reduce-scatter) and runs a 2-collective cross-entropy
    assert plain.count(("all_gather", "tp", "fwd")) == vocab.count(("all_gather", "tp", "fwd"))
    assert plain.count(("reduce_scatter", "tp", "bwd")) == vocab.count(("reduce_scatter", "tp", "bwd")) - 1
    assert plain.count(("all_reduce", "tp", "fwd")) == vocab.count(("all_reduce", "tp", "fwd")) - 2
