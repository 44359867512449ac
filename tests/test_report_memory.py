"""`parc report`'s memory figures against what every example plan really holds, rank by rank.

For each plan in examples/, the report's per-rank rows (parc/analysis/cost.py) are held to
a run of that plan on CPU ranks (runtime/memory.py):

- state: weights, gradients and optimizer state, counted from the tensors each
  rank keeps after a step. They must equal the prediction exactly;
- activations: the peak bytes a rank keeps alive for backward, sampled after
  each forward, over the in-flight micro-batches its schedule holds. They must
  be within 10% of the prediction's kept activations.

The report's recompute peak (the working set one recomputed module rebuilds
in backward) is not part of what is measured: it exists only inside backward,
next to gradient buffers the report does not model, so it is checked in
tests/test_recompute.py by how much less a forward keeps, not here.

Plans of one world size train in one spawned world (`_measure_many`), and the
same runs are checked against the serial model: what is measured is a plan
training correctly.
"""

from __future__ import annotations


import pytest
import torch.distributed as dist

from helpers import GPT, ROOT
from parc import artifact
from parc.analysis import report
from parc.compiler import compile_model
from parc.grammar.parser import load_plan, parse
from parc.runtime.launch import spawn
from parc.runtime.memory import ActivationProbe, held_state
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

EXAMPLES = ("dp", "tp", "pp", "zero", "3d")
# and one more: a bf16 pipeline, where each rank holds one bf16 compute copy of its weights per step
# (runtime/precision.py StepCasts), and the values crossing the cut travel and wait in bf16
PP_BF16 = "mesh pp=2\nbatch global=16 micro=2\npipeline schedule=1f1b\nprecision bf16\n"
# examples/gpt.py on one rank, micro 8, fp32 and bf16 (issue 13): bf16 keeps bf16 activations
MICRO8 = {name: f"mesh dp=1\nbatch global=8 micro=8\nprecision {name.removeprefix('micro8_')}\n"
          for name in ("micro8_fp32", "micro8_bf16")}
# tp 2 with recompute under `compile`: each recomputed block keeps its collectives' outputs
# (runtime/recompute_policy.py), which the report counts (parc/analysis/activations.py); measured on the
# compiled program by the saved-tensor hook (runtime/memory.py `saved_only`)
TP_RECOMPUTE_COMPILED = (ROOT / "examples" / "tp.par").read_text() + 'recompute "blocks.*"\ncompile aot_eager\n'
# bf16 ZeRO-1 with bf16 gradient accumulation (issue 25): 2 + 2 + 12/N bytes per parameter
ZERO1_BF16_ACC = "mesh dp=2\nbatch global=8 micro=2\nzero stage=1\nprecision bf16 reduce=bf16 accumulate=bf16\n"
TEXTS = {"pp_bf16": PP_BF16, **MICRO8, "tp_recompute_compiled": TP_RECOMPUTE_COMPILED,
         "zero1_bf16_accumulate": ZERO1_BF16_ACC}
PLANS = (*EXAMPLES, *TEXTS)
# The cost model sizes what each op saves from its traced shapes and dtypes; what
# it leaves out is small (int64 position ids, a 0-dim loss). Across the examples
# it is within 3.3% of the measured; 10% is the bound.
ACTIVATION_TOL = 0.10


def _measure_many(ctx, compiled: list[str]) -> list[list[dict]] | None:
    """Per plan: every rank's measured state bytes and activation peak (on rank 0)."""
    out = []
    for root in compiled:
        trainer = Trainer.load(root, 0)
        local = [trainer.step(0).loss]  # every gradient and optimizer buffer now exists
        trainer.probe = ActivationProbe(trainer.state,
                                        saved_only=trainer.art.plan["plan"].get("compile", "none") != "none")
        local.append(trainer.step(1).loss)
        mine = {"rank": ctx.rank, "pp": trainer.ctx.coord["pp"], "activations": trainer.probe.peak, **held_state(trainer)}
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        losses, state = trainer.global_losses(local), trainer.gathered_state()
        out.append({"ranks": ranks, "losses": losses, "state": state})
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report_memory")
    compiled, by_world = {}, {}
    for name in PLANS:
        plan = parse(TEXTS[name], file=f"{name}.par") if name in TEXTS else load_plan(ROOT / "examples" / f"{name}.par")
        compiled[name] = compile_model(GPT, plan, tmp / name).out_dir
        by_world.setdefault(plan.mesh.world_size, []).append(name)
    runs = {}
    for world, names in by_world.items():
        results = spawn(world, _measure_many, [str(compiled[n]) for n in names], timeout=600)[0]
        runs.update(zip(names, results))
    return {name: (report.build(compiled[name]), runs[name]["ranks"], runs[name], compiled[name])
            for name in PLANS}


@pytest.mark.parametrize("name", PLANS)
def test_state_memory_equals_report_exactly(measured, name):
    rep, ranks, _, _ = measured[name]
    rows = rep["memory"]["per_pp_rank"]
    for r in ranks:
        row = rows[r["pp"]]
        assert (r["params"], r["grads"], r["optimizer"]) == \
            (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]), (name, r, row)


@pytest.mark.parametrize("name", PLANS)
def test_activation_memory_within_10_percent(measured, name):
    rep, ranks, _, _ = measured[name]
    rows = rep["memory"]["per_pp_rank"]
    for r in ranks:
        predicted = rows[r["pp"]]["activations_kept_bytes"]
        assert abs(predicted - r["activations"]) <= ACTIVATION_TOL * r["activations"], (name, r, predicted)
        # the total the report prints is the kept part plus the recompute peak, nothing else
        row = rows[r["pp"]]
        # issue 14: the verdict's activations add the larger of the recompute peak and the logits
        # gradient's transient peak (it was the recompute peak alone)
        peak = max(row["recompute_peak_bytes"], row["transient_bytes"])
        assert abs(row["activations_bytes"] - predicted - peak) <= 1  # rounding



@pytest.mark.parametrize("name", PLANS)
def test_measured_runs_match_serial(measured, name):
    """The runs measured above are the plans training correctly (pp.par and 3d.par recompute)."""
    _, _, run, root = measured[name]
    art = artifact.load(root)
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, 2)
    verdict = compare(run["losses"], serial_losses, run["state"], serial_state)
    # fp32: 1e-4, as every equivalence test (runtime/verify.py explains it); bf16 (zero.par, serial
    # the same bf16 layout): 2e-3, as tests/test_bf16_layout.py
    tol = 2e-3 if art.plan["plan"]["precision"] == "bf16" else 1e-4
    assert verdict.loss_rel < tol and verdict.param_rel < tol, verdict.render()


def test_bf16_keeps_about_half_of_fp32s_activations(measured):
    """The bf16 layout (runtime/precision.py) saves bf16 activations: ≤ 0.55× fp32's, predicted and measured.
    Not 0.50×: layer norm's mean/rstd, attention's log-sum-exp and the cross entropy's log-softmax stay fp32."""
    rows = {n: measured[n][0]["memory"]["per_pp_rank"][0] for n in MICRO8}
    runs = {n: measured[n][1][0] for n in MICRO8}
    predicted = rows["micro8_bf16"]["activations_kept_bytes"] / rows["micro8_fp32"]["activations_kept_bytes"]
    held = runs["micro8_bf16"]["activations"] / runs["micro8_fp32"]["activations"]
    assert predicted <= 0.55 and held <= 0.55, (predicted, held)


def test_bf16_state_is_the_design_formula(measured):
    """docs/design.md's bf16 row: 4Φ fp32 masters + 2Φ bf16 copy, 4Φ fp32 grads, 8Φ Adam; ZeRO-2 (zero.par,
    bf16, dp 4) divides the masters, grads and Adam by dp and keeps the whole bf16 copy as its flat buffer,
    on the padded numel Φ' of its flat buckets: 2 + 16/N bytes per parameter."""
    row = measured["micro8_bf16"][0]["memory"]["per_pp_rank"][0]
    phi = row["params_count"]
    assert (row["params_bytes"], row["grads_bytes"], row["optimizer_bytes"]) == (6 * phi, 4 * phi, 8 * phi)
    rep, ranks, _, root = measured["zero"]
    table = artifact.load(root).plan["programs"]["stage0_tp0"]["zero"]
    padded, dp = sum(b["padded"] for b in table["buckets"]), table["dp"]
    assert table["stage"] == 2 and artifact.load(root).plan["plan"]["precision"] == "bf16"
    for r in ranks:  # the bf16 buffer is whole at stage 2, the fp32 masters a range; the padding is state too
        assert (r["params"], r["grads"], r["optimizer"]) == (2 * padded + 4 * padded // dp, 4 * padded // dp,
                                                             8 * padded // dp)


@pytest.mark.parametrize("name", PLANS)
def test_the_precision_note_says_what_is_held(measured, name):
    """The report's note on bytes per parameter (parc/analysis/cost.py `_state_per_param`) adds up to its
    own state rows, which the test above holds to the run: per parameter of the model, so within the
    padding of ZeRO's flat buckets (< 1% here)."""
    rep, _, _, _ = measured[name]
    note = next(n for n in rep["notes"] if n.startswith("precision layout"))
    said = float(note.split("as the runtime keeps them: ")[1].split(";")[0].split(" = ")[-1])
    for row in rep["memory"]["per_pp_rank"]:
        held = (row["params_bytes"] + row["grads_bytes"] + row["optimizer_bytes"]) / row["params_count"]
        assert abs(held - said) <= 0.01 * said, (name, note, held)


def test_bf16_accumulation_is_the_zero_paper_formula(measured):
    """bf16 ZeRO-1 with `accumulate=bf16`, dp 2: 2 (bf16 weights) + 2 (bf16 gradients) + 12/N (fp32
    masters and Adam) bytes per padded parameter, measured on every rank."""
    _, ranks, _, root = measured["zero1_bf16_accumulate"]
    table = artifact.load(root).plan["programs"]["stage0_tp0"]["zero"]
    padded, dp = sum(b["padded"] for b in table["buckets"]), table["dp"]
    for r in ranks:
        assert (r["params"], r["grads"], r["optimizer"]) == (2 * padded + 4 * padded // dp, 2 * padded,
                                                             8 * padded // dp)


def _probe_rule(ctx) -> int:
    """One gloo rank: a collective's buffer that only the backend (here: `held`, standing in for gloo's worker
    thread, which lets go of a finished work a moment after `wait()`) still holds is not an activation; the
    same kind of buffer counts when autograd saves it or the forward returns it."""
    import torch

    probe = ActivationProbe([])
    x = torch.ones(1024, requires_grad=True)   # 4 KiB per buffer below
    held = []
    with probe.tracking():
        buf = (x * 2).detach().clone()          # a transient buffer, as ops.reduce_scatter's `full`
        dist.all_reduce(buf)
        held.append(buf)                        # the backend's reference, after the op returned
        del buf
        kept = (x * 3).detach().clone()
        dist.all_reduce(kept)
        saved = kept.requires_grad_().sin()     # sin saves its input: kept for backward
        out = (x * 4).detach().clone()
        dist.all_reduce(out)                    # the forward's output (a pipeline stage sends it)
    return probe.sample([saved, out])


def test_a_collective_buffer_only_the_backend_holds_is_not_counted():
    (got,) = spawn(1, _probe_rule, timeout=120)
    # kept (saved by sin), sin's output, out: 3 × 4 KiB; the held all-reduce buffer and the freed x * k
    # temporaries not at all, whenever the backend would have let go of its buffer
    assert got == 3 * 4096, got
