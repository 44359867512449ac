"""Pipeline schedules as data (parc.passes.schedule) and their simulator (parc.passes.simulate).

Golden rank lists first, then properties over every schedule, then hand-broken
schedules the simulator must reject with rank, position and action named.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.errors import PlanError
from parc.passes import simulate as simulate_mod
from parc.passes.schedule import (Action, Schedule, bubble_formula, build_schedule, connections, format_schedule,
                                  schedule_diagnostics)
from parc.passes.simulate import ScheduleError, simulate

# ---------------------------------------------------------------- golden

ONE_F_ONE_B_P4_M8 = """\
r0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
r1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7
r2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7
r3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"""


def test_golden_1f1b_pp4_m8():
    # warm-up pp − r − 1 forwards, then one forward one backward, then the rest
    assert format_schedule(build_schedule("1f1b", 4, 8)) == ONE_F_ONE_B_P4_M8


def test_golden_gpipe_pp2_m4():
    assert format_schedule(build_schedule("gpipe", 2, 4)) == (
        "r0: F0 F1 F2 F3 B0 B1 B2 B3\n"
        "r1: F0 F1 F2 F3 B0 B1 B2 B3")


def test_golden_1f1b_with_p2p():
    # sf1>1 = SEND_F of micro 1 to rank 1; rb0<1 = RECV_B of micro 0 from rank 1
    assert format_schedule(build_schedule("1f1b", 2, 2), p2p=True) == (
        "r0: F0 sf0>1 F1 sf1>1 rb0<1 B0 rb1<1 B1\n"
        "r1: rf0<0 F0 rf1<0 B0 sb0>0 F1 B1 sb1>0")


def test_golden_zb_h1_defers_w_by_rank():
    assert format_schedule(build_schedule("zb_h1", 3, 4)) == (
        "r0: F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3\n"
        "r1: F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3\n"
        "r2: F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3")


def test_bubble_figures_pp4_m8():
    got = {name: simulate(build_schedule(name, 4, 8, v)).bubble_fraction
           for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))}
    assert got["gpipe"] == pytest.approx(3 / 11) and got["1f1b"] == pytest.approx(3 / 11)
    assert got["interleaved_1f1b"] == pytest.approx(3 / 19)
    assert got["zb_h1"] == pytest.approx(3 / 27)


# ---------------------------------------------------------------- properties

@st.composite
def configs(draw):
    name = draw(st.sampled_from(("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")))
    p = draw(st.integers(1, 8))
    if name == "interleaved_1f1b":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, 32 // p))
    else:
        v, m = 1, draw(st.integers(1, 32))
    return name, p, m, v


@settings(deadline=None, max_examples=300)
@given(configs(), st.sampled_from(("batched", "blocking", "strict")), st.sampled_from((0.0, 0.5)))
def test_every_schedule_simulates(cfg, p2p, comm):
    # "strict": NCCL's lazy connections, brought up by the executor's warm-up first (connect="warm")
    name, p, m, v = cfg
    sch = build_schedule(name, p, m, v)
    res = simulate(sch, cost_comm=comm, p2p=p2p)  # raises on any violation
    counts = Counter((a.kind, a.stage, a.micro) for seq in sch.actions for a in seq if not a.is_p2p)
    backward = ("I", "W") if name == "zb_h1" else ("B",)
    assert counts == Counter({(k, s, j): 1 for s in range(p * v) for j in range(m)
                              for k in ("F",) + backward})
    assert Schedule.from_json(json.dumps(sch.to_json())) == sch
    if name == "gpipe":
        assert res.peak_inflight[0] == m
    if name == "1f1b":
        assert res.peak_inflight[0] == min(p, m)
    if comm == 0.0 and name in ("gpipe", "1f1b"):
        # exact: makespan is (m + p − 1)(F + B) for both
        assert res.makespan == 3 * (m + p - 1)
        assert res.bubble_fraction == pytest.approx(bubble_formula(name, p, m), rel=1e-12, abs=1e-15)
    if comm == 0.0 and name == "interleaved_1f1b":
        assert res.bubble_fraction == pytest.approx(bubble_formula(name, p, m, v), abs=0.02)


@settings(deadline=None, max_examples=60)
@given(st.integers(1, 8), st.integers(1, 32))
def test_zb_h1_beats_1f1b_at_equal_memory(p, m):
    zb = simulate(build_schedule("zb_h1", p, m), cost_f=1, cost_i=1, cost_w=1)
    base = simulate(build_schedule("1f1b", p, m), cost_f=1, cost_b=2)
    assert max(zb.peak_inflight) <= max(base.peak_inflight)
    assert zb.bubble_fraction <= base.bubble_fraction + 1e-12
    if m >= p:
        assert zb.makespan == 3 * m + p - 1


@settings(deadline=None, max_examples=200)
@given(configs())
def test_every_schedule_survives_strict_nccl_model(cfg):
    # the executor's fix: warm-up in `connections` order, then today's batching; the strict model also
    # checks that the warm-up order itself cannot deadlock
    name, p, m, v = cfg
    sch = build_schedule(name, p, m, v)
    assert simulate(sch, p2p="strict", connect="warm").makespan == simulate(sch, p2p="batched").makespan
    for r, conns in enumerate(connections(sch)):
        assert sorted({a.peer for a in sch.actions[r] if a.is_p2p}) == sorted(peer for peer, _, _ in conns)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1"])
def test_todays_batching_hangs_on_lazy_nccl_connections(name):
    # What the H200 run showed (../shared/gpu/README.md): rank 0's batch [SEND_F m3, RECV_B m0]
    # (GPipe) sets up r1→r0 in its ncclGroupEnd and launches nothing until rank 1 reaches that
    # connection; rank 1 first waits for the activation inside that very batch.
    sch = build_schedule(name, 2, 4)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 action \d+ SEND_F.*sets up connection r1→r0"
                                            r".*rank 1 action \d+ RECV_F"):
        simulate(sch, p2p="strict", connect="lazy")
    simulate(sch, p2p="strict", connect="warm")  # the fix
    simulate(sch, p2p="batched")                 # gloo never saw it


def test_lazy_connections_chain_across_ranks():
    sch = build_schedule("1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="r2→r1.*r3→r2"):
        simulate(sch, p2p="strict", connect="lazy")


def test_connections_golden_interleaved_wraps_around():
    # pp 3 × virtual 2: stage 2 (rank 2) feeds stage 3 (rank 0), so ranks 0 and 2 connect too
    assert connections(build_schedule("interleaved_1f1b", 3, 3, 2)) == [
        [(1, True, True), (2, True, True)],
        [(0, True, True), (2, True, True)],
        [(0, True, True), (1, True, True)]]
    assert connections(build_schedule("1f1b", 1, 4)) == [[]]


def test_warm_up_in_crossing_order_deadlocks(monkeypatch):
    cycle = [[(1, True, True), (2, True, True)], [(2, True, True), (0, True, True)],
             [(0, True, True), (1, True, True)]]
    monkeypatch.setattr(simulate_mod, "connections", lambda sch: cycle)
    with pytest.raises(ScheduleError, match="warm-up deadlock: rank 0 waits for rank 1; rank 1 waits for rank 2"):
        simulate(build_schedule("interleaved_1f1b", 3, 3, 2), p2p="strict")


def test_rendezvous_sends_still_exact_for_1f1b():
    res = simulate(build_schedule("1f1b", 4, 8), send_waits=True, p2p="blocking")
    assert res.makespan == 33


# ---------------------------------------------------------------- user errors and advice

def test_interleaved_needs_multiple_of_pp():
    with pytest.raises(PlanError, match="interleaved 1F1B needs micro-batches 6 to be a multiple of pp 4"):
        build_schedule("interleaved_1f1b", 4, 6, 2)


def test_virtual_only_for_interleaved():
    with pytest.raises(PlanError, match="1f1b has one stage per rank, got virtual 2"):
        build_schedule("1f1b", 4, 8, 2)


def test_diagnostics():
    (warn,) = schedule_diagnostics("1f1b", 4, 2)
    assert warn.severity == "warning"
    assert warn.message == "1F1B with 2 micro-batches on pp 4 idles 60% of the step: bubble (p−1)/(m+p−1) = 3/5"
    (err,) = schedule_diagnostics("interleaved_1f1b", 4, 6, 2)
    assert err.severity == "error" and "multiple of pp 4" in err.message
    assert schedule_diagnostics("1f1b", 4, 8) == []


# ---------------------------------------------------------------- broken schedules

def _edit(name, p, m, rank, fn):
    sch = build_schedule(name, p, m)
    sch.actions[rank] = fn(list(sch.actions[rank]))
    return sch


def test_hoisted_receive_deadlocks():
    # rank 0 waits for a gradient before sending the activation that produces it
    sch = _edit("gpipe", 2, 1, 0, lambda seq: [seq[2], seq[0], seq[1], seq[3]])
    assert str(sch.actions[0][0]) == "RECV_B(s0,m0<r1)"
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 action 0 RECV_B\(s0,m0<r1\).*rank 1 action 0 RECV_F"):
        simulate(sch)


def test_swapped_receives_mismatch():
    def swap(seq):
        i, j = [k for k, a in enumerate(seq) if a.kind == "RECV_F"][:2]
        seq[i], seq[j] = seq[j], seq[i]
        return seq
    sch = _edit("gpipe", 2, 2, 1, swap)
    with pytest.raises(ScheduleError, match=r"rank 1 action 0 RECV_F\(s1,m1<r0\).*out of order"):
        simulate(sch)


def test_missing_backward():
    sch = _edit("1f1b", 2, 2, 0, lambda seq: [a for a in seq if (a.kind, a.micro) != ("B", 1)])
    with pytest.raises(ScheduleError, match="stage s0 micro-batch m1 never runs B .* on rank 0"):
        simulate(sch)


def test_backward_before_forward():
    sch = _edit("1f1b", 1, 1, 0, lambda seq: seq[::-1])
    with pytest.raises(ScheduleError, match=r"rank 0 action 0 B\(s0,m0\) runs before its F\(s0,m0\)"):
        simulate(sch)


def test_w_before_i():
    sch = _edit("zb_h1", 1, 1, 0, lambda seq: [seq[0], seq[2], seq[1]])
    with pytest.raises(ScheduleError, match=r"rank 0 action 1 W\(s0,m0\) runs before its I"):
        simulate(sch)


def test_send_order_only_batches_survive():
    # a send and a receive in one batch on each rank, in crossing order: fine when
    # batched, a deadlock when each P2P action blocks alone
    F, B = (lambda s, j: Action("F", s, j)), (lambda s, j: Action("B", s, j))
    r0 = [F(0, 0), Action("SEND_F", 0, 0, 1), F(0, 1),
          Action("RECV_B", 0, 0, 1), Action("SEND_F", 0, 1, 1), B(0, 0), Action("RECV_B", 0, 1, 1), B(0, 1)]
    r1 = [Action("RECV_F", 1, 0, 0), F(1, 0), B(1, 0),
          Action("RECV_F", 1, 1, 0), Action("SEND_B", 1, 0, 0), F(1, 1), B(1, 1), Action("SEND_B", 1, 1, 0)]
    sch = Schedule("1f1b", 2, 2, 1, [r0, r1])
    simulate(sch, p2p="batched")
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sch, p2p="blocking")


def test_wrong_peer():
    sch = _edit("gpipe", 3, 1, 0, lambda seq: [Action(a.kind, a.stage, a.micro, 2) if a.is_p2p else a
                                               for a in seq])
    with pytest.raises(ScheduleError, match="rank 0 action 1 SEND_F.*stage s1 lives on rank 1"):
        simulate(sch)
