"""Context parallelism × tensor parallelism (issue 28): heads sharded over tp, the sequence over cp. The cp pass
runs first (passes/context_parallel.py: the program's sequence is this cp rank's T/cp tokens), then tensor
parallelism shards that program's heads (passes/tp_layouts.py `_cp_attention`): each tp rank runs its heads'
ring (or all-to-all) in its own cp group. Each plan trained against the serial model."""

import pytest

from helpers import ROOT, compile_text, gpt_tp_rules, llama_tp_rules, parallel_vs_serial
from parc.errors import ParcError

# fp32, as tests/test_cp_compositions.py: ring attention, the cp-summed loss and tp's all-reduces add the same
# numbers in another order (~1e-7 relative on the losses); AdamW magnifies near-zero gradients' rounding to
# ~1e-6 on the parameters after three steps. A wrong head/rank pairing, chunk order or missing reduction (over
# cp or over tp) is 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def _plan(mesh: str, method: str, rules: str) -> str:
    return (f"mesh {mesh}\nbatch global=4 micro=2\ncontext_parallel {method}\n"
            f"optimizer adamw lr=1e-2 clip=1.0\n{rules}")


def _check(verdict):
    print(verdict.render())
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained


@pytest.mark.parametrize("method,sp", [("ring", False), ("alltoall", False), ("ring", True)])
def test_gpt_cp_tp_matches_serial(tmp_path, method, sp):
    # examples/gpt.py: 4 heads, T 32; tp 2 leaves 2 heads a rank, which all-to-all scatters over cp 2.
    # With sequence parallelism the cp-local 16 tokens are cut again over tp (8 a rank between the sharded
    # layers): the sequence is split over cp × tp, all-gathered over tp before each column linear
    art = compile_text(_plan("cp=2 tp=2", method, gpt_tp_rules(sp)), tmp_path / "c")
    src = (art.root / "programs" / "stage0_tp1.py").read_text()
    op = "ring_attention" if method == "ring" else "ulysses_attention"
    assert src.count(f"torch.ops.parc.{op}") == 4 and "vocab_parallel_cross_entropy" in src
    assert ("allgather_reducescatter" in src) == sp
    _check(parallel_vs_serial(art.root, steps=3))


def test_hf_llama_cp_tp_matches_serial(tmp_path):
    # HF Llama: rotary from global positions, GQA by repeat_kv (2 kv heads for 4: one kv head a tp rank),
    # HF's causal mask folded into is_causal; q/k/v/o and the MLP sharded Megatron's way
    art = compile_text(_plan("cp=2 tp=2", "ring", llama_tp_rules()), tmp_path / "c",
                       model=ROOT / "tests" / "models" / "llama_tiny.py")
    _check(parallel_vs_serial(art.root, steps=3))


def test_alltoall_heads_per_tp_rank_not_divisible_by_cp_refused(tmp_path):
    # 4 heads over tp 2 leave 2 a rank; all-to-all would scatter them over cp 4. Compile only (8 ranks)
    with pytest.raises(ParcError) as e:
        compile_text(_plan("cp=4 tp=2", "alltoall", gpt_tp_rules()), tmp_path / "c")
    d = e.value.diagnostics[0]
    assert "4 heads / tp 2 = 2 are not divisible by cp 4" in d.message, d.message
    assert d.span is not None and d.span.line > 0


def test_untested_triples_refused_all_at_once(tmp_path):
    text = _plan("dp=2 pp=2 cp=2 tp=2", "ring", gpt_tp_rules()).replace("batch global=4 micro=2", "batch global=8 micro=2")
    text += "zero stage=1\nprecision bf16\nrecompute \"blocks.*\"\n"
    with pytest.raises(ParcError) as e:
        compile_text(text, tmp_path / "c")
    said = {d.message.split(" with mesh cp")[0]: d.span.line for d in e.value.diagnostics
            if "× tp 2" in d.message}
    lines = text.splitlines()
    assert set(said) == {"pp 2", "dp 2", "zero stage=1", "precision bf16", "recompute"}, said
    for what, line in said.items():  # each at its own statement
        assert what.split()[0].split("=")[0] in lines[line - 1], (what, lines[line - 1])
