"""ZeRO-Offload (`zero stage=N offload=cpu`): parallel equals serial, and offload changes no bit.

One world of 2 gloo ranks trains ZeRO-1/2/3 × fp32/bf16, each with and without `offload=cpu`, for three
steps with accumulation 2, weight decay (two decay groups over the ranges) and `clip=`. On this CPU-only
machine the "device" is the CPU and the host buffers are separate tensors, so the run goes through every
copy of runtime/parallel/offload.py. Checked:

- against the serial model: tests/test_zero.py's tolerances, for its reasons (the reduce-scatter sums the
  two ranks' gradients in another order than the serial backward; bf16 rounds differently);
- against the same plan without offload: bitwise (losses and every parameter). The host step runs the
  same elementwise update on the same fp32 values (torch's foreach kernels equal its per-tensor loop bit
  for bit), so any difference is a bug of the copies, not rounding;
- device memory: `held_state` equals `analytic_bytes` with the optimizer state gone, and the host holds
  exactly `analytic_host_bytes` (masters, gradient buffers, Adam's moments), in tensors of their own;
- the gradient download overlaps backward: every bucket's copy started during backward and the step used
  it, clipping's coefficient applied on the host (`reused`), and still no bit differs.

With tp and pp (4 ranks: ZeRO-3 and ZeRO-2 bf16 with tp 2, ZeRO-2 GPipe and ZeRO-1 1F1B bf16 with pp 2) offload
must again change no bit against the same plan without it (tests/test_zero_combos.py proves those against serial).
The host step's skip on a nonfinite flag, the plan language's errors and refusals, the report's pricing and
`parc plan`'s last resort are checked in one process.

Checkpoints (whole tensors, runtime/checkpoint/sharded.py) stay plan-independent: one saved with offload
resumes without it and back, bitwise; kill-and-resume under offload is bitwise (tests/test_resume_exact.py's
method).
"""

import shutil

import pytest
import torch

from helpers import checkpoint_differences, checkpoint_leg, checkpoint_sessions, compile_text
from parc.errors import PlanError
from parc.grammar.parser import parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.memory import held_state
from parc.runtime.parallel.zero import analytic_bytes, analytic_host_bytes
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module
from test_zero import BF16_TOL, LOSS_TOL, PARAM_TOL

STEPS = 3
DP = 2
FP32 = "optimizer adamw lr=1e-2 weight_decay=0.1 clip=0.5\n"
BF16 = "precision bf16\noptimizer adamw lr=1e-3 weight_decay=0.1 clip=1.0\n"
PLANS = {f"zero{s}_{p}{'_offload' if o else ''}":
         f"mesh dp={DP}\nbatch global=8 micro=2\nzero stage={s}{' offload=cpu' if o else ''}\n"
         + (FP32 if p == "fp32" else BF16)
         for s in (1, 2, 3) for p in ("fp32", "bf16") for o in (False, True)}
OFFLOADED = [n for n in PLANS if n.endswith("_offload")]


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        local = [trainer.step(s).loss for s in range(STEPS)]
        host = trainer.zero.offload
        out[name] = {"reused": (host.reused, len(host.grads)) if host else None,"losses": trainer.global_losses(local), "state": trainer.gathered_state(),
                     "memory": held_state(trainer), "host": host.host_bytes() if host else None,
                     # the host masters are tensors of their own, in host memory, not the device ranges
                     "separate": host is not None and all(
                         h.device.type == "cpu" and h.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
                         for h, d in zip(host.master, trainer.zero.master))}
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    arts = {n: compile_text(text, tmp_path_factory.mktemp(n) / "c") for n, text in PLANS.items()}
    res = spawn(DP, _body, {n: str(a.root) for n, a in arts.items()})
    return arts, res


@pytest.mark.parametrize("name", OFFLOADED)
def test_offload_matches_serial(trained, name):
    arts, res = trained
    art = arts[name]
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    got = res[0][name]
    assert serial_losses[0] != serial_losses[-1]
    if "bf16" in name:
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state, BF16_TOL)
        assert verdict.ok, verdict.render()
    else:
        verdict = compare(got["losses"], serial_losses, got["state"], serial_state)
        assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()


@pytest.mark.parametrize("name", OFFLOADED)
def test_offload_changes_no_bit_and_moves_the_state_to_the_host(trained, name):
    arts, res = trained
    plain = name.removesuffix("_offload")
    table = arts[name].plan["programs"]["stage0_tp0"]["zero"]
    assert table["offload"] == "cpu" and "offload" not in arts[plain].plan["programs"]["stage0_tp0"]["zero"]
    for rank, r in enumerate(res):
        got, want = r[name], r[plain]
        assert got["losses"] == want["losses"], (rank, got["losses"], want["losses"])
        assert got["state"].keys() == want["state"].keys()
        bad = [k for k in want["state"] if not torch.equal(got["state"][k], want["state"][k])]
        assert not bad, (rank, bad)
        assert got["separate"]
        reused, buckets = got["reused"]  # each copy made during backward, clipped on the host, used
        assert reused == buckets > 0, got["reused"]
        bf16 = "bf16" in name
        device = analytic_bytes(table, compute_elem=2 if bf16 else None)
        assert device["optimizer"] == 0
        assert got["memory"] == device, (rank, got["memory"], device)
        assert want["memory"]["optimizer"] > 0
        if bf16:  # the fp32 master ranges left the device too (stage 3 keeps a bf16 range for its gathers)
            masters = sum(b["padded"] for b in table["buckets"]) * (4 if table["stage"] < 3 else 2) // DP
            assert got["memory"]["params"] == want["memory"]["params"] - masters
        else:
            assert got["memory"]["params"] == want["memory"]["params"]
        assert got["host"] == analytic_host_bytes(table), (rank, got["host"])
    # `parc report` on the artifact: the device rows are what the rank held, the host row what it kept there
    from parc.analysis import report

    row = report.build(arts[name].root)["memory"]["per_pp_rank"][0]
    assert {k: row[f"{k}_bytes"] for k in device} == device, (row, device)
    assert row["host_bytes"] == sum(analytic_host_bytes(table).values())
    plain_row = report.build(arts[plain].root)["memory"]["per_pp_rank"][0]
    assert row["offload_frees_bytes"] == sum(plain_row[f"{k}_bytes"] - row[f"{k}_bytes"] for k in device) > 0
    assert row["total_bytes"] == plain_row["total_bytes"] - row["offload_frees_bytes"]


# --- with tp and pp: 4 ranks. tests/test_zero_combos.py proves these plans (without offload) against the serial
# model; here each runs with and without offload and must agree bit for bit: the tp-partial and tied-weight sums
# and the global norm over dp × tp × pp write the device's gradient ranges before the download, as without offload.
from test_zero_combos import TP_RULES  # noqa: E402

COMBOS = {
    "zero3_tp2": f"mesh dp=2 tp=2\nbatch global=8 micro=2\nzero stage=3\n{TP_RULES}\n" + FP32,
    "zero2_tp2_bf16": f"mesh dp=2 tp=2\nbatch global=8 micro=2\nzero stage=2\n{TP_RULES}\n" + BF16,
    "zero2_pp2_gpipe": "mesh dp=2 pp=2\nbatch global=8 micro=2\nzero stage=2\npipeline schedule=gpipe\n" + FP32,
    "zero1_pp2_1f1b_bf16": "mesh dp=2 pp=2\nbatch global=8 micro=2\nzero stage=1\npipeline schedule=1f1b\n" + BF16,
}


def _combo_body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        out[name] = {"losses": trainer.global_losses([trainer.step(s).loss for s in range(STEPS)]),
                     "state": trainer.gathered_state(), "offloaded": trainer.zero.offload is not None}
    return out


def test_offload_with_tp_and_pp_changes_no_bit(tmp_path):
    roots = {}
    for name, text in COMBOS.items():
        for suffix, offload in (("", ""), ("_offload", " offload=cpu")):
            plan = text.replace("zero stage=1", f"zero stage=1{offload}").replace("zero stage=2", f"zero stage=2{offload}") \
                .replace("zero stage=3", f"zero stage=3{offload}")
            roots[name + suffix] = str(compile_text(plan, tmp_path / (name + suffix)).root)
    res = spawn(4, _combo_body, roots)
    for rank, r in enumerate(res):
        for name in COMBOS:
            got, want = r[name + "_offload"], r[name]
            assert got["offloaded"] and not want["offloaded"]
            assert got["losses"] == want["losses"], (rank, name, got["losses"], want["losses"])
            bad = [k for k in want["state"] if not torch.equal(got["state"][k], want["state"][k])]
            assert not bad, (rank, name, bad)


def test_host_step_skips_where_found_and_copies_between_separate_buffers():
    """`--on-nonfinite skip` under offload: the device flag reaches the host step, which then leaves the host
    masters, Adam's state and the device ranges as they were; an ordinary step equals torch's AdamW on the range."""
    from parc.runtime.parallel.offload import HostOptimizer

    bucket = {"shard": 8, "params": [{"name": "w", "offset": 0, "numel": 8}]}
    device = [torch.arange(8, dtype=torch.float32)]
    host = HostOptimizer(device, [bucket], 0, {}, lambda groups: torch.optim.AdamW(groups, lr=0.1))
    assert host.master[0].data_ptr() != device[0].data_ptr() and torch.equal(host.master[0], device[0])
    ref = device[0].clone().requires_grad_()
    ref_opt = torch.optim.AdamW([ref], lr=0.1)
    device[0].grad = ref.grad = torch.linspace(-1, 1, 8)
    host.step(torch.zeros(()))
    ref_opt.step()
    assert torch.equal(device[0], ref.detach()) and torch.equal(host.master[0], ref.detach())
    before = (device[0].clone(), {k: v.clone() for k, v in host.pieces.state(host.optimizer, 0).items()})
    device[0].grad = torch.full((8,), float("nan"))
    host.step(torch.ones(()))  # a rank saw a nan: skip
    assert torch.equal(device[0], before[0]) and torch.equal(host.master[0], before[0])
    after = host.pieces.state(host.optimizer, 0)
    assert all(torch.equal(after[k], v) for k, v in before[1].items())


def test_an_early_copy_is_used_only_if_nothing_but_declared_multiplies_wrote_its_gradient():
    """`download` during backward, then the step: a declared multiply (clip, 1/S) is applied to the host copy;
    any other in-place write of the range since the copy (here through a view, as a tp-partial sum writes)
    makes the step copy it again. Either way the host sees exactly the device's final gradient."""
    from parc.runtime.parallel.offload import HostOptimizer

    bucket = {"shard": 8, "params": [{"name": "w", "offset": 0, "numel": 8}]}
    for write_after in (False, True):
        device = [torch.arange(8, dtype=torch.float32)]
        host = HostOptimizer(device, [bucket], 0, {}, lambda groups: torch.optim.SGD(groups, lr=1.0))
        grad = torch.linspace(-1, 1, 8) / 3
        device[0].grad = grad
        host.download(0, grad)
        coef = torch.tensor(0.3)
        grad.mul_(coef)
        host.multiplied(coef)
        if write_after:
            grad[2:4].add_(1.0)  # a view: the base's version counter moves
        final = grad.clone()
        before = device[0].clone()
        host.step(None)
        assert host.reused == (0 if write_after else 1)
        assert torch.equal(host.grads[0], final) and torch.equal(device[0], before - final)


def test_offload_key_is_located_round_trips_and_refuses_what_is_unproven():
    plan = parse("mesh dp=2\nzero stage=2 offload=cpu\n")
    assert plan.zero.offload == "cpu" and "zero stage=2 offload=cpu" in format_plan(plan)
    assert parse(format_plan(plan)) == plan and validate(plan) == []
    for text, message, col in [("mesh dp=2\nzero stage=0 offload=cpu\n", "no sharded optimizer to offload", 22),
                               ("mesh dp=2\nzero stage=1 offload=nvme\n", "zero offload must be cpu, got nvme", 22)]:
        with pytest.raises(PlanError) as err:
            validate(parse(text, file="bad.par"))
        (d,) = err.value.diagnostics
        assert message in d.message and (d.span.line, d.span.col) == (2, col), (d.message, d.span)
    from parc.analysis import support

    for text, what in [("mesh dp=2 ep=2\nexpert_parallel {\n\"blocks.*.experts\"\n}\nzero stage=2 offload=cpu\n",
                        "mesh ep 2"),
                       ("mesh dp=4\nzero stage=2 shard=2 offload=cpu\n", "zero shard=2 (HSDP)"),
                       ("mesh dp=2\nzero stage=2 offload=cpu\ncompile inductor\n", "compile inductor")]:
        with pytest.raises(PlanError) as err:
            support.check(parse(text, file="x.par"))
        found = [d for d in err.value.diagnostics if f"zero offload=cpu with {what} is not supported" in d.message]
        assert len(found) == 1 and found[0].span.line == text.count("\n", 0, text.index("offload")) + 1, \
            [d.message for d in err.value.diagnostics]


def test_report_prices_the_copies_and_the_host_step():
    """The PCIe rows carry 4 bytes a parameter of this rank's range each way, priced at the preset's PCIe figure;
    the step gains the copies and the host update less the device update (parc/analysis/offload_cost.py)."""
    from parc.analysis import cost, offload_cost

    hw = cost.hardware("h100")
    rows = [{"pp_rank": 0, "params_count": 8e9, "params": 1.0, "grads": 1.0, "optimizer": 8e9 * 8 / 8, "total": 9e9}]
    out, added, copies, note = offload_cost.apply(rows, 8e9, 8, 2, "adamw", 4, 0, 8, hw)
    assert out[0]["optimizer"] == 0 and out[0]["offload_frees"] == 8e9 and out[0]["total"] == 1e9
    assert out[0]["host"] == 8e9 / 8 * 16  # fp32 master 4 + gradient buffer 4 + Adam's moments 8
    each = 4 * 8e9 / 8
    assert [size for _, size, _ in copies] == [each, each]
    assert sum(seconds for _, _, seconds in copies) == pytest.approx(2 * each / hw.pcie_bw)
    host_update = 28 * 1e9 / hw.host_mem_bw - 28 * 1e9 / hw.mem_bw
    assert added == pytest.approx(2 * each / hw.pcie_bw + host_update)
    # the download under the last backward: all but one bucket's share hides under a long one, a short one
    # hides its own length
    down_s = each / hw.pcie_bw
    _, hidden, copies, note = offload_cost.apply(rows, 8e9, 8, 2, "adamw", 4, 0, 8, hw, backward_s=10.0, buckets=4)
    assert hidden == pytest.approx(down_s / 4 + down_s + host_update) and "exposed" in note
    _, partly, _, _ = offload_cost.apply(rows, 8e9, 8, 2, "adamw", 4, 0, 8, hw, backward_s=down_s / 2, buckets=4)
    assert partly == pytest.approx(down_s / 2 + down_s + host_update)
    assert sum(seconds for _, _, seconds in copies) == pytest.approx(2 * each / hw.pcie_bw)  # the rows: the whole
    # bf16 ZeRO-3: the fp32 master shard leaves too, a bf16 shard stays; bf16 goes up (2 bytes), fp32 down
    rows = [{"pp_rank": 0, "params_count": 8e9, "params": 8e9 * 4 / 8, "grads": 1.0, "optimizer": 8e9, "total": 2e10}]
    out, _, copies, _ = offload_cost.apply(rows, 8e9, 8, 3, "adamw", 4, 2, 8, hw)
    assert out[0]["params"] == 8e9 * 2 / 8 and out[0]["offload_frees"] == 8e9 + 8e9 * 2 / 8
    assert [size for _, size, _ in copies] == [4e9, 2e9]
    assert "GB/s" in note


def test_plan_considers_offload_only_when_nothing_else_fits(monkeypatch):
    """On one GPU every plan is estimated in full: with the memory of the leanest plan ample, no offload plan is
    ranked; with a memory between the leanest plan's peak and that peak less its optimizer state, only offload
    plans fit, and the search says it considered them."""
    from dataclasses import replace

    from helpers import GPT
    from parc.analysis import cost, planner

    free = planner.search(GPT, gpus=1, preset="h100", global_batch=8, precision="fp32")
    assert free.ranked and not any(c.plan.zero.offload for c in free.ranked)
    leanest = min(c.peak for c in free.ranked)
    with_offload = min(max(r["total"] - r["optimizer"] for r in c.est.memory) for c in free.ranked
                       if c.plan.zero.stage >= 1)
    assert with_offload < leanest
    monkeypatch.setitem(cost.PRESETS, "h100", replace(cost.PRESETS["h100"], memory=(leanest + with_offload) / 2))
    tight = planner.search(GPT, gpus=1, preset="h100", global_batch=8, precision="fp32")
    assert tight.ranked and all(c.plan.zero.offload == "cpu" for c in tight.ranked)
    assert any("ZeRO-Offload variants" in n for n in tight.notes)
    assert "offload cpu" in tight.ranked[0].describe()


# --- checkpoints ------------------------------------------------------------------------------------------
BATCH = "batch global=8 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n"  # two micro-batches a step on dp 2
CK_PLANS = {"offload": "mesh dp=2\nzero stage=2 offload=cpu\n", "zero2": "mesh dp=2\nzero stage=2\n",
            "dp": "mesh dp=2\n"}
# (plan, the checkpoint it resumes from, or None to train from scratch): a chain within one world
SESSIONS = [("offload", None), ("zero2", "offload"), ("dp", "offload"), ("offload", "zero2"), ("offload", "dp")]


def test_offload_checkpoint_resumes_without_offload_and_back(tmp_path):
    from test_checkpoint import _check_reshard

    compiled = {n: str(compile_text(p + BATCH, tmp_path / n).root) for n, p in CK_PLANS.items()}
    res = spawn(DP, checkpoint_sessions, SESSIONS, compiled, str(tmp_path / "ck"))[0]
    src = res[0]
    assert src["first"] == 0
    for dst in res[1:]:
        _check_reshard(src, dst)  # the saved state bitwise; the next step within test_checkpoint's tolerances
    # offload's next step from zero2's checkpoint is zero2's own next step, bit for bit (no reduction differs)
    assert res[3]["loss"] == res[1]["loss"]
    assert all(torch.equal(res[3]["after"][k], res[1]["after"][k]) for k in res[1]["after"])


def test_kill_resume_is_bitwise_under_offload(tmp_path):
    plans = {f"zero{s}": f"mesh dp=2\nzero stage={s} offload=cpu\n" for s in (1, 3)}
    plans["zero2_bf16"] = "mesh dp=2\nzero stage=2 offload=cpu\nprecision bf16\n"
    compiled = {n: str(compile_text(p + BATCH, tmp_path / "c" / n).root) for n, p in plans.items()}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    spawn(DP, checkpoint_leg, compiled, str(whole), False, 0, 4)
    for name in plans:  # the interrupted run: killed after its step_2
        shutil.copytree(whole / name / "step_2", cut / name / "step_2")
        (cut / name / checkpoint.LATEST).write_text("step_2\n")
    spawn(DP, checkpoint_leg, compiled, str(cut), True, 2, 4)
    bad = {name: diff for name in plans
           if (diff := checkpoint_differences(whole / name / "step_4", cut / name / "step_4"))}
    assert not bad, bad
