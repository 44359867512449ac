"""`parc report --pp-engine deepspeed` (issue 27, item 3): DeepSpeed's pipeline engine, priced as it runs.

Checked here: `schedule.deepspeed_train` is DeepSpeed's `TrainSchedule` order (derived by hand from its
`_step_to_micro_batch` for 2 stages and 2 micro-batches); with free transfers its makespan is 1F1B's
(m + pp − 1)(F + B), the fill and drain paid once; its blocking transfers add their own time (a 2-stage run
timed by hand); the report prices it through the CLI, says so, and refuses a plan that engine could not run
(another schedule, ZeRO-2/3); and the gradients are accumulated and reduced as the engine does: after each
backward on its stage (bf16: a cast and an add, 18 bytes a parameter; fp16: autograd's add into `.grad`), and
under bf16 all-reduced in fp32 rather than reduce-scattered (each derived by hand from the bytes).
"""

from pathlib import Path

import pytest
from helpers import sized_report
from parc.analysis import compute, report
from parc.errors import ParcError
from parc.passes.schedule import build_schedule, deepspeed_train
from parc.passes.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]


def test_order_is_deepspeeds():
    # steps 0..5. Stage 0 (even): forwards at even steps, mb = t//2; backwards at odd, mb = (t-1)//2 - 1.
    # A backward step sends the previous step's activation, then receives this one's gradient.
    # Stage 1 (odd, last): forwards at odd steps, mb = (t-1)//2; backwards at even, mb = t//2 - 1; a forward
    # step receives this activation, then sends the previous step's gradient (step 5: only the send).
    got = [[str(a) for a in seq] for seq in deepspeed_train(2, 2).actions]
    want = [[str(a) for a in seq] for seq in _hand()]
    assert got == want


def _hand():
    from parc.passes.schedule import Action as A
    return [[A("F", 0, 0), A("SEND_F", 0, 0, 1), A("F", 0, 1), A("SEND_F", 0, 1, 1), A("RECV_B", 0, 0, 1),
             A("B", 0, 0), A("RECV_B", 0, 1, 1), A("B", 0, 1)],
            [A("RECV_F", 1, 0, 0), A("F", 1, 0), A("B", 1, 0), A("RECV_F", 1, 1, 0), A("SEND_B", 1, 0, 0),
             A("F", 1, 1), A("B", 1, 1), A("SEND_B", 1, 1, 0)]]


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 5), (4, 8), (5, 3)])
def test_free_transfers_give_1f1b_makespan(pp, m):
    # F = 1, B = 2 on every stage: 1F1B's makespan is (m + pp − 1)(F + B); DeepSpeed's lock-step order,
    # its sends one step late, gives the same: the fill and drain are paid once
    ds = simulate(deepspeed_train(pp, m), cost_f=1.0, cost_b=2.0, p2p="blocking", send_waits=True)
    assert ds.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert ds.makespan == pytest.approx(simulate(build_schedule("1f1b", pp, m, 1), cost_f=1.0, cost_b=2.0).makespan)


def test_blocking_transfers_add_their_time():
    # pp 2, m 2, F 1, B 2, each transfer c = 0.1, both ends waiting: stage 0 F0 ends 1, sends act 0 (1 + c);
    # F1 ends 2 + c; stage 1 F0, B0 end 4 + c; act 1 leaves at 4 + 2c; grad 0 meets stage 0 at 4 + 3c
    # (stage 1) / 4 + 2c (stage 0: parc's receiver ends when the data is there); stage 1 F1, B1 end 7 + 3c;
    # grad 1 arrives 7 + 4c; stage 0's B1 ends 9 + 4c
    ds = simulate(deepspeed_train(2, 2), cost_f=1.0, cost_b=2.0, cost_comm=0.1, p2p="blocking", send_waits=True)
    assert ds.makespan == pytest.approx(9 + 4 * 0.1)


PLAN = """mesh dp=2 pp=4
topology nodes=1 gpus_per_node=8 preset=a100
batch global=32 micro=2
pipeline schedule={schedule} stages=4
precision bf16
"""


def _report(tmp_path, schedule, *flags) -> dict:
    plan = tmp_path / "p.par"
    plan.write_text(PLAN.format(schedule=schedule))
    return sized_report(plan, *flags)


def test_report_prices_the_engine_and_says_so(tmp_path, monkeypatch):
    # 4 layers of 1024 over pp 4, 8 micro-batches: DeepSpeed's order runs the same compute, and its bf16
    # accumulation in every backward (18 bytes a parameter, below) on the busiest rank, the last (the lm_head's
    # matmuls); its transfers block both ranks where parc's run under the next compute, so the step is longer by
    # what they expose
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")
    parc_run, ds = _report(tmp_path, "1f1b"), _report(tmp_path, "1f1b", "--pp-engine", "deepspeed")
    last = ds["memory"]["per_pp_rank"][-1]["params_count"]
    accumulate = 8 * 18 * last / (ds["hardware"]["memory_gbps"] * 1e9)
    assert ds["utilization"]["compute_seconds"] == \
        pytest.approx(parc_run["utilization"]["compute_seconds"] + accumulate)
    assert ds["utilization"]["step_seconds"] > parc_run["utilization"]["step_seconds"]
    assert ds["communication"]["exposed_parts"]["pp"] > parc_run["communication"]["exposed_parts"]["pp"]
    assert any("pp engine deepspeed" in n for n in ds["notes"])


def test_report_refuses_a_schedule_the_engine_has_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")
    with pytest.raises(ParcError, match="TrainSchedule.*gpipe"):
        _report(tmp_path, "gpipe", "--pp-engine", "deepspeed")


# -- the engine's gradient accumulation and bf16 reduction (deepspeed/runtime/pipe/engine.py, bf16_optimizer.py)

ZERO_PLAN = """mesh dp=2 pp=2
topology nodes=1 gpus_per_node=4 preset=a100
batch global=16 micro=2
pipeline schedule=1f1b stages=2
zero stage={zero}
precision {precision}
"""


def _estimates(tmp_path, monkeypatch, precision, zero=1):
    """(plan, stats, hw, parc's estimate, DeepSpeed's engine's estimate) of a 4-layer GPT of 1024 on pp 2 × dp 2,
    4 micro-batches of 2."""
    from parc.analysis import cost
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")
    path = tmp_path / "z.par"
    path.write_text(ZERO_PLAN.format(zero=zero, precision=precision))
    plan, stats, _, _ = report._inputs(None, ROOT / "bench" / "gpt_sized.py", path)
    hw = cost.hardware("a100", plan.topology)
    return (plan, stats, hw, cost.estimate(plan, stats, hw, overlap_dp=False),
            cost.estimate(plan, stats, hw, overlap_dp=False, pp_engine="deepspeed"))


def _stage_params(d):
    return d["params_sharded"] + d["params_replicated"]   # tp 1


def test_bf16_accumulates_with_a_cast_and_an_add_after_every_backward(tmp_path, monkeypatch):
    # BF16_Optimizer.update_hp_grads after each backward: hp.add_(lp.grad.to(fp32)): a cast (2 read, 4 written) and
    # an add (4 + 4 read, 4 written), 18 bytes a parameter, in every stage's B; nothing left for after the step:
    # parc's own accumulation there, (6 + 10 (m − 1)) bytes on the largest stage's parameters, is gone
    plan, stats, hw, parc_run, ds = _estimates(tmp_path, monkeypatch, "bf16")
    m = plan.accumulation
    assert m == 4
    for d, (f0, b0), (f1, b1) in zip(stats["stages"], parc_run.stage_seconds, ds.stage_seconds):
        assert f1 == pytest.approx(f0)
        assert b1 - b0 == pytest.approx(18 * _stage_params(d) / hw.mem_bw)
    big = max(_stage_params(d) for d in stats["stages"])
    assert parc_run.optimizer_seconds - ds.optimizer_seconds == pytest.approx((6 + 10 * (m - 1)) * big / hw.mem_bw)


def test_fp16_accumulates_in_the_16_bit_grad_on_all_but_the_first_micro_batch(tmp_path, monkeypatch):
    # DeepSpeed's fp16 ZeRO-1: autograd adds into the fp16 .grad (2 + 2 read, 2 written) on micro-batches 2..m:
    # each B carries (m − 1)/m of it
    plan, stats, hw, parc_run, ds = _estimates(tmp_path, monkeypatch, "fp16")
    for d, (_, b0), (_, b1) in zip(stats["stages"], parc_run.stage_seconds, ds.stage_seconds):
        assert b1 - b0 == pytest.approx(3 / 4 * 6 * _stage_params(d) / hw.mem_bw)
    # one micro-batch: its matmul writes the gradient, nothing is added
    assert compute.deepspeed_accumulate_seconds(hw, 1e9, "fp16", 1) == 0.0


def test_bf16_gradients_are_all_reduced_in_fp32_not_reduce_scattered(tmp_path, monkeypatch):
    # _bf16_reduce_grads: buffered_allreduce_fallback over the fp32 gradients, 2 (n − 1)/n of them a rank (dp 2:
    # all 4 bytes of each parameter); parc's ZeRO-1 reduce-scatters (n − 1)/n (2 bytes). The gather is the same
    plan, stats, hw, parc_run, ds = _estimates(tmp_path, monkeypatch, "bf16")
    big = max(_stage_params(d) for d in stats["stages"])
    rows = {e: {c.collective: c for c in est.comms if c.axis == "dp"} for e, est in (("parc", parc_run), ("ds", ds))}
    assert set(rows["parc"]) == {"reduce-scatter", "all-gather"} and set(rows["ds"]) == {"all-reduce", "all-gather"}
    assert rows["parc"]["reduce-scatter"].bytes == pytest.approx(big * 4 / 2)
    assert rows["ds"]["all-reduce"].bytes == pytest.approx(big * 4)
    assert rows["ds"]["all-gather"].bytes == pytest.approx(rows["parc"]["all-gather"].bytes)
    # fp16 (its ZeRO-1 optimizer reduces to each shard's owner): the reduce-scatter stays
    *_, fp16 = _estimates(tmp_path, monkeypatch, "fp16")
    assert {c.collective for c in fp16.comms if c.axis == "dp"} == {"reduce-scatter", "all-gather"}


def test_report_refuses_zero_beyond_1_with_the_engine(tmp_path, monkeypatch):
    with pytest.raises(ParcError, match="ZeRO-1 at most"):
        _estimates(tmp_path, monkeypatch, "bf16", zero=2)
