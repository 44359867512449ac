"""The pipeline executor: run one pp rank's schedule, action by action.

Start at `PipelineExecutor.run`. The schedule (plan.json `schedule`, built by
`parc.passes.schedule`) lists, per pp rank, compute actions (F, B, I, W of a
(stage, micro-batch)) and the sends/receives around them. The executor walks
the list in order:

- before the first step it brings up every P2P connection the schedule uses,
  one peer at a time in one global order (`parc.passes.schedule.connections`):
  NCCL sets a connection up lazily inside the `ncclGroupEnd` of the first group
  that uses it and blocks the host there until the peer reaches the same
  connection, so a group that mixed a first receive with a send the peer was
  waiting for hung every pipeline on NCCL (docs/pipeline.md "What NCCL
  requires"; `simulate(p2p="strict")` models it);
- each maximal run of adjacent SEND/RECV actions is posted as ONE
  `batch_isend_irecv`; a receive is waited only right before the compute that
  reads it, and sends are waited at the end of the step, so communication runs
  while this rank computes whatever the schedule put in between (overlap).
  NCCL returns one work for the whole batch (gloo one per operation): a receive
  waits for its batch's work either way;
- F(s, j) runs stage s's program on the received activations (fresh leaves that
  require grad) and keeps its outputs; B(s, j) runs
  `torch.autograd.backward(outputs, received output grads)` (the last stage:
  `loss / accumulation`) and the leaves' `.grad` are what SEND_B sends; then
  the micro-batch's activations are dropped at once;
- ZB-H1 splits B: I(s, j) = `torch.autograd.grad` w.r.t. the received leaves
  only (graph retained), W(s, j) = `backward(..., inputs=parameters)`. Autograd
  cannot share work between the two calls, so I + W costs about two backward
  passes through the stage instead of one; the schedule still wins when the
  bubble it fills is larger than that extra backward;
- before each backward that accumulates parameter gradients the executor calls
  `hooks.before_grad(stage, last)` — `last` on the stage's final micro-batch,
  where the trainer arms its data-parallel bucket all-reduce.

Tied parameters (an embedding on the first stage shared with the lm head on the
last) exist once per holding stage; `sync_tied` sums their gradients over the pp
ranks that hold them, once per step. `trace=True` records every action's start
and end (`trace_events`, Chrome-trace JSON via `write_chrome_trace`).
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from parc.passes.schedule import Action, Schedule, connections


@dataclass
class Stage:
    """One stage program on this rank, with its slice of the rank's state."""

    index: int
    forward: object
    state: list[torch.Tensor]
    params: list[torch.Tensor]       # trainable, for W
    recv: list[dict]                 # plan.json specs: name, shape, dtype, grad
    send: list[dict]
    last: bool


@dataclass
class _Micro:
    """What one (stage, micro-batch) holds between its F and its B/W."""

    inputs: list[torch.Tensor] = field(default_factory=list)        # received leaves
    outputs: list[torch.Tensor] = field(default_factory=list)
    out_grads: list[torch.Tensor] = field(default_factory=list)     # received for grad-carrying outputs
    in_grads: list[torch.Tensor] = field(default_factory=list)      # to send back
    works: dict[str, list] = field(default_factory=dict)            # "RECV_F"/"RECV_B" → pending works


def drop_sent(sends: deque) -> None:
    """Free the buffers of sends that are done, oldest first, stopping at the first one not done: a post then
    costs O(1) however many sends a step holds. (A scan of them all made a step quadratic in its micro-batches:
    gloo reports a send done only once it is waited, so its sends stay to the step's end: 16,000 micro-batches
    over pp 2 took 320 s a step, 11 s now.)"""
    while sends and sends[0][0].is_completed():
        sends.popleft()


class PipelineExecutor:
    def __init__(self, ctx, schedule: Schedule, stages: dict[int, Stage], scale: float, trace: bool = False):
        self.ctx, self.schedule, self.stages, self.scale = ctx, schedule, stages, scale
        self.actions: list[Action] = schedule.actions[ctx.coord["pp"]]
        self.pp_ranks = ctx.group_ranks["pp"]     # pp coordinate → global rank
        self.group = ctx.groups["pp"]
        self.device = ctx.device
        self.trace = trace
        self.trace_events: list[tuple[str, float, float]] = []  # (name, start, end), seconds from step start
        self.peak_inflight: dict[int, int] = {s: 0 for s in stages}
        self.warm = False  # P2P connections brought up (first `run`)

    # ------------------------------------------------------------ one step
    def run(self, micro_batches: list[tuple[torch.Tensor, ...]], hooks) -> torch.Tensor:
        """Run the schedule once; return the sum of the last stage's micro-batch losses (0 elsewhere)."""
        m = len(micro_batches)
        if m != self.schedule.m:
            raise RuntimeError(f"the schedule was built for {self.schedule.m} micro-batches, got {m}")
        if not self.warm:
            self.warm_up()
        self._live: dict[tuple[int, int], _Micro] = {}
        self._sends: deque = deque()   # (work, buffer) of each send posted, oldest first
        self._grads_done = {s: 0 for s in self.stages}
        self._inflight = {s: 0 for s in self.stages}
        total = torch.zeros((), device=self.device)
        if self.trace:
            dist.barrier(group=self.group)  # one time origin for every pp rank (same host clock)
            self.trace_events = []
        self._t0 = time.perf_counter()
        i, acts = 0, self.actions
        while i < len(acts):
            if acts[i].is_p2p:
                end = i
                while end < len(acts) and acts[end].is_p2p:
                    end += 1
                self._post(acts[i:end])
                i = end
                continue
            a = acts[i]
            self._wait(self._micro(a.stage, a.micro), "RECV_F" if a.kind == "F" else "RECV_B")
            t = time.perf_counter()  # after the wait: a compute slice is compute only
            with hooks.dropout_key(a.micro):  # forward and backward: a recomputed region redraws its masks
                loss = self._compute(a, micro_batches, hooks)
            if loss is not None:
                total += loss
            self._record(str(a), t)
            i += 1
        t = time.perf_counter()
        for w, _ in self._sends:
            # a work is waited once: one NCCL coalesces a batch's sends and receives into may already have been,
            # and gloo never returns from a second wait
            if not w.is_completed():
                w.wait()
        self._record("wait sends", t)
        self._sends.clear()
        if self._live:
            raise RuntimeError(f"schedule left activations of {sorted(self._live)} alive")
        return total

    def _record(self, name: str, start: float) -> None:
        if self.trace:
            self.trace_events.append((name, start - self._t0, time.perf_counter() - self._t0))

    def _micro(self, s: int, j: int) -> _Micro:
        return self._live.setdefault((s, j), _Micro())

    def _wait(self, mb: _Micro, kind: str) -> None:
        works = mb.works.pop(kind, [])
        if works:
            t = time.perf_counter()
            for w in works:
                w.wait()
            self._record(f"wait {kind}", t)

    # ------------------------------------------------------------ point to point
    def warm_up(self) -> None:
        """Bring up every connection the schedule uses before any compute: one group per peer, both
        directions in it, peers in the schedule's global order, each waited to the end on the host.

        Every pp rank calls this at its first step (collective over the pp group). The groups meet
        pairwise in one order that all ranks share, so it cannot deadlock (`simulate` checks the
        order); afterwards no `ncclGroupEnd` of the schedule sets anything up, and the schedule's
        own order (deadlock-free under rendezvous, `parc.passes.schedule`) is all that matters.
        """
        me = self.ctx.coord["pp"]
        for peer, sends, recvs in connections(self.schedule)[me]:
            ops = []
            if sends:
                ops.append(dist.P2POp(dist.isend, torch.zeros(1, device=self.device), self.pp_ranks[peer], self.group))
            if recvs:
                ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=self.device), self.pp_ranks[peer], self.group))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the next peer's group starts on an idle device
        self.warm = True

    def _empty(self, spec: dict) -> torch.Tensor:
        return torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=self.device)

    def _post(self, run: list[Action]) -> None:
        t = time.perf_counter()
        drop_sent(self._sends)
        ops, owners = [], []
        for a in run:
            peer = self.pp_ranks[a.peer]
            mb = self._micro(a.stage, a.micro)
            st = self.stages[a.stage]
            if a.kind == "SEND_F":
                tensors = [o.detach().contiguous() for o in mb.outputs]
            elif a.kind == "SEND_B":
                tensors, mb.in_grads = mb.in_grads, []
                self._release(a.stage, a.micro)
            elif a.kind == "RECV_F":
                mb.inputs = [self._empty(spec) for spec in st.recv]
                tensors = mb.inputs
            else:  # RECV_B
                mb.out_grads = [self._empty(spec) for spec in st.send if spec["grad"]]
                tensors = mb.out_grads
            op = dist.isend if a.kind.startswith("SEND") else dist.irecv
            for x in tensors:
                ops.append(dist.P2POp(op, x, peer, self.group))
                owners.append((a, mb, x))
        works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == 1 and len(ops) > 1:  # NCCL coalesces the batch into one work: it covers every op
            works = works * len(ops)
        if len(works) != len(ops):
            raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {len(ops)} operations")
        for (a, mb, x), w in zip(owners, works):
            if a.kind.startswith("SEND"):
                self._sends.append((w, x))  # the buffer must live until its send completes
            else:
                mb.works.setdefault(a.kind, []).append(w)
        self._record("post " + " ".join(str(a) for a in run), t)

    def _release(self, s: int, j: int) -> None:
        """Drop a micro-batch's activations once nothing of it is left to send."""
        mb = self._live.get((s, j))
        if mb is not None and not mb.outputs and not mb.in_grads and not mb.works:
            del self._live[(s, j)]

    # ------------------------------------------------------------ compute
    def _compute(self, a: Action, micro_batches, hooks):
        s, j = a.stage, a.micro
        st, mb = self.stages[s], self._micro(s, j)
        if a.kind == "F":
            for x, spec in zip(mb.inputs, st.recv):
                x.requires_grad_(spec["grad"])
            probe = hooks.probe  # runtime/memory.py, when measuring activations
            with hooks.saving():  # what the forward's saved tensors become (runtime/train.py `saving`)
                out = st.forward(*st.state, *mb.inputs, *micro_batches[j])
            mb.outputs = list(out)
            if probe:
                probe.sample(mb.outputs)
            self._inflight[s] += 1
            self.peak_inflight[s] = max(self.peak_inflight[s], self._inflight[s])
            return out[0].detach() if st.last else None
        tensors, grads = self._grad_pairs(st, mb)
        leaves = [x for x, spec in zip(mb.inputs, st.recv) if spec["grad"]]
        if a.kind == "I":
            got = torch.autograd.grad(tensors, leaves, grads, retain_graph=True, allow_unused=True) if leaves else []
            mb.in_grads = [g if g is not None else torch.zeros_like(x) for g, x in zip(got, leaves)]
            return None
        self._grads_done[s] += 1
        hooks.before_grad(s, self._grads_done[s] == self.schedule.m)
        if tensors:
            if a.kind == "W":
                params = [p for p in st.params if p.requires_grad]
                torch.autograd.backward(tensors, grads, inputs=params)
            else:
                torch.autograd.backward(tensors, grads)
        if a.kind == "B":
            mb.in_grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]
        mb.outputs, mb.inputs, mb.out_grads = [], [], []
        self._inflight[s] -= 1
        if s == 0 or not mb.in_grads:
            self._release(s, j)
        return None

    def _grad_pairs(self, st: Stage, mb: _Micro) -> tuple[list, list]:
        if st.last:
            return [mb.outputs[0] * self.scale], [None]
        carry = [o for o, spec in zip(mb.outputs, st.send) if spec["grad"]]
        pairs = [(o, g) for o, g in zip(carry, mb.out_grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    # ------------------------------------------------------------ after the step
    def sync_tied(self, tied: list[tuple[torch.Tensor, object]]) -> None:
        """Sum each tied parameter's gradient over the pp ranks holding it (after the dp sync)."""
        for p, group in tied:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)

    def gather_trace(self) -> list[list[tuple[str, float, float]]]:
        """Every pp rank's events of the last traced step, on every pp rank, pp order."""
        out = [None] * len(self.pp_ranks)
        dist.all_gather_object(out, self.trace_events, group=self.group)
        return out


def tied_groups(plan_json: dict, rank: int) -> list[tuple[str, object]]:
    """(fqn, process group) for each tied parameter this rank holds. Collective: every rank calls it."""
    out = []
    for tie in plan_json.get("tied", []):
        for pp_group in plan_json["groups"]["pp"]:
            ranks = [pp_group[p] for p in tie["pp_ranks"]]
            pg = dist.new_group(ranks)  # every rank creates every group, same order
            if rank in ranks:
                out.append((tie["fqn"], pg))
    return out


def measured_bubble(events: list[list[tuple[str, float, float]]]) -> float:
    """1 − Σ compute time / (pp × makespan), from traced events; makespan = last compute end over ranks."""
    compute = [[(s, e) for n, s, e in rank if n[:2] in ("F(", "B(", "I(", "W(")] for rank in events]
    span = max(e for rank in compute for _, e in rank) - min(s for rank in compute for s, _ in rank)
    busy = sum(e - s for rank in compute for s, e in rank)
    return 1 - busy / (len(events) * span)


def write_chrome_trace(events: list[list[tuple[str, float, float]]], path: Path, step: int = 0) -> None:
    """Chrome-trace / Perfetto JSON: one process per pp rank, compute and communication as slices."""
    out = []
    for r, rank in enumerate(events):
        out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"pp rank {r}"}})
        for name, s, e in rank:
            tid = 0 if name[:2] in ("F(", "B(", "I(", "W(") else 1
            out.append({"name": name, "ph": "X", "pid": r, "tid": tid, "ts": s * 1e6, "dur": (e - s) * 1e6,
                        "args": {"step": step}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))


# ---------------------------------------------------------------- wiring into the trainer

def rank_programs(plan_json: dict, rank: int) -> list[str]:
    """The programs this rank runs: one per virtual stage it holds, chunk order."""
    me = plan_json["ranks"][rank]
    return me.get("programs") or [me["program"]]


def merged_entry(plan_json: dict, rank: int) -> dict:
    """One program entry holding the state and buckets of every stage on this rank, in stage order."""
    names = rank_programs(plan_json, rank)
    progs = [plan_json["programs"][n] for n in names]
    if len(progs) == 1:
        return progs[0]
    return {**progs[0], "state": [e for p in progs for e in p["state"]],
            "buckets": [b for p in progs for b in p["buckets"]],
            "experts": [x for p in progs for x in p.get("experts", [])]}


class StageBuckets:
    """Per stage, its `GradBuckets`: each stage arms its all-reduces on its own last micro-batch.

    A stage holding experts (expert parallelism, runtime/parallel/expert_parallel.py) has two: its dense
    gradients averaged over dp, its expert slots' summed over `edp` = (group, size), the ranks
    holding the same experts, and divided by dp. An ep group's ranks share the pp and tp
    coordinates (parc/mesh.py expert_groups), so they run the same stage in the same order."""

    def __init__(self, plan_json: dict, rank: int, params: dict[str, torch.Tensor], group, dp: int,
                 edp: tuple | None = None, divisor: int | None = None):
        """`group`, `dp`: the ranks a dense gradient is summed over and their count; `divisor` (default dp):
        what the sum is divided by (context parallelism: summed over dp × cp, divided by dp)."""
        from parc.runtime.parallel.data_parallel import GradBuckets
        from parc.runtime.precision import reduce_dtype

        self.by_stage: dict[int, list] = {}
        for name in rank_programs(plan_json, rank):
            prog = plan_json["programs"][name]
            self.by_stage[prog["stage"]] = [GradBuckets(params, prog["buckets"], group, dp, divisor=divisor,
                                                        reduce_dtype=reduce_dtype(plan_json["plan"]))]
            if prog.get("expert_buckets"):
                self.by_stage[prog["stage"]].append(GradBuckets(params, prog["expert_buckets"], edp[0], edp[1],
                                                                divisor=dp))

    def start(self, stage: int, sync: bool) -> None:
        for b in self.by_stage[stage]:
            b.start_micro_batch(sync)

    def finish(self) -> None:
        for bs in self.by_stage.values():
            for b in bs:
                b.finish()

    def zero(self) -> None:
        for bs in self.by_stage.values():
            for b in bs:
                b.zero()


def build_executor(trainer, trace: bool = False) -> PipelineExecutor:
    """Stages of this rank from the trainer's loaded state (`trainer.state` follows `merged_entry` order)."""
    from parc.codegen import load_program
    from parc.runtime import compiled, precision

    art, ctx, plan = trainer.art, trainer.ctx, trainer.art.plan
    stages, offset = {}, 0
    for name in rank_programs(plan, ctx.rank):
        prog = plan["programs"][name]
        n = len(prog["state"])
        state = trainer.state[offset:offset + n]
        offset += n
        mode = plan["plan"].get("compile", "none")  # runtime/compiled.py; uncompiled: runtime/eager.py
        fwd = load_program(art.programs[name], ctx.device, str(art.root / prog["file"]), eager=mode == "none")
        fwd = compiled.program(fwd, mode)
        fwd = precision.wrap(fwd, plan["plan"]["precision"], ctx.device, trainer.casts)  # bf16 copies, autocast
        stages[prog["stage"]] = Stage(prog["stage"], fwd, state, [t for t in state if t.requires_grad],
                                      precision.boundary_specs(prog["recv"], plan["plan"]["precision"]),
                                      precision.boundary_specs(prog["send"], plan["plan"]["precision"]), prog["last"])
    schedule = Schedule.from_json(plan["schedule"])
    if any(a.kind == "I" for rank in schedule.actions for a in rank):  # zero-bubble: I then W, retain_graph
        compiled.split_backward(plan["plan"].get("compile", "none"))  # before the programs compile (lazily)
    return PipelineExecutor(ctx, schedule, stages, 1.0 / trainer.accumulation, trace)
