"""`parc.analysis.schedules.timing`, the cost model's pipeline timing, against the checking simulator
(`parc.passes.simulate.simulate`) it stands in for: every schedule kind parc builds, over pipeline depths,
micro-batch counts and virtual stages, with random per-stage costs and P2P times (and the interleaved order
placed for those costs, as `cost.estimate` builds it). Equal, not close: the same float operations in the same
order. Also: a schedule that cannot run is refused, not timed."""

from __future__ import annotations

import random

import pytest

from parc.analysis.schedules import Schedules, timing
from parc.passes.schedule import Action, Schedule, build_schedule, deepspeed_train, peak_inflight, peak_of
from parc.passes.simulate import ScheduleError, simulate

SHAPES = [(name, pp, m, v) for pp, ms in ((2, (1, 2, 3, 4, 8)), (3, (1, 3, 6)), (4, (1, 2, 4, 8)), (8, (8, 16)))
          for m in ms for name, v in
          (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3))
          if name != "interleaved_1f1b" or m % pp == 0]


def _same(schedule, **costs):
    a, b = timing(schedule, **costs), simulate(schedule, **costs)
    assert (a.makespan, a.busy, a.bubble_fraction, a.peak_inflight) == \
        (b.makespan, b.busy, b.bubble_fraction, b.peak_inflight), (schedule.name, costs)


@pytest.mark.parametrize("name, pp, m, v", SHAPES)
def test_timing_equals_the_simulator(name, pp, m, v):
    rng = random.Random(f"{name}{pp}{m}{v}")
    stages = pp * v
    for _ in range(4):
        f = [rng.uniform(0.5, 2.0) for _ in range(stages)]
        b = [rng.uniform(1.0, 4.0) for _ in range(stages)]
        comm = rng.choice([0.0, rng.uniform(0.0, 1.0), rng.uniform(1.0, 5.0)])
        split = {"cost_i": [x / 2 for x in b], "cost_w": [x / 2 for x in b]} if name == "zb_h1" else {}
        plain = build_schedule(name, pp, m, v)
        _same(plain, cost_f=f, cost_b=b, cost_comm=comm, **split)
        _same(plain, cost_f=rng.uniform(0.5, 2), cost_b=rng.uniform(1, 4), **split)   # one cost for every stage
        if name == "interleaved_1f1b":
            _same(build_schedule(name, pp, m, v, order_costs={"F": f, "B": b}), cost_f=f, cost_b=b, cost_comm=comm)
    _same(build_schedule(name, pp, m, v))   # the simulator's defaults
    # micro-batches in flight, as the cost model's memory reads them before any schedule is built or timed
    assert peak_inflight(name, pp, m, v) == simulate(build_schedule(name, pp, m, v)).peak_inflight


def test_the_memo_times_with_it():
    memo = Schedules()
    s = memo.build("1f1b", 4, 8)
    got = memo.simulate(s, cost_f=[1.0, 1.5, 1.0, 2.0], cost_b=2.0, cost_comm=0.25)
    assert got.makespan == simulate(s, cost_f=[1.0, 1.5, 1.0, 2.0], cost_b=2.0, cost_comm=0.25).makespan
    assert got.timeline == [[], [], [], []]    # timing keeps no timeline; the checking simulator does
    assert memo.simulate(s, cost_comm=0.25, p2p="blocking").timeline[0]


def test_a_schedule_that_cannot_run_is_refused():
    """A receive whose send never comes, and a send that meets the wrong receive: errors, as the simulator's."""
    never = Schedule("x", 2, 1, 1, [[Action("RECV_B", 0, 0, 1), Action("F", 0, 0)],
                                    [Action("RECV_F", 1, 0, 0), Action("F", 1, 0)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        timing(never)
    crossed = Schedule("x", 2, 2, 1, [[Action("F", 0, 0), Action("F", 0, 1), Action("SEND_F", 0, 1, 1),
                                       Action("SEND_F", 0, 0, 1)],
                                      [Action("RECV_F", 1, 0, 0), Action("F", 1, 0)]])
    with pytest.raises(ScheduleError, match="out of order"):
        timing(crossed)


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 4), (3, 2), (4, 8), (8, 16)])
def test_deepspeeds_peak_in_flight_read_off_its_order(pp, m):
    schedule = deepspeed_train(pp, m)
    assert peak_of(schedule) == simulate(schedule, p2p="blocking", send_waits=True).peak_inflight


def test_the_memo_keeps_large_schedules_up_to_its_budget_and_their_timings_by_key(monkeypatch):
    """Schedules over KEPT_SLOTS are kept up to LARGE_SLOTS slots in all, least recently asked for dropped first; a
    dropped one is built again when asked for, and its timing is still the memoized one (keyed by what built it),
    equal to timing the schedule afresh."""
    from parc.analysis import schedules

    monkeypatch.setattr(schedules, "KEPT_SLOTS", 16)
    monkeypatch.setattr(schedules, "LARGE_SLOTS", 40)
    memo = Schedules()
    small = memo.build("1f1b", 2, 8)                      # 16 slots: kept for good
    a = memo.build("1f1b", 2, 12)                         # 24 slots: large, kept
    first = memo.simulate(a, cost_f=1.0, cost_b=2.0)
    b = memo.build("1f1b", 4, 5)                          # 20 more: 44 > 40, so `a` (the older) is dropped
    assert list(memo.large) == [memo.key_of[id(b)]] and memo.large_slots == 20
    assert memo.build("1f1b", 2, 8) is small and memo.build("1f1b", 4, 5) is b
    again = memo.build("1f1b", 2, 12)                     # built again: a new object, the same schedule
    assert again is not a and again.actions == a.actions
    assert memo.simulate(again, cost_f=1.0, cost_b=2.0) is first   # the memoized timing, by its build key
    assert first.makespan == timing(build_schedule("1f1b", 2, 12), cost_f=1.0, cost_b=2.0).makespan
