"""A memo of pipeline schedules, their simulations and stages' compute prices, for callers that estimate many plans.

`cost.estimate` builds a schedule (name, pp, micro-batches, virtual stages) and times it with each
stage's costs (`timing`: `parc.passes.simulate`'s executor rules and figures, without its checks).
Candidates of a search that differ only in what the pipeline does not see (ZeRO stage, the probe of the
same shape) ask for the same schedules and timings; one `Schedules` passed to every `estimate` of the
search (`estimate(..., schedules=memo)`) builds each once and times it once per set of costs. Schedules
are pure functions of their arguments, so sharing them changes no result.

Schedules of more than `KEPT_SLOTS` slots are kept up to `LARGE_SLOTS` slots in all, the least recently
asked for dropped first (a search may build hundreds of 10^4–10^5 slots); a dropped one is rebuilt when asked
for again, and its timings stay memoized by what built it.
"""
from __future__ import annotations

import weakref
from array import array
from collections import OrderedDict
from functools import reduce
from operator import add, itemgetter

KEPT_SLOTS = 4096        # pp × virtual × micro-batches: a schedule of more is large
LARGE_SLOTS = 1 << 18    # the slots of the large schedules kept at once


def _frozen(v):
    """`v` hashable: per-stage costs arrive as lists, order costs as dicts of lists."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    return v


class Schedules:
    """Builds and simulates schedules through `parc.passes.schedule` / `parc.passes.simulate`, each
    distinct call once. Holds every schedule it built, so their ids stay unique as simulation keys."""

    def __init__(self):
        self.built: dict = {}
        self.large: OrderedDict = OrderedDict()   # build key → (slots, a schedule over KEPT_SLOTS), oldest first
        self.large_slots = 0
        self.key_of: dict = {}   # id of a schedule built here → its build key (dropped when it is freed)
        self.ran: dict = {}
        # (ids of a stage's statistics and the hardware, dtype, tp, attention) → (the statistics, the hardware,
        # their (forward, backward) seconds from parc.analysis.compute): held with both, so their ids name them
        self.stage_costs: dict = {}

    def build(self, name: str, pp: int, acc: int, virtual: int = 1, **kwargs):
        from parc.passes.schedule import build_schedule, order_instants

        # costs place an order by their rounded instants: one schedule for every set of costs with the same
        key = (name, pp, acc, virtual, _frozen({**kwargs, "order_costs": order_instants(kwargs.get("order_costs"))}))
        held = self.built.get(key)
        if held is None and key in self.large:
            self.large.move_to_end(key)
            held = self.large[key][1]
        if held is None:
            held = build_schedule(name, pp, acc, virtual, **kwargs)
            slots = pp * virtual * acc
            if slots <= KEPT_SLOTS:
                self.built[key] = held
            else:
                self.large[key] = (slots, held)
                self.large_slots += slots
                while self.large_slots > LARGE_SLOTS and len(self.large) > 1:
                    self.large_slots -= self.large.popitem(last=False)[1][0]
            self.key_of[id(held)] = key
            weakref.finalize(held, self.key_of.pop, id(held), None)
        return held

    def simulate(self, schedule, **kwargs):
        """`parc.passes.simulate.simulate`'s timing of `schedule` (batched P2P, eager sends: the executor's):
        `timing` when only costs are given, the checking simulator otherwise. Memoized by the schedule's build
        key, or for one built elsewhere by its id (held, which keeps the id unique)."""
        from parc.passes.simulate import simulate

        built = self.key_of.get(id(schedule))
        key = (built if built is not None else id(schedule), _frozen(kwargs))
        if key not in self.ran:
            run = timing if set(kwargs) <= COSTS else simulate
            self.ran[key] = (None if built is not None else schedule, run(schedule, **kwargs))
        return self.ran[key][1]


COSTS = {"cost_f", "cost_b", "cost_i", "cost_w", "cost_comm"}


def timing(schedule, cost_f=1.0, cost_b=2.0, cost_i=1.0, cost_w=1.0, cost_comm=0.0):
    """The makespan, busy time, bubble and peak in-flight micro-batches `parc.passes.simulate.simulate` gives
    `schedule` under its default executor model (P2P batched, eager sends), without its checks or timeline:
    for schedules `parc.passes.schedule.build_schedule` made, which its tests hold to the simulator's checks.
    The same float operations in the same order, so the figures are equal, not close
    (tests/test_schedule_timing.py holds every schedule kind to it).

    The rules, as the simulator applies them: a compute action starts when the rank's previous action
    ends; a run of adjacent sends and receives is posted at once at the rank's clock, a send ends when
    posted, a receive `cost_comm` after the matching send (the k-th on its channel, rank to rank) was
    posted and not before its own post, and the rank goes on when the run has ended. Raises
    ScheduleError on a receive whose send never comes (deadlock) or a send that does not match it.

    Which action waits on which does not depend on the costs, so a schedule is walked once (`_Program`)
    and each call only does the arithmetic, in the walk's order."""
    from parc.passes.simulate import SimResult

    prog = _Program.of(schedule)
    costs = []   # flat: kind k's stage s at k × stages + s (`_Program.KINDS`)
    for c in (cost_f, cost_b, cost_i, cost_w):
        costs.extend(c if isinstance(c, (list, tuple)) else [c] * schedule.stages)
    clock, busy, posted = [0.0] * schedule.pp, [0.0] * schedule.pp, [0.0] * prog.sends
    for op, r, arg in zip(prog.ops, prog.ranks, prog.args):
        if op == _ONE:        # one compute action
            c = costs[arg]
            clock[r] += c
            busy[r] += c
        elif op == _RUN:      # compute actions back to back
            run = arg(costs)
            clock[r] = reduce(add, run, clock[r])
            busy[r] = reduce(add, run, busy[r])
        elif op == _POST:     # a run's sends, posted at the rank's clock
            for k in arg:
                posted[k] = clock[r]
        elif op == _POST_ONE:
            posted[arg] = clock[r]
        elif op == _WAIT:     # the run ends when its last receive has arrived
            clock[r] = max(clock[r], *[posted[k] + cost_comm for k in arg])
        else:
            clock[r] = max(clock[r], posted[arg] + cost_comm)
    makespan = max(clock)
    total = sum(busy)
    return SimResult(makespan, busy, 1 - total / (schedule.pp * makespan) if makespan else 0.0, list(prog.peak),
                     [[] for _ in range(schedule.pp)])


_ONE, _RUN, _POST_ONE, _POST, _WAIT_ONE, _WAIT = range(6)   # `_Program`'s steps


class _Program:
    """One schedule's walk under `timing`'s rules, costs left out, as three lists of steps (op, rank, argument):
    a rank's run of compute actions (a function giving their costs, in order), a P2P run's sends posted (their
    numbers) or its receives met (the numbers of the sends they wait for). A step of a single action, send or
    receive, as most steps of a pipeline are, holds its index or number bare (`_ONE`, `_POST_ONE`, `_WAIT_ONE`).
    Also each rank's peak micro-batches in flight, which do not depend on the costs either. Held per schedule
    while it lives: 15–18% of the memory of the schedule's own actions (tracemalloc, three schedules of 14,080
    to 97,280 actions)."""

    KINDS = {"F": 0, "B": 1, "I": 2, "W": 3}
    _held: dict = {}   # id of a live schedule → its program (dropped when the schedule is freed)

    @classmethod
    def of(cls, schedule) -> "_Program":
        program = cls._held.get(id(schedule))
        if program is None:
            program = cls._held[id(schedule)] = cls(schedule)
            weakref.finalize(schedule, cls._held.pop, id(schedule), None)
        return program

    def __init__(self, schedule):
        from parc.passes.schedule import COMPUTE
        from parc.passes.simulate import ScheduleError, _partner

        acts, p, stages = schedule.actions, schedule.pp, schedule.stages
        delta = {"F": 1, "B": -1, "W": -1, "I": 0}
        self.ops, self.ranks, self.args = array("b"), array("i"), []
        self.sends = 0         # sends numbered in posting order
        ptr, inflight, peak = [0] * p, [0] * p, [0] * p
        sent: dict = {}        # (src, dst) → [(send number, send action)], in posting order
        received: dict = {}    # (src, dst) → receives posted so far
        waiting: list = [None] * p   # per rank: the receives of its posted run, (channel, k, action)
        while any(ptr[r] < len(acts[r]) for r in range(p)):
            moved = False
            for r in range(p):
                seq, i = acts[r], ptr[r]
                n = len(seq)
                while i < n:
                    a = seq[i]
                    if a.kind in COMPUTE:
                        run = []
                        while i < n and seq[i].kind in COMPUTE:
                            a = seq[i]
                            run.append(self.KINDS[a.kind] * stages + a.stage)
                            inflight[r] += delta[a.kind]
                            peak[r] = max(peak[r], inflight[r])
                            i += 1
                        self._step(r, _RUN, run)
                        moved = True
                        continue
                    end = i
                    while end < n and seq[end].is_p2p:
                        end += 1
                    if waiting[r] is None:   # post the run: its sends at once, its receives take their place
                        waiting[r], posts = [], []
                        for b in seq[i:end]:
                            if b.kind.startswith("SEND"):
                                posts.append(self.sends)
                                sent.setdefault((r, b.peer), []).append((self.sends, b))
                                self.sends += 1
                            else:
                                ch = (b.peer, r)
                                k = received.get(ch, 0)
                                received[ch] = k + 1
                                waiting[r].append((ch, k, b))
                        if posts:
                            self._step(r, _POST, posts)
                        moved = True
                    met = []   # the run ends when its last receive has arrived; it waits while one has no send yet
                    for ch, k, b in waiting[r]:
                        got = sent.get(ch, ())
                        if k >= len(got):
                            break
                        number, s = got[k]
                        if (s.kind, s.stage, s.micro) != _partner(b):
                            raise ScheduleError(f"rank {r} {b} meets rank {ch[0]} {s} on their channel: "
                                                "sends and receives are out of order")
                        met.append(number)
                    else:   # every receive of the run has its send: go on past the run
                        if met:
                            self._step(r, _WAIT, met)
                        i, waiting[r] = end, None
                        moved = True
                        continue
                    break
                ptr[r] = i
            if not moved:
                stuck = "; ".join(f"rank {r} at {acts[r][ptr[r]]}" for r in range(p) if ptr[r] < len(acts[r]))
                raise ScheduleError(f"deadlock: no rank can progress; {stuck} waits")
        self.peak = tuple(peak)

    def _step(self, rank: int, op: int, items: list[int]) -> None:
        """A step of `op` (`_RUN`, `_POST` or `_WAIT`) on `items`; of one item, the op's one-item form (op − 1)."""
        one = len(items) == 1
        self.ops.append(op - 1 if one else op)
        self.ranks.append(rank)
        self.args.append(items[0] if one else itemgetter(*items) if op == _RUN else tuple(items))
