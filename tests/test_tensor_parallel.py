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


def test_gqa_kv_heads_below_tp_are_said(tmp_path):
    """2 kv heads at tp 4 under `column` rules: each rank computes the kv head its q heads use
    (passes/tp_subset.py), and the plan says so: a warning at the rule (what `parc check` prints), and
    plan.json's `tp_auto_replicated`, which `parc report` prices. tests/test_tp_ops.py trains it against serial."""
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    plan = "mesh tp=4\nbatch global=4 micro=2\n" + LLAMA_RULES
    result = compile_model(LLAMA, parse(plan, file=str(tmp_path / "t.par")), tmp_path / "c")
    said = [w for w in result.warnings if "fewer than tp 4" in w.message]
    # one warning per rule (its first layer); plan.json lists every layer
    assert [w.message.split("`")[3] for w in said] == ["model.layers.0.self_attn.k_proj",
                                                       "model.layers.0.self_attn.v_proj"]
    assert all("2 heads" in w.message and "Megatron's form: 2 ranks a head" in w.message
               and w.severity == "warning" for w in said)
    assert plan.splitlines()[said[0].span.line - 1].strip().startswith('"model.layers.*.self_attn.k_proj"')
    assert plan.splitlines()[said[1].span.line - 1].strip().startswith('"model.layers.*.self_attn.v_proj"')
    for r in range(4):
        prog = result.plan_json["programs"][f"stage0_tp{r}"]
        assert [(x["module"], x["heads"]) for x in prog["tp_auto_replicated"]] == \
            [(f"model.layers.{i}.self_attn.{p}_proj", 2) for i in (0, 1) for p in "kv"]
        assert not any("k_proj" in s["fqn"] and s.get("shard") for s in prog["state"])  # stored whole
    from parc.analysis import report

    rep = report.build(tmp_path / "c", preset="h100")
    assert not any(c["collective"] == "all-gather (partial gradients)" for c in rep["communication"]["rows"])
    assert any(c["collective"] == "all-reduce (partial gradients)" and c["axis"] == "tp" for c in rep["communication"]["rows"])
    note = next(n for n in rep["notes"] if "fewer kv heads than tp" in n)
    assert "model.layers.1.self_attn.v_proj" in note and "ms to the step" in note


def test_gqa_kv_heads_not_dividing_tp_are_kept_whole_and_said(tmp_path):
    """2 kv heads at tp 3 (6 q heads): a rank's q heads straddle two kv heads' groups, so the pass keeps k and v
    whole (passes/tp_gqa.py): said at the rule, listed, and the repeated k and v's gradients all-gathered."""
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    plan = "mesh tp=3\nbatch global=4 micro=2\n" + LLAMA_RULES.replace(  # vocab 256: not divisible by 3
        '    "model.embed_tokens"              : vocab\n', "").replace('    "lm_head"                         : vocab\n', "")
    result = compile_model(ROOT / "tests" / "models" / "llama_gqa6.py", parse(plan, file=str(tmp_path / "t.par")),
                           tmp_path / "c")
    said = [w for w in result.warnings if "fewer than tp 3" in w.message]
    assert len(said) == 2 and all("whole on every tp rank" in w.message for w in said)
    prog = result.plan_json["programs"]["stage0_tp1"]
    assert {(x["form"], x["heads_per_rank"]) for x in prog["tp_auto_replicated"]} == {("whole", 2)}
    assert {g["module"] for g in prog["tp_grad_gathers"]} >= {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    from parc.analysis import report

    rep = report.build(tmp_path / "c", preset="h100")
    assert any(c["collective"] == "all-gather (partial gradients)" and c["axis"] == "tp" for c in rep["communication"]["rows"])


def test_kv_subset_falls_back_to_whole_where_it_cannot_follow(tmp_path):
    """OLMo 2 normalizes k over its whole width (all kv heads): one kv head a rank cannot compute that norm, so
    at tp 4 (2 kv heads) the pass keeps k and v whole, as without the kv-subset form, and says why.
    bench/zoo's `olmo2 tp4` trains it against serial."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.zoo import families, plans, rules
    from parc.compiler import compile_model
    from parc.grammar.parser import parse

    model = families.model_file("olmo2", tmp_path / "model")
    text = plans.text(plans.PLANS["tp4"], rules.block(rules.derive("olmo2", "hf", model), False))
    result = compile_model(model, parse(text, file=str(tmp_path / "t.par")), tmp_path / "c")
    prog = result.plan_json["programs"]["stage0_tp2"]
    assert {(x["form"], x["heads"]) for x in prog["tp_auto_replicated"]} == {("whole", 2)}
    said = [w.message for w in result.warnings if "fewer than tp 4" in w.message]
    assert said and all("kv-subset form (one kv head a rank) stopped at" in m and "kv subset" in m for m in said)


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
