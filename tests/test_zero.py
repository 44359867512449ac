"""ZeRO 1–3: parallel equals serial, and each rank's memory and traffic equal DESIGN.md's formulas.

One spawn per (stage, dp) does all three checks: three steps with accumulation 2
and gradient clipping, while a recording wrapper around the collectives counts
the bytes this rank sends, then the tensors the rank holds after the last step
are summed by kind. Ψ' below is the padded parameter count (each bucket rounded
up to dp equal, aligned ranges); the padding is reported by the test.
"""


import pytest
import torch
import torch.distributed as dist

from helpers import compile_text
from parc.passes import zero as zero_pass
from parc.runtime.launch import spawn
from parc.runtime.memory import storage_bytes
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.runtime.parallel.zero import analytic_bytes, analytic_comm_bytes
from parc.trace import load_user_module, trace

STEPS = 3
# Same tolerances and reasons as tests/test_data_parallel.py: fp32 sums taken in another order
# (micro-batch means, then a reduce-scatter across dp), magnified a little by AdamW.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def _recording(sent: dict, by_group: bool = False):
    """Wrap the collectives ZeRO and the trainer use; add each call's ring volume per rank to `sent[name]`, or with
    `by_group` to `sent[(name, the group's ranks)]` (HSDP: tests/test_zero_hsdp.py)."""
    originals = {name: getattr(dist, name)
                 for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce")}

    def wrap(name, size_of, factor):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            n, t = len(ranks), size_of(args)
            key = (name, ranks) if by_group else name
            sent[key] = sent.get(key, 0) + factor * t.numel() * t.element_size() * (n - 1) // n
            return originals[name](*args, **kwargs)
        return call

    dist.reduce_scatter_tensor = wrap("reduce_scatter_tensor", lambda a: a[1], 1)  # input: the whole flat
    dist.all_gather_into_tensor = wrap("all_gather_into_tensor", lambda a: a[0], 1)  # output: the whole flat
    dist.all_reduce = wrap("all_reduce", lambda a: a[0], 2)
    return originals


def steps_recorded(trainer, steps: int, by_group: bool = False) -> tuple[list, list[dict]]:
    """Train `steps` steps; this rank's losses and, per step, the bytes it sent per collective (`_recording`)."""
    losses, sent_per_step = [], []
    for s in range(steps):
        sent: dict = {}
        originals = _recording(sent, by_group)
        try:
            losses.append(trainer.step(s).loss)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        sent_per_step.append(sent)
    return losses, sent_per_step


def _body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 0)
    local, sent_per_step = steps_recorded(trainer, STEPS)
    held = trainer.zero.held()
    # Adam's per-tensor `step` counters are 0-dim tensors: one scalar per bucket, outside the formula
    scalars = [t for t in held["optimizer"] if t.dim() == 0]
    # stages 2–3 free their gradient ranges after the update: the bytes the last step's were
    memory = {"params": storage_bytes(held["params"]),
              "grads": storage_bytes(held["grads"]) + trainer.zero.released_grad_bytes,
              "optimizer": storage_bytes([t for t in held["optimizer"] if t.dim() > 0]),
              "scalars": storage_bytes(scalars), "stand_ins": storage_bytes(held["stand_ins"])}
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None, "sent": sent_per_step, "memory": memory,
            "backward_numel": trainer.zero.backward_gathered_numel()}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_serial_memory_and_traffic(tmp_path, stage, dp):
    plan = f"""
mesh dp={dp}
batch global={2 * 2 * dp} micro=2      # accumulation 2
zero stage={stage}
optimizer adamw lr=1e-2 clip=0.5
"""
    art = compile_text(plan, tmp_path / "compiled")
    table = art.plan["programs"]["stage0_tp0"]["zero"]
    results = spawn(dp, _body, str(art.root))

    user = load_user_module(art.root / "model" / "model.py")
    serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
    verdict = compare(results[0]["losses"], serial_losses, results[0]["state"], serial_state)
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert serial_losses[0] != serial_losses[-1]

    psi = table["numel"]
    assert psi == art.plan["model"]["param_count"]
    print(f"\nZeRO-{stage} dp {dp}: Ψ {psi}, padding {table['padding']} elements "
          f"({100 * table['padding'] / psi:.2f}%) over {len(table['buckets'])} buckets")
    want_mem = analytic_bytes(table)
    # ZeRO-3 re-gathers in backward only the layers whose weights autograd saved; every rank agrees
    again = results[0]["backward_numel"] if stage == 3 else None
    assert all(r["backward_numel"] == results[0]["backward_numel"] for r in results)
    if stage == 3:
        print(f"  ZeRO-3 backward re-gathers {again} of {sum(b['padded'] for b in table['buckets'])} elements")
    want_comm = analytic_comm_bytes(table, accumulation=2, backward_numel=again)
    clip_bytes = 2 * 4 * (dp - 1) // dp  # the global-norm all-reduce: one fp32 scalar per step
    for rank, r in enumerate(results):
        m = r["memory"]
        assert {k: m[k] for k in want_mem} == want_mem, (rank, m, want_mem)
        assert m["scalars"] <= 4 * len(table["buckets"])
        assert m["stand_ins"] <= 4  # ZeRO-3's shape-only program inputs share one fp32 element
        for sent in r["sent"]:
            assert sent.get("reduce_scatter_tensor", 0) + sent.get("all_gather_into_tensor", 0) == want_comm, sent
            assert sent.get("all_reduce", 0) == clip_bytes, sent
    print(f"  per rank: memory {results[0]['memory']} (bytes); sent per step {results[0]['sent'][0]}")


# bf16 ZeRO-1/2 keep only their range of the fp32 masters (runtime/parallel/zero.py). Each plan trains without
# `clip=` so nothing but the dp reduction differs from plain dp: at dp 2 a reduce-scatter of pre-divided fp32
# halves adds the same two numbers as DP's all-reduce, so ZeRO-1 (fp32 accumulation of the bf16 gradients) and
# ZeRO-2 with one micro-batch must equal bf16 DP bit for bit; ZeRO-2 with two micro-batches sums the reduced
# halves per micro-batch instead (another order), held to serial at bf16's tolerance (tests/test_bf16_layout.py).
BF16 = "mesh dp=2\nbatch global={g} micro=2\n{zero}precision bf16\noptimizer adamw lr=1e-3\n"
BF16_PLANS = {"dp": (8, ""), "zero1": (8, "zero stage=1\n"), "zero2": (8, "zero stage=2\n"),
              "dp_acc1": (4, ""), "zero2_acc1": (4, "zero stage=2\n")}
BF16_TOL = 2e-3


def _bf16_body(ctx, roots: dict[str, str]):
    from parc.runtime.memory import held_state

    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        local, sent_per_step = steps_recorded(trainer, STEPS)
        held = held_state(trainer) if trainer.zero else None  # StepCasts copies included: none under ZeRO
        losses, state = trainer.global_losses(local), trainer.gathered_state()
        out[name] = {"losses": losses, "state": state, "sent": sent_per_step, "memory": held,
                     "weights": {p.dtype for p in trainer.params.values()}}
    return out


def test_bf16_zero_shards_the_masters(tmp_path):
    """bf16 ZeRO-1/2 on 2 ranks: per-rank bytes are 6 + 12/N (ZeRO-1) and 2 + 16/N (ZeRO-2) per parameter,
    the post-step all-gather moves bf16, and the numbers are bf16 DP's (bitwise) or serial's (tolerance)."""
    arts = {n: compile_text(BF16.format(g=g, zero=z), tmp_path / n) for n, (g, z) in BF16_PLANS.items()}
    res = spawn(2, _bf16_body, {n: str(a.root) for n, a in arts.items()})
    for name in ("zero1", "zero2", "zero2_acc1"):
        table = arts[name].plan["programs"]["stage0_tp0"]["zero"]
        psi, n = sum(b["padded"] for b in table["buckets"]), table["dp"]
        acc = 2 if BF16_PLANS[name][0] == 8 else 1
        want = analytic_bytes(table, compute_elem=2)
        want_comm = analytic_comm_bytes(table, accumulation=acc, gather_elem=2)
        for rank, r in enumerate(res):
            m = r[name]["memory"]
            assert m == want, (name, rank, m, want)
            assert r[name]["weights"] == {torch.bfloat16}  # the program computes with the bf16 flat buffer
            for sent in r[name]["sent"]:
                assert sent.get("reduce_scatter_tensor", 0) + sent.get("all_gather_into_tensor", 0) == want_comm
                assert sent.get("all_gather_into_tensor", 0) == 2 * psi * (n - 1) // n  # bf16: half of fp32's
        per_param = sum(res[0][name]["memory"].values()) / psi
        formula = 6 + 12 / n if table["stage"] == 1 else 2 + 16 / n
        print(f"\nbf16 ZeRO-{table['stage']} dp {n}: {per_param:g} bytes/param held, formula {formula:g}; "
              f"{res[0][name]['memory']}")
        assert per_param == formula
    for zero_name, dp_name in (("zero1", "dp"), ("zero2_acc1", "dp_acc1")):
        a, b = res[0][zero_name], res[0][dp_name]
        assert a["losses"] == b["losses"], zero_name
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in b["state"]), zero_name
    art = arts["zero2"]
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    for name in ("zero1", "zero2"):
        verdict = compare(res[0][name]["losses"], serial_losses, res[0][name]["state"], serial_state, BF16_TOL)
        assert verdict.ok, (name, verdict.render())


def test_partition_table_is_balanced_and_aligned():
    """The pass alone, in one process: every parameter placed once, equal aligned ranges, layer buckets."""
    from helpers import GPT
    from parc.grammar.parser import parse

    plan = parse("mesh dp=4\nbatch global=8 micro=2\nzero stage=3\n")
    traced = trace(load_user_module(GPT), plan.micro_batch)
    table = zero_pass.partition(traced.gm, traced.state, {}, 3, 4)
    names = [p["name"] for b in table["buckets"] for p in b["params"]]
    params = [s.name for s in traced.state if s.kind == "param"]
    assert sorted(names) == sorted(params)
    assert table["numel"] == traced.param_count
    for b in table["buckets"]:
        assert b["padded"] == 4 * b["shard"] and b["shard"] % zero_pass.ALIGN == 0
        assert 0 <= b["padded"] - b["numel"] < 4 * zero_pass.ALIGN
        ends = [p["offset"] + p["numel"] for p in b["params"]]
        assert [p["offset"] for p in b["params"]] == [0] + ends[:-1]  # packed back to back
    units = [b["unit"] for b in table["buckets"]]
    # backward-ready order: the loss end of the model first, the embeddings last
    assert units[0] in ("lm_head", "ln_f") and set(units[-2:]) == {"wte", "wpe"}
    assert "blocks.3" in units and units.index("blocks.3") < units.index("blocks.0")
    # the pass: stage 3 inserts one gather per bucket and leaves no placeholder read elsewhere
    import copy

    from parc.passes import PassCtx

    ctx = PassCtx(traced=traced, shards={s.name: None for s in traced.state})
    gm = zero_pass.run(copy.deepcopy(traced.gm), plan, ctx)
    gathers = [n for n in gm.graph.nodes if n.target is torch.ops.parc.zero_unshard.default]
    assert len(gathers) == len(table["buckets"]) and ctx.notes["zero"] == table
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in params:
            assert [u.target for u in n.users] == [torch.ops.parc.zero_unshard.default]
    # stage 0: no table, graph untouched
    ctx0 = PassCtx(traced=traced)
    plan0 = parse("mesh dp=4\nbatch global=8 micro=2\n")
    assert zero_pass.run(traced.gm, plan0, ctx0) is traced.gm and "zero" not in ctx0.notes


def _dp_traffic_body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 0)
    return steps_recorded(trainer, 2)[1]


@pytest.mark.parametrize("dp", [2, 4])
def test_plain_dp_sends_the_all_reduce_volume(tmp_path, dp):
    """DP (no ZeRO), accumulation 2: one ring all-reduce of the gradients per step, 2Ψ(N−1)/N × 4 bytes."""
    art = compile_text(f"mesh dp={dp}\nbatch global={4 * dp} micro=2\n", tmp_path / "c")
    psi = art.plan["model"]["param_count"]
    for sent in spawn(dp, _dp_traffic_body, str(art.root))[0]:
        assert sent == {"all_reduce": 2 * 4 * psi * (dp - 1) // dp}, (sent, psi)
