"""`parc report --pp-engine deepspeed` (issue 27, item 3): DeepSpeed's pipeline engine, priced as it runs.

Checked here: `schedule.deepspeed_train` is DeepSpeed's `TrainSchedule` order (derived by hand from its
`_step_to_micro_batch` for 2 stages and 2 micro-batches); with free transfers its makespan is 1F1B's
(m + pp − 1)(F + B), the fill and drain paid once; its blocking transfers add their own time (a 2-stage run
timed by hand); and the report prices it through the CLI, says so, and refuses a plan that engine could not run.
"""

from pathlib import Path

import pytest
from parc import cli
from parc.analysis import report
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
    return report.build_from_args(cli.parser().parse_args(
        ["report", "--model", str(ROOT / "bench" / "gpt_sized.py"), "--plan", str(plan), *flags]))


def test_report_prices_the_engine_and_says_so(tmp_path, monkeypatch):
    # 4 layers of 1024 over pp 4, 8 micro-batches: DeepSpeed's order runs the same compute; its transfers block
    # both ranks where parc's run under the next compute, so the step is longer by what they expose
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")
    parc_run, ds = _report(tmp_path, "1f1b"), _report(tmp_path, "1f1b", "--pp-engine", "deepspeed")
    assert ds["utilization"]["compute_seconds"] == pytest.approx(parc_run["utilization"]["compute_seconds"])
    assert ds["utilization"]["step_seconds"] > parc_run["utilization"]["step_seconds"]
    assert ds["communication"]["exposed_parts"]["pp"] > parc_run["communication"]["exposed_parts"]["pp"]
    assert any("pp engine deepspeed" in n for n in ds["notes"])


def test_report_refuses_a_schedule_the_engine_has_not(tmp_path, monkeypatch):
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")
    with pytest.raises(ParcError, match="TrainSchedule.*gpipe"):
        _report(tmp_path, "gpipe", "--pp-engine", "deepspeed")
