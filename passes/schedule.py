"""Pipeline schedules as data: which action each pp rank issues, in order.

Start at `build_schedule(name, pp, micro_batches, virtual)`. It returns a
`Schedule`: one ordered list of `Action`s per pp rank, compute (F, B, I, W) and
the point-to-point sends/receives around it. `parc.passes.simulate.simulate`
runs the lists and checks them; the runtime executor only walks them.

Assumes: S = pp × virtual stages, stage s lives on pp rank s % pp (Megatron's
looping placement: rank r holds stages r, r+pp, r+2pp, …).

Guarantees, for every schedule built here:
- each (stage, micro) runs F once and either B once or I then W once;
- the P2P order is deadlock-free under BOTH executor semantics:
  * blocking pairs: every SEND/RECV waits until its partner is posted;
  * batched: each maximal run of adjacent P2P actions in a rank's list is
    issued as one `batch_isend_irecv` and waited before the next compute.
  Why: every message gets one global key (when its producer finishes in an
  ideal unit-cost run) and every rank issues its P2P actions in increasing
  key order, sender and receiver alike. The pending message with the smallest
  key then always has both ends posted, so some rank can always progress, and
  the k-th send on a (src → dst) channel always meets the k-th receive.
- An action's `stage` is the stage computing on THIS rank: SEND_F(s) carries
  F(s)'s output to stage s+1, RECV_F(s) brings F(s)'s input from stage s−1,
  SEND_B(s) carries the input gradient of stage s to s−1, RECV_B(s) brings the
  output gradient of stage s from s+1. A stage's neighbour on the same rank
  (pp = 1 with virtual stages) needs no P2P.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from parc.errors import Diagnostic, PlanError
from parc.grammar.plan import SCHEDULES

COMPUTE = ("F", "B", "I", "W")
P2P = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
# Ideal costs used only to order P2P actions; any positive costs would be deadlock-free.
_ORDER_COST = {"F": 1, "B": 2, "I": 1, "W": 1}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's schedule. `peer` is the other pp rank of a SEND/RECV."""

    kind: str
    stage: int
    micro: int
    peer: int | None = None

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P

    def __str__(self) -> str:
        if self.is_p2p:
            arrow = ">" if self.kind.startswith("SEND") else "<"
            return f"{self.kind}(s{self.stage},m{self.micro}{arrow}r{self.peer})"
        return f"{self.kind}(s{self.stage},m{self.micro})"


@dataclass
class Schedule:
    name: str
    pp: int
    m: int
    v: int
    actions: list[list[Action]]  # one ordered list per pp rank

    @property
    def stages(self) -> int:
        return self.pp * self.v

    def to_json(self) -> dict:
        """Plain dicts and lists in a stable order, ready for plan.json."""
        def one(a: Action) -> dict:
            d = {"kind": a.kind, "stage": a.stage, "micro": a.micro}
            if a.peer is not None:
                d["peer"] = a.peer
            return d
        return {"name": self.name, "pp": self.pp, "micro_batches": self.m, "virtual": self.v,
                "actions": [[one(a) for a in rank] for rank in self.actions]}

    @classmethod
    def from_json(cls, data: dict | str) -> "Schedule":
        if isinstance(data, str):
            data = json.loads(data)
        actions = [[Action(a["kind"], a["stage"], a["micro"], a.get("peer")) for a in rank]
                   for rank in data["actions"]]
        return cls(data["name"], data["pp"], data["micro_batches"], data["virtual"], actions)


def rank_of(stage: int, pp: int) -> int:
    return stage % pp


# ---------------------------------------------------------------- compute order
# Each builder returns, per rank, the ordered (kind, stage, micro) compute actions.

def _gpipe(pp: int, m: int) -> list[list[tuple]]:
    return [[("F", r, j) for j in range(m)] + [("B", r, j) for j in range(m)] for r in range(pp)]


def _one_f_one_b(pp: int, m: int, backward: str = "B") -> list[list[tuple]]:
    """PipeDream-flush: (pp − r − 1) warm-up forwards, then F/B pairs, then the rest of B."""
    orders = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        seq = [("F", r, j) for j in range(warm)]
        for i in range(m - warm):
            seq += [("F", r, warm + i), (backward, r, i)]
        seq += [(backward, r, j) for j in range(m - warm, m)]
        orders.append(seq)
    return orders


def _zb_h1(pp: int, m: int) -> list[list[tuple]]:
    """ZB-H1 (Qi et al. 2023): 1F1B with B split into I and W, rank r deferring W by r.

    W(j) on rank r runs right after I(j + r), the rest after the last I. Rank r
    then holds at most (pp − r) + r = pp activations, rank 0's 1F1B peak, and
    the deferred Ws fill the cool-down bubble: makespan 3m + pp − 1 units for
    m ≥ pp (F = I = W = 1) instead of 1F1B's 3(m + pp − 1).
    """
    orders = []
    for r, seq in enumerate(_one_f_one_b(pp, m, backward="I")):
        out, next_w = [], 0
        for kind, stage, j in seq:
            out.append((kind, stage, j))
            if kind == "I" and j - r >= 0:
                out.append(("W", stage, j - r))
                next_w += 1
        out += [("W", r, j) for j in range(next_w, m)]
        orders.append(out)
    return orders


def _interleaved(pp: int, m: int, v: int) -> list[list[tuple]]:
    """Megatron's interleaved 1F1B: rank r walks m·v virtual micro-batches.

    Forward k runs chunk (k mod pp·v) // pp on micro-batch (k // pp·v)·pp + k mod pp;
    backward k runs the chunks in reverse. Warm-up is 2(pp − r − 1) + (v − 1)·pp
    forwards, capped at m·v, then one forward one backward, then the rest.
    """
    total = m * v

    def unit(k: int, forward: bool, r: int) -> tuple:
        chunk = (k % (pp * v)) // pp
        if not forward:
            chunk = v - 1 - chunk
        micro = (k // (pp * v)) * pp + k % pp
        return ("F" if forward else "B", chunk * pp + r, micro)

    orders = []
    for r in range(pp):
        warm = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        seq = [unit(k, True, r) for k in range(warm)]
        for i in range(total - warm):
            seq += [unit(warm + i, True, r), unit(i, False, r)]
        seq += [unit(k, False, r) for k in range(total - warm, total)]
        orders.append(seq)
    return orders


# ---------------------------------------------------------------- validation

def _check(name: str, pp: int, m: int, v: int) -> None:
    if name not in SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {name!r}", hint=f"choose one of {', '.join(SCHEDULES)}")
    for what, n in (("pp", pp), ("micro-batches", m), ("virtual", v)):
        if n < 1:
            raise PlanError(f"pipeline {what} must be ≥ 1, got {n}")
    if name != "interleaved_1f1b" and v != 1:
        raise PlanError(f"{name} has one stage per rank, got virtual {v}",
                        hint="use schedule=interleaved_1f1b for virtual stages")
    if name == "interleaved_1f1b" and m % pp:
        raise PlanError(f"interleaved 1F1B needs micro-batches {m} to be a multiple of pp {pp}",
                        hint=f"use {m + pp - m % pp} or {m - m % pp or pp} micro-batches")


# ---------------------------------------------------------------- P2P placement

def _deps(kind: str, s: int, j: int, last: int, split: dict) -> list[tuple]:
    """Compute actions that must finish before (kind, s, j) starts."""
    if kind == "F":
        return [("F", s - 1, j)] if s > 0 else []
    if kind in ("B", "I"):
        return [("F", s, j)] + ([(split[s + 1], s + 1, j)] if s < last else [])
    return [("I", s, j)]  # W


def _ideal_starts(orders: list[list[tuple]], last: int, costs: dict | None = None) -> dict[tuple, tuple[int, int]]:
    """(kind, stage, micro) -> (start, end) with unit costs (or `costs`: (kind, stage) -> int) and free
    communication."""
    split = {}
    for seq in orders:
        for kind, s, _ in seq:
            if kind in ("B", "I"):
                split[s] = kind
    times: dict[tuple, tuple[int, int]] = {}
    ptr, free = [0] * len(orders), [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for r, seq in enumerate(orders):
            while ptr[r] < len(seq):
                act = seq[ptr[r]]
                deps = _deps(*act, last, split)
                if any(d not in times for d in deps):
                    break
                start = max([free[r]] + [times[d][1] for d in deps])
                free[r] = start + (costs[act[:2]] if costs else _ORDER_COST[act[0]])
                times[act] = (start, free[r])
                ptr[r] += 1
                progressed = True
    stuck = [r for r, seq in enumerate(orders) if ptr[r] < len(seq)]
    if stuck:  # a bug in a builder above, not a user error
        raise AssertionError(f"compute order deadlocks on ranks {stuck}")
    return times


def _with_p2p(orders: list[list[tuple]], pp: int, stages: int, costs: dict | None = None) -> list[list[Action]]:
    """Interleave sends/receives into the compute order by one global message key.

    A message's key is the first instant, from its producer's end to its
    consumer's start in the ideal run, at which neither rank is mid-compute:
    both then meet at a P2P run, so a rendezvous send costs no waiting and the
    simulator reproduces the ideal timeline. With no such instant the key is
    the producer's end (still deadlock-free; the sender may wait).
    """
    times = _ideal_starts(orders, stages - 1, costs)
    inside: list[set[int]] = [set() for _ in range(pp)]  # instants a rank is mid-compute
    for r, seq in enumerate(orders):
        for act in seq:
            start, end = times[act]
            inside[r].update(range(start + 1, end))
    keyed: list[list[tuple]] = [[] for _ in range(pp)]
    for r, seq in enumerate(orders):
        for kind, s, j in seq:
            # compute sorts after P2P of the same instant: its input receive comes first
            keyed[r].append(((times[(kind, s, j)][0], 1, 0, 0, 0), Action(kind, s, j)))
            if kind == "F" and s < stages - 1 and rank_of(s + 1, pp) != r:
                dst, msg, consumer = rank_of(s + 1, pp), ("F", s + 1), ("F", s + 1, j)
            elif kind in ("B", "I") and s > 0 and rank_of(s - 1, pp) != r:
                dst, msg, consumer = rank_of(s - 1, pp), ("B", s - 1), (kind, s - 1, j)
            else:
                continue
            ready, need = times[(kind, s, j)][1], times[consumer][0]
            meet = next((t for t in range(ready, need + 1) if t not in inside[r] and t not in inside[dst]), ready)
            key = (meet, 0, 0 if msg[0] == "F" else 1, s, j)
            keyed[r].append((key, Action(f"SEND_{msg[0]}", s, j, dst)))
            keyed[dst].append((key, Action(f"RECV_{msg[0]}", msg[1], j, r)))
    return [[a for _, a in sorted(seq, key=lambda x: x[0])] for seq in keyed]


def connections(schedule: Schedule) -> list[list[tuple[int, bool, bool]]]:
    """Per pp rank, every P2P connection its actions use, as (peer, sends to it, receives from it).

    One global order: pairs {a, b} sorted by (min, max), each listed on both of its
    ranks. The executor brings the connections up in this order before its first
    step (NCCL sets a connection up lazily, blocking the host until the peer reaches
    the same connection; docs/pipeline.md): every rank walks the same sorted pairs,
    so the smallest pair not yet up always has both of its ranks waiting on it.
    """
    used: dict[tuple[int, int], set[tuple[int, int]]] = {}  # (lo, hi) -> directed (src, dst)
    for r, seq in enumerate(schedule.actions):
        for a in seq:
            if a.is_p2p:
                src, dst = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
                used.setdefault((min(r, a.peer), max(r, a.peer)), set()).add((src, dst))
    out: list[list[tuple[int, bool, bool]]] = [[] for _ in range(schedule.pp)]
    for (lo, hi), dirs in sorted(used.items()):
        out[lo].append((hi, (lo, hi) in dirs, (hi, lo) in dirs))
        out[hi].append((lo, (hi, lo) in dirs, (lo, hi) in dirs))
    return out


def build_schedule(name: str, pp: int, micro_batches: int, virtual: int = 1,
                   order_costs: dict | None = None) -> Schedule:
    """The named schedule for `pp` ranks, `micro_batches` per step, `virtual` stages per rank.

    `order_costs` ({kind: [seconds per stage]}) places the sends and receives for those costs
    instead of unit costs (the cost model's simulation: the order the real costs call for; any
    positive costs keep it deadlock-free). The compiled executor uses unit costs."""
    orders = _orders(name, pp, micro_batches, virtual)
    return Schedule(name, pp, micro_batches, virtual,
                    _with_p2p(orders, pp, pp * virtual, order_instants(order_costs)))


def _orders(name: str, pp: int, m: int, virtual: int) -> list[list[tuple]]:
    """The named schedule's compute order per rank, checked (`_check`)."""
    _check(name, pp, m, virtual)
    return {"gpipe": lambda: _gpipe(pp, m),
            "1f1b": lambda: _one_f_one_b(pp, m),
            "zb_h1": lambda: _zb_h1(pp, m),
            "interleaved_1f1b": lambda: _interleaved(pp, m, virtual)}[name]()


# a compute action's change of the micro-batches a rank holds activations for: its forward ran, its backward
# (B, or ZB-H1's W, which frees them) has not
HOLDS = {"F": 1, "B": -1, "I": 0, "W": -1}


def _peak(kinds) -> int:
    held = most = 0
    for kind in kinds:
        held += HOLDS.get(kind, 0)
        most = max(most, held)
    return most


def peak_inflight(name: str, pp: int, micro_batches: int, virtual: int = 1) -> list[int]:
    """Per pp rank, the most micro-batches in flight (`parc.passes.simulate.simulate`'s peak_inflight), read off
    the compute order alone: it depends on neither the costs nor where the sends go, so a caller that only needs
    memory need not build the schedule (its sends, the costly part) or time it. `deepspeed_train`'s schedule:
    `peak_of(schedule)`."""
    return list(_peaks(name, pp, micro_batches, virtual))


@functools.lru_cache(maxsize=4096)
def _peaks(name: str, pp: int, micro_batches: int, virtual: int) -> tuple[int, ...]:
    """`peak_inflight`, once per schedule shape (the planner asks for each shape again and again)."""
    return tuple(_peak(kind for kind, _, _ in seq) for seq in _orders(name, pp, micro_batches, virtual))


def peak_of(schedule: Schedule) -> list[int]:
    """`peak_inflight` of a built schedule."""
    return [_peak(a.kind for a in seq) for seq in schedule.actions]


def deepspeed_train(pp: int, m: int) -> Schedule:
    """DeepSpeed's pipeline engine's `TrainSchedule` (deepspeed/runtime/pipe/schedule.py, unchanged from the
    engine's first commit 65c2f974d, 2020-09, to the end of 2022 but for typos), as parc actions: for pricing
    another framework's run (`parc report --pp-engine deepspeed`), never compiled.

    Every stage walks 2 (m + pp − 1) steps; at a step a stage of the step's parity runs a forward, the other
    a backward (`_step_to_micro_batch`), or nothing where the micro-batch id is out of range. A forward step
    posts RecvActivation(this micro-batch) then SendGrad(the previous step's); a backward step
    SendActivation(the previous step's) then RecvGrad(this micro-batch): an output leaves one step after it
    is made. Here RECV_F, SEND_B, SEND_F, RECV_B. The engine's transfers are blocking (runtime/pipe/p2p.py:
    `dist.send`/`dist.recv`, or `dist.broadcast` over a two-rank group before torch 1.8; `async_op` is
    asserted False): time it with the simulator's `p2p="blocking", send_waits=True`."""
    actions = []
    for s in range(pp):
        seq: list[Action] = []
        prev = -1
        for t in range(2 * (m + pp - 1)):
            forward = t % 2 == s % 2
            if forward:              # _even_step_forward_id, _odd_step_forward_id
                k = t // 2 - s // 2
            elif t % 2 == 0:         # _even_step_backward_id (an odd stage)
                k = t // 2 - pp + (s + 1) // 2
            else:                    # _odd_step_backward_id (an even stage)
                k = (t - 1) // 2 - pp + 1 + s // 2
            valid, prev_valid = 0 <= k < m, 0 <= prev < m
            if forward and s > 0:
                seq += [Action("RECV_F", s, k, s - 1)] * valid + [Action("SEND_B", s, prev, s - 1)] * prev_valid
            elif not forward and s < pp - 1:
                seq += [Action("SEND_F", s, prev, s + 1)] * prev_valid + [Action("RECV_B", s, k, s + 1)] * valid
            if valid:
                seq.append(Action("F" if forward else "B", s, k))
            prev = k
        actions.append(seq)
    return Schedule("deepspeed_train", pp, m, 1, actions)


def order_instants(order_costs: dict | None) -> dict | None:
    """`order_costs` as the small integer instants the sends are placed by ({(kind, stage): n}, the smallest
    cost 2, the largest ≤ 16): costs with the same instants place the same schedule."""
    if not order_costs:
        return None
    pos = [c for v in order_costs.values() for c in v if c > 0] or [1.0]
    unit = max(min(pos) / 2, max(pos) / 16)
    return {(k, st): max(1, round(v[st] / unit)) for k, v in order_costs.items() for st in range(len(v))}


# ---------------------------------------------------------------- closed forms, advice, text

def bubble_formula(name: str, pp: int, m: int, v: int = 1) -> float:
    """DESIGN.md's idle fraction: (p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1).

    zb_h1 with F = I = W: (p−1)/(3m+p−1), the paper's (p−1)(T_F+T_B−T_W) over
    the step, valid for m ≥ p.
    """
    if name == "interleaved_1f1b":
        return (pp - 1) / (v * m + pp - 1)
    if name == "zb_h1":
        return (pp - 1) / (3 * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


def schedule_diagnostics(name: str, pp: int, m: int, v: int = 1) -> list[Diagnostic]:
    """Errors a builder would raise, as diagnostics, plus warnings about idle time."""
    try:
        _check(name, pp, m, v)
    except PlanError as e:
        return list(e.diagnostics)
    out = []
    if pp > 1 and m < pp and name in ("1f1b", "gpipe", "zb_h1"):
        idle = (pp - 1) / (m + pp - 1)
        label = {"1f1b": "1F1B", "gpipe": "GPipe", "zb_h1": "ZB-H1"}[name]
        out.append(Diagnostic(
            f"{label} with {m} micro-batches on pp {pp} idles {idle:.0%} of the step: "
            f"bubble (p−1)/(m+p−1) = {pp - 1}/{m + pp - 1}",
            hint=f"use at least {pp} micro-batches (ideally ≥ {4 * pp})", severity="warning"))
    return out


def format_schedule(schedule: Schedule, p2p: bool = False) -> str:
    """One line per rank, e.g. `r0: F0 F1 F2 B0 …`; `.c` marks virtual chunk c when v > 1."""
    def token(a: Action) -> str:
        chunk = f".{a.stage // schedule.pp}" if schedule.v > 1 else ""
        if a.is_p2p:
            arrow = ">" if a.kind.startswith("SEND") else "<"
            return f"{a.kind[0].lower()}{a.kind[-1].lower()}{a.micro}{chunk}{arrow}{a.peer}"
        return f"{a.kind}{a.micro}{chunk}"
    return "\n".join(f"r{r}: " + " ".join(token(a) for a in seq if p2p or not a.is_p2p)
                     for r, seq in enumerate(schedule.actions))
