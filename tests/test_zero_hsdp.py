"""HSDP (`zero stage=N shard=K`): parallel equals serial, and memory and traffic per group equal the formulas.

One world of 4 gloo ranks (dp 4, shard 2: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and
{1, 3}) trains stages 1–3 × fp32/bf16 for three steps with accumulation 2 and `clip=`, while a wrapper
around the collectives adds up the bytes each rank sends, per collective and per group. Each step must
send exactly runtime/parallel/zero.py's formulas: reduce-scatter and all-gather inside the shard group,
one all-reduce of the reduced ranges across the replicate group, and the clip norm's scalar over dp.
Held bytes after the last step equal `analytic_bytes` with N = K, and `parc report`'s memory. The plan language (errors, warning,
printing) and the groups are checked in one process.
"""

import pytest

from helpers import ROOT, compile_text
from parc import artifact, mesh as meshlib
from parc.errors import PlanError
from parc.grammar.parser import parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate
from parc.runtime.launch import spawn
from parc.runtime.memory import held_state
from parc.runtime.parallel.zero import analytic_bytes, analytic_comm_parts
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module
from test_zero import BF16_TOL, LOSS_TOL, PARAM_TOL, steps_recorded

STEPS = 3
MODELS = ROOT / "tests" / "models"
DP, SHARD = 4, 2
FP32 = "optimizer adamw lr=1e-2 clip=0.5\n"
# bf16 at lr 1e-3 against the serial bf16 model: tests/test_zero.py's BF16_TOL, for its reasons
BF16 = "precision bf16\noptimizer adamw lr=1e-3 clip=1.0\n"
PLANS = {f"zero{s}_{p}": f"mesh dp={DP}\nbatch global=16 micro=2\nzero stage={s} shard={SHARD}\n"
         + (FP32 if p == "fp32" else BF16) for s in (1, 2, 3) for p in ("fp32", "bf16")}


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        local, sent_per_step = steps_recorded(trainer, STEPS, by_group=True)
        out[name] = {"losses": trainer.global_losses(local), "state": trainer.gathered_state(),
                     "sent": sent_per_step, "memory": held_state(trainer),
                     "backward_numel": trainer.zero.backward_gathered_numel()}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    arts = {n: compile_text(text, tmp_path_factory.mktemp(n) / "c") for n, text in PLANS.items()}
    res = spawn(DP, _body, {n: str(a.root) for n, a in arts.items()})
    return arts, res


@pytest.mark.parametrize("name", list(PLANS))
def test_hsdp_matches_serial(trained, name):
    arts, res = trained
    art = arts[name]
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    got = res[0][name]
    assert serial_losses[0] != serial_losses[-1]
    if name.endswith("bf16"):
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state, BF16_TOL)
        assert verdict.ok, verdict.render()
    else:
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state)
        assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()


@pytest.mark.parametrize("name", list(PLANS))
def test_hsdp_memory_and_traffic_per_group(trained, name):
    arts, res = trained
    plan = arts[name].plan
    table = plan["programs"]["stage0_tp0"]["zero"]
    bf16 = name.endswith("bf16")
    assert table["shard_size"] == SHARD and table["dp"] == DP
    kind_of = {tuple(g): kind for kind in ("zero_shard", "zero_replicate", "dp") for g in plan["groups"][kind]}
    assert plan["groups"]["zero_shard"] == [[0, 1], [2, 3]]
    assert plan["groups"]["zero_replicate"] == [[0, 2], [1, 3]]
    again = res[0][name]["backward_numel"] if table["stage"] == 3 else None
    assert all(r[name]["backward_numel"] == res[0][name]["backward_numel"] for r in res)
    parts = analytic_comm_parts(table, accumulation=2, backward_numel=again, gather_elem=2 if bf16 else None)
    want = {("reduce_scatter_tensor", "zero_shard"): parts["reduce_scatter"],
            ("all_gather_into_tensor", "zero_shard"): parts["all_gather"],
            ("all_reduce", "zero_replicate"): parts["all_reduce"],
            ("all_reduce", "dp"): 2 * 4 * (DP - 1) // DP}   # clip's global norm: one fp32 scalar over dp
    psi = sum(b["padded"] for b in table["buckets"])
    # the replicas' all-reduce moves this rank's ranges only: Ψ'/K elements, not the Ψ' of flat ZeRO
    assert parts["all_reduce"] == 2 * (psi // SHARD) * 4 * (DP // SHARD - 1) // (DP // SHARD)
    want_mem = analytic_bytes(table, compute_elem=2 if bf16 else None)
    for rank, r in enumerate(res):
        for sent in r[name]["sent"]:
            by_kind: dict = {}
            for (coll, ranks), b in sent.items():
                key = (coll, kind_of[ranks])
                by_kind[key] = by_kind.get(key, 0) + b
            assert by_kind == want, (rank, by_kind, want)
        assert r[name]["memory"] == want_mem, (rank, r[name]["memory"], want_mem)
    # `parc report` on this artifact prices the same bytes (examples/gpt.py's buckets need no padding)
    from parc.analysis import report

    row = report.build(arts[name].root)["memory"]["per_pp_rank"][0]
    assert {k: row[f"{k}_bytes"] for k in want_mem} == want_mem, (row, want_mem)
    per_param = sum(want_mem.values()) / psi
    print(f"\n{name}: {per_param:g} bytes/param held (K={SHARD}); sent per step {want}")


def test_shard_divides_dp_and_every_error_is_located():
    text = "mesh dp=6\nbatch global=12 micro=2\nzero stage=0 shard=4\n"
    with pytest.raises(PlanError) as err:
        validate(parse(text, file="bad.par"))
    found = [(d.message, d.span.line, d.span.col) for d in err.value.diagnostics]
    assert any("nothing is sharded" in m and line == 3 for m, line, _ in found), found
    assert any("zero shard 4 does not divide mesh dp 6" in m and "6 % 4 = 2" in m and (line, col) == (3, 20)
               for m, line, col in found), found
    assert any("1, 2, 3, 6" in (d.hint or "") for d in err.value.diagnostics)
    with pytest.raises(PlanError) as err:
        validate(parse("mesh dp=4\nzero stage=2 shard=0\n", file="zero.par"))
    assert "zero shard must be a positive integer, got 0" in err.value.diagnostics[0].message
    # under a topology, a shard group across nodes is warned about, at shard=
    plan = parse("mesh dp=8\ntopology nodes=2 gpus_per_node=4\nzero stage=3 shard=8\n", file="x.par")
    (warn,) = validate(plan)
    assert warn.severity == "warning" and "spans nodes" in warn.message and (warn.span.line, warn.span.col) == (3, 20)
    assert "(4 here)" in warn.hint
    assert validate(parse("mesh dp=8\ntopology nodes=2 gpus_per_node=4\nzero stage=3 shard=4\n")) == []


def test_shard_round_trips_and_groups_follow_the_mesh_order():
    plan = parse("mesh dp=4 tp=2\nzero stage=3 shard=2\n")
    assert plan.zero.shard == 2 and "zero stage=3 shard=2" in format_plan(plan)
    assert parse(format_plan(plan)) == plan
    # default order tp,pp,dp: dp coordinates are 2 ranks apart; a shard group is 2 consecutive dp coordinates
    groups = meshlib.zero_groups(plan.mesh, 2)
    assert groups["zero_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["zero_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert meshlib.shard_sizes_in_node(plan.mesh, 4) == [1, 2]
    assert meshlib.shard_sizes_in_node(plan.mesh, 8) == [1, 2, 4]


# --- with tp and pp: 4 ranks leave dp 2, so shard=1 (every rank holds the whole state, replicated over dp 2): the
# shard-group collectives above become local copies, and what is proven here is the composition: the replicate
# all-reduce, the global norm counted once per range over dp × tp × pp, tied copies summed over the shard group,
# tp-partial sums on the ranges. Tolerances: tests/test_zero_combos.py's, for its reasons.
TP_RULES = """tensor_parallel {
    "blocks.*.attn.qkv": column
    "blocks.*.attn.proj": row
    "blocks.*.mlp.fc": column
    "blocks.*.mlp.proj": row
}"""
COMBOS = {  # the pipeline case trains a tied embedding / head: its two copies are summed over pp and the shard group
    "zero1_pp2_1f1b_tied": "mesh dp=2 pp=2\nbatch global=8 micro=2\nzero stage=1 shard=1\npipeline schedule=1f1b\n" + FP32,
    "zero3_tp2": f"mesh dp=2 tp=2\nbatch global=8 micro=2\nzero stage=3 shard=1\n{TP_RULES}\n" + FP32,
    "zero2_tp2_bf16": f"mesh dp=2 tp=2\nbatch global=8 micro=2\nzero stage=2 shard=1\n{TP_RULES}\n" + BF16,
}
COMBO_BF16_TOL = 4e-3  # tests/test_zero_combos.py: tp rounds each row layer's partial product to bf16 before the sum


def _combo_body(ctx, roots: list[str]):
    out = []
    for root in roots:
        trainer = Trainer.load(root, 0)
        losses = trainer.global_losses([trainer.step(s).loss for s in range(STEPS)])
        out.append({"losses": losses, "state": trainer.gathered_state()})
    return out


def test_hsdp_with_tp_and_pp_matches_serial(tmp_path):
    roots = {n: compile_text(t, tmp_path / n / "c", **({"model": MODELS / "gpt_tied.py"} if "tied" in n else {})).root
             for n, t in COMBOS.items()}
    res = spawn(4, _combo_body, [str(r) for r in roots.values()])[0]
    for (name, root), got in zip(roots.items(), res):
        art = artifact.load(root)
        assert art.plan["groups"]["zero_replicate"] and art.plan["plan"]["zero_shard"] == 1
        assert bool(art.plan.get("tied")) == ("tied" in name)
        serial_losses, serial_state = train_serial(load_user_module(root / "model/model.py"), art.plan, 0, STEPS)
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state,
                          *((COMBO_BF16_TOL,) if name.endswith("bf16") else ()))
        if name.endswith("bf16"):
            assert verdict.ok, (name, verdict.render())
        else:
            assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, (name, verdict.render())


def _report(tmp_path, zero: str) -> dict:
    from parc.analysis import report

    path = tmp_path / f"{zero.replace(' ', '_').replace('=', '')}.par"
    path.write_text("mesh dp=8\ntopology nodes=2 gpus_per_node=4 preset=h100\nbatch global=32 micro=4\n"
                    f"zero {zero}\nprecision bf16\n")
    return report.build(model=ROOT / "examples" / "gpt.py", plan=path)


def test_report_prices_hsdp_on_intra_and_inter_node_links(tmp_path):
    """dp 8 over 2 nodes of 4: plain ZeRO-3's groups cross nodes; shard=4 keeps its reduce-scatters and gathers
    on one node and sends only the all-reduce of 1/4 of the gradients between nodes; state memory ×2 (1/4, not 1/8)."""
    flat, hsdp = _report(tmp_path, "stage=3"), _report(tmp_path, "stage=3 shard=4")
    assert hsdp["plan"]["zero_shard"] == 4 and flat["plan"]["zero_shard"] == 8
    rows = {r["collective"]: r for r in hsdp["communication"]["rows"] if r["axis"] == "dp"}
    assert set(rows) == {"reduce-scatter", "all-gather", "all-reduce"}
    assert rows["reduce-scatter"]["group"] == rows["all-gather"]["group"] == 4 and rows["all-reduce"]["group"] == 2
    assert rows["reduce-scatter"]["inter_bytes"] == rows["all-gather"]["inter_bytes"] == 0
    assert rows["all-reduce"]["intra_bytes"] == 0
    # the formulas of runtime/parallel/zero.py, on the report's parameter count P (one micro-batch a step here):
    # reduce-scatter P·4·(K−1)/K in fp32, all-reduce 2·(P/K)·4·(R−1)/R
    params = hsdp["memory"]["per_pp_rank"][0]["params_count"]
    assert rows["reduce-scatter"]["bytes_per_rank"] == round(params * 4 * 3 / 4)
    assert rows["all-reduce"]["bytes_per_rank"] == round(2 * params * 4 / 4 * 1 / 2)
    flat_rows = {r["collective"]: r for r in flat["communication"]["rows"] if r["axis"] == "dp"}
    assert flat_rows["reduce-scatter"]["inter_bytes"] > 0 and "all-reduce" not in flat_rows
    inter = sum(r["inter_bytes"] for r in hsdp["communication"]["rows"])
    assert inter < sum(r["inter_bytes"] for r in flat["communication"]["rows"])
    mem, flat_mem = hsdp["memory"]["per_pp_rank"][0], flat["memory"]["per_pp_rank"][0]
    for kind in ("params", "grads", "optimizer"):  # ZeRO-3 holds each 1/K: K = 4 against 8
        assert abs(mem[f"{kind}_bytes"] - 2 * flat_mem[f"{kind}_bytes"]) <= 1, kind


def test_planner_tries_the_largest_in_node_shard():
    from parc.analysis.planner import _zero_choices
    from parc.grammar.plan import Mesh, Topology

    # dp 8 over nodes of 4: each stage ≥ 1 also with shard 4
    assert _zero_choices(Mesh(8, 1, 1), Topology(2, 4)) == [(z, None) for z in range(4)] + [(z, 4) for z in (1, 2, 3)]
    # dp inside one node: plain ZeRO only; tp 4 fills each node, so dp neighbours are on other nodes: none fits
    assert _zero_choices(Mesh(4, 1, 1), Topology(1, 8)) == [(z, None) for z in range(4)]
    assert _zero_choices(Mesh(4, 1, 4), Topology(4, 4)) == [(z, None) for z in range(4)]


def test_hsdp_with_expert_parallelism_is_refused_at_shard():
    from parc.analysis import support

    plan = parse('mesh dp=4 ep=2\nbatch global=8 micro=2\nexpert_parallel {\n    "blocks.*.moe.experts"\n}\n'
                 "zero stage=1 shard=2\n", file="moe.par")
    with pytest.raises(PlanError) as err:
        support.check(plan)
    (d,) = err.value.diagnostics
    assert "zero shard=2 with expert parallelism" in d.message and (d.span.line, d.span.col) == (6, 20)



# --- shard groups of 2 beside tp and pp: 8 ranks, dp 4. The shard groups are dp coordinates 0-1 and 2-3 of each
# (pp, tp) position (parc/mesh.py zero_groups, in mesh order), so each group's ranks hold the same tp shard and
# pp stage; this is what the shard=1 cases above cannot show. Tolerances as above.
COMBOS_8 = {
    "zero3_dp4_tp2_shard2": f"mesh dp=4 tp=2\nbatch global=8 micro=2\nzero stage=3 shard=2\n{TP_RULES}\n" + FP32,
    "zero1_dp4_pp2_shard2": "mesh dp=4 pp=2\nbatch global=8 micro=1\nzero stage=1 shard=2\npipeline schedule=1f1b\n"
                            + FP32,
}


def test_hsdp_shard2_with_tp_and_pp_matches_serial(tmp_path):
    roots = {n: compile_text(t, tmp_path / n / "c").root for n, t in COMBOS_8.items()}
    res = spawn(8, _combo_body, [str(r) for r in roots.values()])[0]
    for (name, root), got in zip(roots.items(), res):
        art = artifact.load(root)
        assert art.plan["plan"]["zero_shard"] == 2 and art.plan["groups"]["zero_replicate"]
        serial_losses, serial_state = train_serial(load_user_module(root / "model/model.py"), art.plan, 0, STEPS)
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state)
        assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, (name, verdict.render())
