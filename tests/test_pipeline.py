"""Pipeline parallelism: the split pass, the executor, and parallel = serial.

Spawning ranks costs far more than training these tiny models, so every
distributed case of one world size is compiled first and trained in ONE spawned
world (`_train_many`), each case with its own process groups; the tests then
check the results. Serial references are trained in-process per model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from helpers import GPT, ROOT, compile_text
from parc import artifact
from parc.compiler import compile_model
from parc.errors import PlanError
from parc.grammar.parser import parse
from parc.passes import PassCtx, pipeline_split
from parc.passes.schedule import Schedule
from parc.passes.simulate import simulate
from parc.runtime.parallel import pipeline
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module, trace
from parc.traced import state_values

MODELS = ROOT / "tests" / "models"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
# fp32. Micro-batch means summed in a different order than the serial step's one
# mean, and (dp) averaged across ranks: ~1e-7 relative on losses, ~1e-5 model-wide
# on parameters after three AdamW steps (see tests/test_data_parallel.py for why
# Adam magnifies rounding). A lost micro-batch, a wrong gradient message or an
# unsynced tied weight moves the parameters by 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def _plan(pp: int, schedule: str, dp: int = 1, micro: int = 2, global_batch: int = 16) -> str:
    virtual = " virtual=2" if schedule == "interleaved_1f1b" else ""
    return (f"mesh pp={pp} dp={dp}\nbatch global={global_batch} micro={micro}\n"
            f"pipeline schedule={schedule}{virtual}\noptimizer adamw lr=1e-2 clip=1.0\n")


# ---------------------------------------------------------------- one world, many runs

class _OneWork:
    """What NCCL's `batch_isend_irecv` returns: ONE work for the whole batch (gloo returns one per op)."""

    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


def _nccl_works(real):
    def batch(ops):
        return [_OneWork(real(ops))]
    return batch


def _train_many(ctx, cases: list[tuple[str, str, bool]], steps: int):
    """Train every compiled case in turn; rank 0 returns losses, state, stage-0 in-flight peak, bubble.

    A key ending in `_nccl_works` runs with `batch_isend_irecv` returning one work per batch, as NCCL's does.
    """
    out = {}
    real = torch.distributed.batch_isend_irecv
    for key, compiled, traced in cases:
        torch.distributed.batch_isend_irecv = _nccl_works(real) if key.endswith("_nccl_works") else real
        trainer = Trainer.load(compiled, 0)
        local = []
        for s in range(steps):
            trainer.pipeline.trace = traced and s == steps - 1  # trace a warm step
            local.append(trainer.step(s).loss)
        losses = trainer.global_losses(local)
        state = trainer.gathered_state()
        events = trainer.pipeline.gather_trace() if traced else None
        if ctx.rank == 0:
            out[key] = {"losses": losses, "state": state, "inflight": trainer.pipeline.peak_inflight.get(0),
                        "events": events}
    return out if ctx.rank == 0 else None


def _compile(tmp: Path, key: str, plan_text: str, model: Path = GPT) -> str:
    return str(compile_text(plan_text, tmp / key / "compiled", model).root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp")
    two = [(f"pp2_{s}", _compile(tmp, f"pp2_{s}", _plan(2, s)), False) for s in SCHEDULES]
    two.append(("pp2_1f1b_nccl_works", two[1][1], False))  # batches [SEND_F, RECV_B]: the receive is 2nd
    four = [(f"pp4_{s}", _compile(tmp, f"pp4_{s}", _plan(4, s)), False) for s in ("gpipe", "1f1b", "zb_h1")]
    four += [
        ("pp4_interleaved_1f1b", _compile(tmp, "pp4_il", _plan(4, "interleaved_1f1b"), MODELS / "gpt_deep.py"), False),
        ("pp2_dp2", _compile(tmp, "pp2_dp2", _plan(2, "1f1b", dp=2)), False),
        ("skip", _compile(tmp, "skip", _plan(4, "1f1b"), MODELS / "skip_mlp.py"), False),
        ("tied", _compile(tmp, "tied", _plan(4, "1f1b"), MODELS / "gpt_tied.py"), False),
        ("bubble", _compile(tmp, "bubble", _plan(4, "1f1b", micro=16, global_batch=128),
                            MODELS / "balanced_stages.py"), True),
    ]
    results = spawn(2, _train_many, two, 3, timeout=600)[0]
    results.update(spawn(4, _train_many, four, 3, timeout=600)[0])
    return results, {key: path for key, path, _ in two + four}


def _serial(compiled: str, steps: int = 3):
    art = artifact.load(Path(compiled))
    user = load_user_module(art.root / "model" / "model.py")
    return train_serial(user, art.plan, 0, steps)


def _check(runs, key: str):
    results, paths = runs
    serial_losses, serial_state = _serial(paths[key])
    verdict = compare(results[key]["losses"], serial_losses, results[key]["state"], serial_state)
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert serial_losses[0] != serial_losses[-1]  # it trained


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_gpt_matches_serial(runs, pp, schedule):
    _check(runs, f"pp{pp}_{schedule}")


def test_one_work_per_batch_still_waits_every_receive(runs):
    # NCCL coalesces a batch into one work; the executor once paired works with ops by position, so a
    # receive after a send in its batch was never waited for (a race on CUDA, not a hang)
    _check(runs, "pp2_1f1b_nccl_works")


def test_pp2_dp2_matches_serial(runs):
    _check(runs, "pp2_dp2")


def test_skip_connection_across_two_stages(runs):
    plan = artifact.load(Path(runs[1]["skip"])).plan
    # the first block's output is forwarded through stages 1 and 2 to stage 3
    first = plan["programs"]["stage0_tp0"]["send"]
    assert len(plan["programs"]["stage1_tp0"]["send"]) == 2 and len(plan["programs"]["stage2_tp0"]["send"]) == 2
    assert first[0]["name"] in {d["name"] for d in plan["programs"]["stage2_tp0"]["send"]}
    _check(runs, "skip")


def test_tied_embedding_and_head(runs):
    plan = artifact.load(Path(runs[1]["tied"])).plan
    assert [(t["stages"], t["pp_ranks"]) for t in plan["tied"]] == [([0, 3], [0, 3])]  # one tensor, two names
    _check(runs, "tied")


def test_inflight_on_stage0(runs):
    results, _ = runs
    assert results["pp4_gpipe"]["inflight"] == 8  # GPipe holds all m micro-batches
    assert results["pp4_1f1b"]["inflight"] == 4   # 1F1B holds p


def test_measured_bubble_matches_simulator(runs):
    results, paths = runs
    events = results["bubble"]["events"]
    measured = pipeline.measured_bubble(events)
    compute = [(n[0], e - s) for rank in events for n, s, e in rank if n[:2] in ("F(", "B(")]
    f = sum(d for k, d in compute if k == "F") / sum(1 for k, _ in compute if k == "F")
    b = sum(d for k, d in compute if k == "B") / sum(1 for k, _ in compute if k == "B")
    sched = Schedule.from_json(artifact.load(Path(paths["bubble"])).plan["schedule"])
    predicted = simulate(sched, cost_f=f, cost_b=b).bubble_fraction
    assert abs(measured - predicted) <= 0.05, (measured, predicted)


# ---------------------------------------------------------------- the split pass, in one process

def _traced(model: Path, micro: int = 2):
    return trace(load_user_module(model), micro)


def _split(traced, plan, stages: int) -> list:
    pipeline_split.assign_stages(traced, plan, stages)
    out = []
    for s in range(stages):
        ctx = PassCtx(traced=traced, stage=s, notes={"stages": stages})
        out.append((pipeline_split.run(copy.deepcopy(traced.gm), plan, ctx), ctx.notes["pipeline"]))
    return out


def test_split_explicit_cut_rewrite_is_visible():
    traced = _traced(GPT)
    plan = parse('mesh pp=2\npipeline stages=2 {\n  cut after "blocks.1"\n}\n')
    (gm0, n0), (gm1, n1) = _split(traced, plan, 2)
    ph0 = [n.name for n in gm0.graph.nodes if n.op == "placeholder"]
    assert "p_model_blocks_1_mlp_proj_bias" in ph0 and "p_model_blocks_2_ln_1_weight" not in ph0
    assert [d["name"] for d in n0["send"]] == [d["name"] for d in n1["recv"]] and len(n0["send"]) == 1
    assert n0["send"][0]["shape"] == [2, 32, 64] and n0["send"][0]["grad"]
    assert n1["last"] and not n0["last"]


def test_split_one_stage_is_a_noop():
    traced = _traced(GPT)
    gm = copy.deepcopy(traced.gm)
    ctx = PassCtx(traced=traced, notes={"stages": 1})
    assert pipeline_split.run(gm, parse("mesh dp=1\n"), ctx) is gm


def test_split_stages_chain_to_the_whole_loss():
    """Numerics: running the stage programs one after another gives the unsplit graph's loss."""
    model_file = MODELS / "skip_mlp.py"
    user, traced = load_user_module(model_file), _traced(model_file)
    torch.manual_seed(0)
    model = user.build_model()
    values = dict(zip([s.name for s in traced.state], state_values(traced, model)))
    batch = user.get_batch(0, 2)
    whole = torch.fx.Interpreter(traced.gm).run(*values.values(), *batch)[0]
    carried = []
    for gm, notes in _split(traced, parse("mesh pp=4\n"), 4):
        state = [values[n.name] for n in gm.graph.nodes if n.op == "placeholder" and n.name in values]
        carried = list(gm(*state, *carried, *batch))
    assert torch.equal(carried[0], whole)  # same ops in the same order: bit-identical


def test_auto_cut_reports_shares(tmp_path):
    result = compile_model(GPT, parse(_plan(4, "1f1b"), file=str(tmp_path / "p.par")), tmp_path / "c")
    stages = result.plan_json["stages"]
    assert [d["pp_rank"] for d in stages] == [0, 1, 2, 3]
    assert abs(sum(d["flops_share"] for d in stages) - 1) < 1e-3 and all(d["flops_share"] > 0.15 for d in stages)
    src = (tmp_path / "c" / "programs" / "stage1_tp0.py").read_text()
    assert "Pipeline: recv" in src and "Pipeline: send" in src  # the program shows its messages


# ---------------------------------------------------------------- diagnostics

def _warnings(tmp_path, text: str, model: Path = GPT) -> list[str]:
    result = compile_model(model, parse(text, file=str(tmp_path / "p.par")), tmp_path / "c")
    return [d.message for d in result.warnings]


def test_warns_few_micro_batches_under_1f1b(tmp_path):
    msgs = _warnings(tmp_path, "mesh pp=4\nbatch global=4 micro=2\npipeline schedule=1f1b\n")
    assert any("1F1B with 2 micro-batches on pp 4 idles 60%" in m and "3/5" in m for m in msgs), msgs


def test_interleaved_needs_multiple_of_pp(tmp_path):
    plan = "mesh pp=2\nbatch global=6 micro=2\npipeline schedule=interleaved_1f1b virtual=2\n"
    with pytest.raises(PlanError, match="micro-batches 3 to be a multiple of pp 2"):
        compile_model(GPT, parse(plan, file=str(tmp_path / "p.par")), tmp_path / "c")


def test_warns_layers_not_dividing(tmp_path):
    msgs = _warnings(tmp_path, "mesh pp=3\nbatch global=6 micro=2\npipeline schedule=1f1b\n")
    assert any("4 layers do not divide into 3 stages (4 = 1 × 3 + 1)" in m for m in msgs), msgs


def test_a_post_frees_done_sends_oldest_first_and_looks_no_further():
    """`drop_sent` frees the buffers of sends that are done, oldest first, and stops at the first one that is not:
    each post costs O(1) however many sends are held (gloo reports a send done only once waited, so a scan of all
    of them each post made a step quadratic in its micro-batches)."""
    from collections import deque

    asked = []

    class Work:
        def __init__(self, name, done):
            self.name, self.done = name, done

        def is_completed(self):
            asked.append(self.name)
            return self.done

    sends = deque((Work(n, d), None) for n, d in (("a", True), ("b", True), ("c", False), ("d", True)))
    pipeline.drop_sent(sends)
    assert [w.name for w, _ in sends] == ["c", "d"] and asked == ["a", "b", "c"]
    asked.clear()
    pipeline.drop_sent(sends)
    assert asked == ["c"]     # the held ones behind it are not looked at again
