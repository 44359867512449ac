"""Compile speed with many programs (parc/compiler.py `compile_program`): the whole-graph passes run once
per tp rank, not once per (stage, tp rank) program, and the fake-tensor shape run of the tp pass runs once
per compile, not once per tp rank; the programs are those of a fresh compile per program."""

import copy

from helpers import GPT, compile_text, gpt_tp_rules
from parc import compiler
from parc.grammar.parser import parse
from parc.passes import PassCtx, pipeline_split, run_passes, tensor_parallel, zero
from parc.trace import load_user_module, trace

PLAN = """
mesh pp=2 tp=2
batch global=4 micro=1
""" + gpt_tp_rules() + """pipeline schedule=1f1b
"""


def test_whole_graph_passes_run_once_per_tp_rank(tmp_path, monkeypatch):
    calls = {"tp": 0, "shapes": 0}
    tp_run, prop = tensor_parallel.run, tensor_parallel._propagate_local_shapes

    def counted_tp(gm, plan, ctx):
        calls["tp"] += 1
        return tp_run(gm, plan, ctx)

    def counted_prop(gm, ctx):
        calls["shapes"] += 1
        return prop(gm, ctx)

    monkeypatch.setattr(compiler, "PASSES", [(n, counted_tp if n == "tensor_parallel" else f) for n, f in compiler.PASSES])
    monkeypatch.setattr(tensor_parallel, "_propagate_local_shapes", counted_prop)
    art = compile_text(PLAN, tmp_path / "c")
    assert len(art.plan["programs"]) == 4 and calls == {"tp": 2, "shapes": 1}

    # each program equals one compiled alone, from its own copy of the graph with every pass re-run
    plan = parse(PLAN, file=str(tmp_path / "test.par"))
    traced = trace(load_user_module(GPT), plan.micro_batch, fast=True)
    pipeline_split.assign_stages(traced, plan, 2)
    for name, prog in art.plan["programs"].items():
        ctx = PassCtx(traced=traced, stage=prog["stage"], tp_rank=prog["tp_rank"],
                      shards={s.name: None for s in traced.state}, notes={"stages": 2})
        gm = run_passes(copy.deepcopy(traced.gm), plan, ctx, [("tensor_parallel", tp_run),
                        ("pipeline_split", pipeline_split.run), ("zero", zero.run)])
        src = gm.graph.python_code(root_module="self").src.replace("device(type='cpu')", "DEVICE")  # as codegen
        alone = [ln.strip() for ln in src.splitlines() if "torch.ops." in ln]
        shared = [ln.strip() for ln in art.programs[name].splitlines() if "torch.ops." in ln and "import" not in ln]
        assert alone and alone == shared, name
        assert {e["name"]: e["shard"] for e in prog["state"]} == {e["name"]: ctx.shards[e["name"]] for e in prog["state"]}
