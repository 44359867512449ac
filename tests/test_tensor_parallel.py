"""Tensor parallelism (passes/tensor_parallel.py): parallel equals serial, shards are 1/tp, errors are clear."""

import pytest

from helpers import ROOT, compile_text, gpt_tp_rules, llama_tp_rules, parallel_vs_serial
from parc.errors import ParcError

# fp32, dropout 0. TP sums the same products in another order (a matmul split
# over input features and then all-reduced; a softmax over a vocabulary split
# across ranks), which moves losses by ~1e-7 relative. Parameters after three
# AdamW steps at lr 1e-2 agree to ~1e-5 model-wide: Adam divides each gradient
# by its own magnitude, magnifying the rounding of near-zero gradients (see
# runtime/verify.py). A wrong shard or a missing all-reduce is 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4

LLAMA = ROOT / "tests" / "models" / "llama_tiny.py"
LLAMA_RULES = llama_tp_rules()


def gpt_plan(tp: int, sp: bool = False, clip: str = "clip=1.0") -> str:
    return f"mesh tp={tp}\nbatch global=4 micro=2\noptimizer adamw lr=1e-2 {clip}\n" + \
        gpt_tp_rules(sp)


def _check(verdict):
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_gpt_tp_matches_serial(tmp_path, tp, sp):
    _check(parallel_vs_serial(compile_text(gpt_plan(tp, sp), tmp_path / "c").root, steps=3))


def test_llama_tp2_matches_serial(tmp_path):
    plan = "mesh tp=2\nbatch global=4 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n" + LLAMA_RULES
    _check(parallel_vs_serial(compile_text(plan, tmp_path / "c", model=LLAMA).root, steps=3))


def test_sharded_params_are_one_over_tp(tmp_path):
    import math

    serial = compile_text("mesh tp=1\nbatch global=4 micro=2\n", tmp_path / "s").plan
    full = {e["fqn"]: math.prod(e["shape"]) for e in serial["programs"]["stage0_tp0"]["state"]}
    for tp in (2, 4):
        plan = compile_text(gpt_plan(tp), tmp_path / f"t{tp}").plan
        for r in range(tp):
            for e in plan["programs"][f"stage0_tp{r}"]["state"]:
                local = math.prod(e["shape"])
                if e["shard"] is not None:
                    assert local * tp == full[e["fqn"]], e["fqn"]
                else:
                    assert local == full[e["fqn"]]
        sharded = [e["fqn"] for e in plan["programs"]["stage0_tp0"]["state"] if e["shard"]]
        assert "blocks.0.attn.qkv.weight" in sharded and "blocks.0.mlp.proj.weight" in sharded
        assert "wte.weight" in sharded and "lm_head.weight" in sharded
        assert "blocks.0.attn.proj.bias" not in sharded  # a row layer's bias is added once, after the reduction


def test_program_names_collectives(tmp_path):
    art = compile_text(gpt_plan(2, sp=True), tmp_path / "c")
    src = (art.root / "programs" / "stage0_tp1.py").read_text()
    for op in ("allgather_reducescatter", "reducescatter_allgather", "vocab_parallel_cross_entropy",
               "split_allgather"):
        assert f"torch.ops.parc.{op}" in src, op
    assert "cross_entropy_loss" not in src  # full logits are never gathered
    src = (compile_text(gpt_plan(2), tmp_path / "d").root / "programs" / "stage0_tp0.py").read_text()
    assert src.count("torch.ops.parc.identity_allreduce") == 2 * 4 + 1  # f per layer half, + lm head
    assert src.count("torch.ops.parc.allreduce_identity") == 2 * 4 + 1  # g per layer half, + embedding


def test_row_without_sharded_input_is_an_error(tmp_path):
    plan = 'mesh tp=2\nbatch global=4 micro=2\ntensor_parallel {\n    "blocks.*.attn.proj" : row\n}\n'
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c")
    assert "`row` layer `blocks.0.attn.proj` needs its input sharded" in e.value.message
    assert e.value.span.line == 4
    assert "column" in e.value.diagnostics[0].hint


def test_indivisible_width_names_the_arithmetic(tmp_path):
    plan = 'mesh tp=3\nbatch global=4 micro=2\ntensor_parallel {\n    "blocks.*.mlp.fc" : column\n}\n'
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c")
    assert "size 256, not divisible by tp 3" in e.value.message
    assert e.value.span.line == 4


def test_gqa_kv_heads_below_tp_is_an_error(tmp_path):
    plan = "mesh tp=4\nbatch global=4 micro=2\n" + LLAMA_RULES
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c", model=LLAMA)
    assert "2 is not divisible by tp 4" in e.value.message and "kv heads" in e.value.message
    assert "model.layers.0.self_attn" in e.value.message


def test_unprovable_op_names_node_and_module(tmp_path):
    # qkv column alone: its output reaches attention's view fine, but then the
    # attention output (sharded) meets proj, a plain linear, on its features
    plan = 'mesh tp=2\nbatch global=4 micro=2\ntensor_parallel {\n    "blocks.*.attn.qkv" : column\n}\n'
    with pytest.raises(ParcError) as e:
        compile_text(plan, tmp_path / "c")
    assert "linear_1" in e.value.message and "blocks.0.attn.proj" in e.value.message
    assert 'add `"blocks.0.attn.proj" : row`' in e.value.diagnostics[0].hint


def test_tp_one_and_no_rules_leave_the_graph_alone(tmp_path):
    src = (compile_text("mesh tp=2\nbatch global=4 micro=2\n", tmp_path / "c").root
           / "programs" / "stage0_tp0.py").read_text()
    assert "torch.ops.parc" not in src


def test_tp_across_nodes_warns():
    from parc.grammar.parser import parse
    from parc.grammar.validate import validate

    plan = parse("mesh tp=4\ntopology nodes=2 gpus_per_node=2\nbatch global=4 micro=2\n", file="t.par")
    (w,) = [d for d in validate(plan) if "gpus_per_node" in d.message]
    assert "mesh tp 4 > topology gpus_per_node 2" in w.message and w.span.line == 1
