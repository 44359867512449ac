"""Run a `Schedule` on paper: timing, bubble, memory, and every check an executor relies on.

Start at `simulate(schedule, ...)`. It steps all pp ranks' action lists in lock
step with the executor's P2P semantics (`p2p="batched"`: each maximal run of
adjacent SEND/RECV actions is posted at once and waited before the next compute;
`p2p="blocking"`: each SEND/RECV waits for its partner alone). Progress follows
rendezvous rules: a pair matches only once both ends are posted, and messages on
one (src → dst) channel match in order, as NCCL does. Timing is separate: a
receive ends `cost_comm` after its send is posted; a send ends when posted
(eager) or, with `send_waits=True`, when its receiver is there too.

`p2p="strict"` is the second executor model: what NCCL may do, at its strictest
(docs/pipeline.md "What NCCL requires"). Each run is one NCCL group, as in
"batched", and on top of that:
- a P2P connection (one direction between two ranks) is set up lazily by the
  first group that uses it, and that group's `ncclGroupEnd` blocks the host —
  none of its operations is launched — until the peer's host reaches a group
  with an operation on the same connection (`connect="lazy"`, today's NCCL);
  `connect="warm"` models an executor that brought every connection up before
  its first step, in `parc.passes.schedule.connections` order, and checks that
  this warm-up cannot deadlock itself;
- all P2P operations of a rank run on one stream in issue order, a send
  finishes only when its receive runs, and the host may have to wait for the
  device (CUDA lazy kernel loading and allocator syncs wait for every kernel
  queued, NCCL's included): so before its next compute a rank waits for its
  whole group, sends too — the batched rule, which is why the two share code.

Raises `ScheduleError`, naming rank, position and action, when a schedule would
deadlock, match a send with the wrong receive, send to the wrong peer, run
compute before its inputs (F(s) before F(s−1) arrived, B before F, B(s) before
B(s+1) arrived, W before I), run something twice, or leave a (stage, micro)
without F and B (or I and W). Assumes `parc.passes.schedule`'s conventions.
"""

from __future__ import annotations

from dataclasses import dataclass

from parc.errors import ParcError
from parc.passes.schedule import COMPUTE, Action, Schedule, connections, rank_of


class ScheduleError(ParcError):
    """A schedule an executor could not run: deadlock, mismatch or dependency violation."""


@dataclass
class SimResult:
    makespan: float
    busy: list[float]                       # compute time per rank
    bubble_fraction: float                  # 1 − Σ busy / (pp × makespan)
    peak_inflight: list[int]                # activations held per rank: F done, B/W not yet
    timeline: list[list[tuple[float, float, Action]]]  # per rank (start, end, action)


def _where(r: int, i: int, a: Action) -> str:
    return f"rank {r} action {i} {a}"


def _partner(a: Action) -> tuple[str, int, int]:
    """The (kind, stage, micro) the other end of a P2P action must carry."""
    return {"SEND_F": ("RECV_F", a.stage + 1), "RECV_F": ("SEND_F", a.stage - 1),
            "SEND_B": ("RECV_B", a.stage - 1), "RECV_B": ("SEND_B", a.stage + 1)}[a.kind] + (a.micro,)


class _Run:
    """Mutable state of one simulation; `simulate` is the public entry."""

    def __init__(self, sch: Schedule, costs: dict, comm: float, batched: bool, send_waits: bool,
                 lazy_connect: bool = False):
        self.sch, self.costs, self.comm, self.batched, self.send_waits = sch, costs, comm, batched, send_waits
        self.lazy = lazy_connect                       # strict model: connections not yet up
        self.connected: set[tuple[int, int]] = set()  # (src, dst) set up
        self.arrived: dict[tuple[int, int], set[int]] = {}  # (src, dst) -> ranks in a group using it
        self.handshake: dict[int, tuple[int, int]] = {}     # rank -> connection its group end waits on
        self.S, p = sch.stages, sch.pp
        self.ptr, self.clock = [0] * p, [0.0] * p
        self.done: dict[tuple, float] = {}     # (kind, stage, micro) -> end
        self.got: set[tuple] = set()           # (RECV kind, stage, micro) completed
        self.inflight, self.peak = [0] * p, [0] * p
        self.busy = [0.0] * p
        self.timeline: list[list] = [[] for _ in range(p)]
        self.posted: dict[tuple[int, int], float] = {}   # (rank, index) -> post time
        self.finished: dict[tuple[int, int], float] = {}  # (rank, index) -> completion
        self.channel: dict[tuple[int, int, str], list] = {}  # (src, dst, "send"/"recv") -> [(r, i)]

    # -- compute -----------------------------------------------------------
    def _need(self, r: int, i: int, a: Action, key: tuple, what: str) -> None:
        if key not in self.done and key not in self.got:
            raise ScheduleError(f"{_where(r, i, a)} runs before {what}")

    def compute(self, r: int, i: int, a: Action) -> None:
        s, j, S = a.stage, a.micro, self.S
        key = (a.kind, s, j)
        if key in self.done:
            raise ScheduleError(f"{_where(r, i, a)} runs a second time")
        if a.kind == "F" and s > 0:
            same = rank_of(s - 1, self.sch.pp) == r
            self._need(r, i, a, ("F", s - 1, j) if same else ("RECV_F", s, j),
                       f"F(s{s - 1},m{j})" + ("" if same else " reaches it (no RECV_F earlier)"))
        if a.kind in ("B", "I"):
            other = "I" if a.kind == "B" else "B"
            if (other, s, j) in self.done:
                raise ScheduleError(f"{_where(r, i, a)} mixes B with I/W for one micro-batch")
            self._need(r, i, a, ("F", s, j), f"its F(s{s},m{j})")
            if s < S - 1:
                if rank_of(s + 1, self.sch.pp) == r:
                    if ("B", s + 1, j) not in self.done and ("I", s + 1, j) not in self.done:
                        raise ScheduleError(f"{_where(r, i, a)} runs before the backward of s{s + 1}")
                else:
                    self._need(r, i, a, ("RECV_B", s, j), "its gradient arrives (no RECV_B earlier)")
        if a.kind == "W":
            self._need(r, i, a, ("I", s, j), f"its I(s{s},m{j})")
        start = self.clock[r]
        cost = self.costs[a.kind]
        cost = cost[s] if isinstance(cost, (list, tuple)) else cost   # per-stage costs (the cost model's)
        end = start + cost
        self.done[key] = end
        self.clock[r], self.busy[r] = end, self.busy[r] + cost
        self.timeline[r].append((start, end, a))
        self.inflight[r] += {"F": 1, "B": -1, "W": -1, "I": 0}[a.kind]
        self.peak[r] = max(self.peak[r], self.inflight[r])

    # -- point to point ----------------------------------------------------
    def post(self, r: int, i: int, a: Action) -> None:
        p = self.sch.pp
        want_kind, want_stage, _ = _partner(a)
        if not 0 <= want_stage < self.S or a.peer != rank_of(want_stage, p) or a.peer == r:
            raise ScheduleError(f"{_where(r, i, a)} has no partner there: stage s{want_stage} "
                                f"lives on rank {rank_of(want_stage, p) if 0 <= want_stage < self.S else 'none'}")
        if a.kind.startswith("SEND"):
            prod = ("F",) if a.kind == "SEND_F" else ("B", "I")
            if not any((k, a.stage, a.micro) in self.done for k in prod):
                raise ScheduleError(f"{_where(r, i, a)} sends before computing what it sends")
            ch = (r, a.peer, "send")
        else:
            ch = (a.peer, r, "recv")
        self.posted[(r, i)] = self.clock[r]
        mine = self.channel.setdefault(ch, [])
        mine.append((r, i))
        theirs = self.channel.get(ch[:2] + ("recv" if ch[2] == "send" else "send",), [])
        k = len(mine) - 1
        if k < len(theirs):
            self._match(r, i, a, *theirs[k])

    def _match(self, r: int, i: int, a: Action, pr: int, pi: int) -> None:
        b = self.sch.actions[pr][pi]
        if (b.kind, b.stage, b.micro) != _partner(a):
            raise ScheduleError(f"{_where(r, i, a)} meets {_where(pr, pi, b)} on their channel: "
                                f"sends and receives are out of order")
        (sr, si), (rr, ri) = ((r, i), (pr, pi)) if a.kind.startswith("SEND") else ((pr, pi), (r, i))
        arrive = self.posted[(sr, si)] + self.comm
        self.finished[(rr, ri)] = max(arrive, self.posted[(rr, ri)])
        # a rendezvous send waits for its receiver; an eager one hands the data off at once
        self.finished[(sr, si)] = max(arrive, self.posted[(rr, ri)] + self.comm) if self.send_waits \
            else self.posted[(sr, si)]
        for rank, idx, act in ((r, i, a), (pr, pi, b)):
            self.timeline[rank].append((self.posted[(rank, idx)], self.finished[(rank, idx)], act))
            if act.kind.startswith("RECV"):
                self.got.add((act.kind, act.stage, act.micro))

    def step(self, r: int) -> bool:
        """Advance rank r as far as it can; True if it moved."""
        seq, moved = self.sch.actions[r], False
        while self.ptr[r] < len(seq):
            i = self.ptr[r]
            a = seq[i]
            if a.kind in COMPUTE:
                self.compute(r, i, a)
                self.ptr[r] += 1
                moved = True
                continue
            end = i + 1
            if self.batched:
                while end < len(seq) and seq[end].is_p2p:
                    end += 1
            if self.lazy:
                ready, arrived = self._connect(r, seq[i:end])
                moved = moved or arrived
                if not ready:
                    return moved
            for k in range(i, end):
                if (r, k) not in self.posted:
                    self.post(r, k, seq[k])
                    moved = True
            if any((r, k) not in self.finished for k in range(i, end)):
                return moved
            self.clock[r] = max([self.clock[r]] + [self.finished[(r, k)] for k in range(i, end)])
            self.ptr[r] = end
            moved = True
        return moved

    def _connect(self, r: int, run: list[Action]) -> tuple[bool, bool]:
        """Strict model: rank r's group end sets up the group's new connections.

        Returns (all up, state changed). A connection is up once both of its
        ranks' hosts stand in a group using it; until then nothing of the group
        is launched.
        """
        changed, missing = False, None
        for a in run:
            c = (r, a.peer) if a.kind.startswith("SEND") else (a.peer, r)
            if c in self.connected:
                continue
            here = self.arrived.setdefault(c, set())
            if r not in here:
                here.add(r)
                changed = True
            if len(here) == 2:
                self.connected.add(c)
            elif missing is None:
                missing = c
        if missing is None:
            self.handshake.pop(r, None)
        else:
            self.handshake[r] = missing
        return missing is None, changed

    def stuck(self) -> ScheduleError:
        """Explain why no rank can move: an unpaired send/receive, else a wait cycle."""
        acts, p = self.sch.actions, self.sch.pp
        for src in range(p):
            for dst in range(p):
                sends = [(src, i) for i, a in enumerate(acts[src]) if a.kind.startswith("SEND") and a.peer == dst]
                recvs = [(dst, i) for i, a in enumerate(acts[dst]) if a.kind.startswith("RECV") and a.peer == src]
                if len(sends) != len(recvs):
                    extra, what = (sends, "receive") if len(sends) > len(recvs) else (recvs, "send")
                    r, i = extra[min(len(sends), len(recvs))]
                    return ScheduleError(f"{_where(r, i, acts[r][i])} has no matching {what}: rank {src} "
                                         f"sends {len(sends)} messages to rank {dst}, which receives {len(recvs)}")
        blocked = []
        for r in range(p):
            if self.ptr[r] < len(acts[r]):
                what = _where(r, self.ptr[r], acts[r][self.ptr[r]])
                if r in self.handshake:
                    src, dst = self.handshake[r]
                    what += (f" (its group end sets up connection r{src}→r{dst} and waits for rank "
                             f"{dst if src == r else src} to reach it)")
                blocked.append(what)
        return ScheduleError("deadlock: no rank can progress; " + "; ".join(blocked) + " waits")


def _warm_up(schedule: Schedule) -> None:
    """Walk `connections(schedule)` as the executor does before its first step: each entry is one
    group with that peer, both ranks in it at once; raise ScheduleError if the order could deadlock."""
    order, p = connections(schedule), schedule.pp
    ptr = [0] * p
    while any(ptr[r] < len(order[r]) for r in range(p)):
        moved = False
        for r in range(p):
            if ptr[r] >= len(order[r]):
                continue
            peer, sends, recvs = order[r][ptr[r]]
            if ptr[peer] < len(order[peer]) and order[peer][ptr[peer]][0] == r:
                _, peer_sends, peer_recvs = order[peer][ptr[peer]]
                if (sends, recvs) != (peer_recvs, peer_sends):
                    raise ScheduleError(f"warm-up: rank {r} and rank {peer} disagree on the directions "
                                        f"of their connection")
                ptr[r] += 1
                ptr[peer] += 1
                moved = True
        if not moved:
            waits = "; ".join(f"rank {r} waits for rank {order[r][ptr[r]][0]}"
                              for r in range(p) if ptr[r] < len(order[r]))
            raise ScheduleError(f"warm-up deadlock: {waits}")


def simulate(schedule: Schedule, cost_f: float = 1.0, cost_b: float = 2.0, cost_i: float = 1.0,
             cost_w: float = 1.0, cost_comm: float = 0.0, p2p: str = "batched",
             send_waits: bool = False, connect: str = "warm") -> SimResult:
    """Execute every rank's list; raise ScheduleError on the first thing an executor would trip on.

    Progress (and so deadlock) always follows rendezvous rules; `p2p="strict"` adds NCCL's lazy
    connection set-up (`connect="lazy"`: the executor before its warm-up; `"warm"`: after it).
    Each cost is one number, or a list of one per stage. Timing: a receive completes `cost_comm`
    after its send is posted; a send completes when
    posted (eager, buffered) unless `send_waits`, when it also waits for its receiver, like a
    large NCCL send.
    """
    if p2p not in ("batched", "blocking", "strict"):
        raise ValueError(f"p2p must be 'batched', 'blocking' or 'strict', got {p2p!r}")
    if connect not in ("warm", "lazy"):
        raise ValueError(f"connect must be 'warm' or 'lazy', got {connect!r}")
    costs = {"F": cost_f, "B": cost_b, "I": cost_i, "W": cost_w}
    strict = p2p == "strict"
    if strict and connect == "warm":
        _warm_up(schedule)
    run = _Run(schedule, costs, cost_comm, p2p != "blocking", send_waits, strict and connect == "lazy")
    for r, seq in enumerate(schedule.actions):
        for i, a in enumerate(seq):
            if not (0 <= a.stage < schedule.stages and rank_of(a.stage, schedule.pp) == r
                    and 0 <= a.micro < schedule.m):
                raise ScheduleError(f"{_where(r, i, a)} names a stage or micro-batch rank {r} does not hold")
    while any(run.ptr[r] < len(seq) for r, seq in enumerate(schedule.actions)):
        if not any([run.step(r) for r in range(schedule.pp)]):
            raise run.stuck()
    for s in range(schedule.stages):
        for j in range(schedule.m):
            full = ("B", s, j) in run.done or (("I", s, j) in run.done and ("W", s, j) in run.done)
            if ("F", s, j) not in run.done or not full:
                raise ScheduleError(f"stage s{s} micro-batch m{j} never runs "
                                    f"{'F' if ('F', s, j) not in run.done else 'B (or I and W)'} "
                                    f"on rank {rank_of(s, schedule.pp)}")
    for seq in run.timeline:
        seq.sort(key=lambda x: (x[0], x[1]))
    makespan = max(run.clock)
    total = sum(run.busy)
    return SimResult(makespan, run.busy, 1 - total / (schedule.pp * makespan) if makespan else 0.0,
                     run.peak, run.timeline)
