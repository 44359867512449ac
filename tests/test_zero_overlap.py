"""ZeRO's collectives overlap compute, as runtime/parallel/zero.py's "Overlap" says, and change no value.

Checked by the order of events on 2 gloo ranks, never by time:

- stages 1–2: the post-step all-gathers are launched in forward order and still in flight when `step`
  returns; the next forward waits for each bucket just before its layer (no aten op reads a weight
  whose gather is pending, recompute included) and computes between waits, so later layers' gathers
  run under earlier layers' compute. Under `compile` (aot_eager) the program waits the same way, bucket by
  bucket in forward order, none at the step's start; and here each gather's weights land only when its wait
  runs (`_land_at_the_wait`), so a compiled graph that read a layer's weights before its wait would train
  on the previous step's weights and part from serial;
- stages 1–3: a bucket's reduce-scatter starts while backward still produces other buckets' gradients;
- stages 2–3: at most `REDUCE_SCATTERS_IN_FLIGHT` reduce-scatters in flight; stage 3: at most two
  gathered layers alive in forward and in backward (the bound the report's memory states);
- every collective, once joined, has left its buffers to the runtime (gloo's thread holds none of them).

Exactness (bitwise where it was) is tests/test_zero.py's and tests/test_zero_combos.py's: the runs here
are also held to the serial model at test_zero.py's tolerance.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from helpers import GPT, _compile
from parc import artifact
from parc.runtime.launch import spawn
from parc.runtime.parallel import zero as zero_runtime
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

STEPS = 3
PLAN = "mesh dp=2\nbatch global=8 micro=2\nzero stage={stage}\noptimizer adamw lr=1e-2\n{extra}"
PLANS = {"zero1": (1, ""), "zero2": (2, ""), "zero3": (3, ""), "zero2_recompute": (2, 'recompute "blocks.*"\n'),
         # compiled: each layer reads its weights after its wait (the wait op writes them: a data dependency)
         "zero1_compiled": (1, "compile aot_eager\n"), "zero2_compiled": (2, "compile aot_eager\n"),
         "zero2_compiled_recompute": (2, 'recompute "blocks.*"\ncompile aot_eager\n')}


class _Reads(TorchDispatchMode):
    """Logs, in order, every aten op that reads a tensor on the storage of a bucket whose post-step
    gather is still pending (a violation), and every op that reads any bucket's weights (compute)."""

    def __init__(self, zero, events: list):
        super().__init__()
        self.zero, self.events = zero, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":  # the computation (not c10d's collectives, nor parc's wait itself)
            pending = {self.zero.full[b].untyped_storage().data_ptr() for b in self.zero._gathers}
            weights = {f.untyped_storage().data_ptr() for f in self.zero.full}
            ptrs = {a.untyped_storage().data_ptr() for a in _tensors(args, kwargs)}
            if ptrs & pending:
                self.events.append(("stale", str(func)))
            elif ptrs & weights:
                self.events.append(("compute", str(func)))
        return func(*args, **(kwargs or {}))


def _tensors(args, kwargs):
    flat = [*args, *(kwargs or {}).values()]
    out = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


class _Landing:
    """A post-step all-gather whose weights are written into the flat buffer only when it is waited on."""

    def __init__(self, full: torch.Tensor, gathered: torch.Tensor):
        self.full, self.gathered = full, gathered

    def join(self):
        self.full.copy_(self.gathered)


def _land_at_the_wait(zero) -> None:
    """Stages 1–2: after each `step`, hold every bucket's flat buffer at the previous step's weights until its
    gather is waited on, then write the gathered ones. On gloo a gather is often done before anyone reads the
    weights, which would hide a read that comes before its wait; this makes any such read train on stale
    weights, which the comparison with serial sees (the update moves every weight: lr 1e-2)."""
    step = zero.step

    def landing_step(found=None):
        before = [f.clone() for f in zero.full]
        step(found)
        with _disable_current_modes():  # the test's own copies are no reads of the program (`_Reads`)
            for b, pending in list(zero._gathers.items()):
                pending.join()
                zero._gathers[b] = _Landing(zero.full[b], zero.full[b].clone())
                zero.full[b].copy_(before[b])

    zero.step = landing_step


def _instrument(zero, events: list) -> None:
    """Record waits, launches, gradient hooks and the in-flight counts on this rank's runtime."""
    wait_gather, reduce_scatter, launch_gather = zero.wait_gather, zero._reduce_scatter, zero._start_gather

    def logged_wait(b, into=()):
        events.append(("wait", b, b in zero._gathers, len(zero._gathers)))
        wait_gather(b, into)

    def logged_rs(b, flat):
        reduce_scatter(b, flat)
        events.append(("rs", b, sum(isinstance(w, tuple) for w in zero._works)))

    def logged_start(b, dtype=None):
        # gathered buffers alive (weakly tracked), prefetches in flight, and the one starting now. gloo's worker
        # thread lets go of a finished collective's buffers a moment after `wait()` (on a busy machine, long
        # enough to count one more): the runtime is stopped in this hook, so only that thread can change the
        # count while we wait for it to settle; a buffer the runtime holds stays counted.
        def count():
            return sum(not ref.expired() for ref in zero._live.values()) + len(zero._prefetch) + 1

        alive, deadline = count(), time.monotonic() + 10
        while alive > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
            alive = count()
        events.append(("start_gather", b, alive))
        return launch_gather(b, dtype)

    zero.wait_gather, zero._reduce_scatter, zero._start_gather = logged_wait, logged_rs, logged_start
    if zero.stage < 3:  # runs after the runtime's own hook: a bucket's launch precedes its last "grad"
        for p in zero.params.values():
            p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", zero._bucket_of[id(p)])))


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        zero = trainer.zero
        local = [trainer.step(0).loss]
        pending_after_step = sorted(zero._gathers)
        launch_order = list(zero._gathers)  # dicts keep insertion order: the order `step` launched them
        events: list = []
        _instrument(zero, events)
        if zero.stage < 3:
            _land_at_the_wait(zero)
        # a dispatch mode sees an eager program's aten ops; torch.compile refuses to run under one
        eager = trainer.art.plan["plan"].get("compile", "none") == "none"
        with _Reads(zero, events) if zero.lazy_gather and eager else contextlib.nullcontext():
            for s in range(1, STEPS):
                local.append(trainer.step(s).loss)
        out[name] = {"losses": trainer.global_losses(local), "state": trainer.gathered_state(),
                     "pending_after_step": pending_after_step, "launch_order": launch_order,
                     "buckets": len(zero.buckets), "events": events, "lazy": zero.lazy_gather}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_overlap")
    # as written, never with PARC_TEST_COMPILE's `compile` added (helpers.compile_text): eager is what overlaps
    roots = {name: str(_compile(PLAN.format(stage=s, extra=e), tmp / name, GPT).root) for name, (s, e) in PLANS.items()}
    results = spawn(2, _body, roots)
    return {name: (results[0][name], roots[name]) for name in PLANS}


@pytest.mark.parametrize("name", PLANS)
def test_runs_match_serial(runs, name):
    """What is instrumented below is the plan training as serial does (test_zero.py's fp32 tolerances)."""
    run, root = runs[name]
    art = artifact.load(root)
    losses, state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    verdict = compare(run["losses"], losses, run["state"], state)
    assert verdict.loss_rel < 1e-5 and verdict.param_rel < 1e-4, verdict.render()


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero2_recompute"])
def test_post_step_gathers_overlap_the_next_forward(runs, name):
    run, _ = runs[name]
    events, n = run["events"], run["buckets"]
    assert run["lazy"]
    # step returns with every bucket's gather in flight, launched first layer first (buckets: backward order)
    assert run["pending_after_step"] == list(range(n))
    assert run["launch_order"] == list(reversed(range(n)))
    assert not [e for e in events if e[0] == "stale"], [e for e in events if e[0] == "stale"][:5]
    waits = [i for i, e in enumerate(events) if e[0] == "wait" and e[2]]
    # every bucket in each later step's forward, and after the last step in `gathered_state` (its `settle`)
    assert len(waits) == n * STEPS, waits
    # each step's forward waits in forward order, computing between its waits
    first_step = [events[i][1] for i in waits[:n]]
    assert first_step == list(reversed(range(n))), first_step
    between = [e for e in events[waits[0]:waits[n - 1]] if e[0] == "compute"]
    assert between, "no layer computed before the last bucket's gather was waited on"
    print(f"\n{name}: {len(between)} aten ops read gathered weights before the last bucket's wait")


@pytest.mark.parametrize("name", ["zero1_compiled", "zero2_compiled", "zero2_compiled_recompute"])
def test_compiled_program_waits_per_bucket(runs, name):
    """Under `compile` the step leaves its gathers in flight and the compiled forward waits for each bucket in
    forward order, the first with all others still pending: one wait per layer, none all at once at the
    start. That it reads each layer's weights only after its wait is test_runs_match_serial's, with the
    weights landing at the wait (`_land_at_the_wait`)."""
    run, _ = runs[name]
    n = run["buckets"]
    assert run["lazy"] and run["pending_after_step"] == list(range(n))
    waits = [e for e in run["events"] if e[0] == "wait" and e[2]]
    assert len(waits) == n * STEPS, waits
    for s in range(STEPS - 1):  # each later step's forward (the last `settle` is gathered_state's)
        forward = waits[s * n:(s + 1) * n]
        assert [e[1] for e in forward] == list(reversed(range(n))), forward
        assert [e[3] for e in forward] == list(range(n, 0, -1)), forward  # pending at each wait: n, n−1, …, 1


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3"])
def test_reduce_scatters_start_during_backward(runs, name):
    """A bucket's reduce-scatter starts while backward still produces later buckets' gradients (stage 3:
    still gathers later layers' weights for their backward)."""
    run, _ = runs[name]
    events = run["events"]
    rs = [i for i, e in enumerate(events) if e[0] == "rs"]
    first = events[rs[0]][1]
    again = next(i for i in rs[1:] if events[i][1] == first)  # the same bucket's next reduction
    kind = "start_gather" if name == "zero3" else "grad"
    later = [e for e in events[rs[0]:again] if e[0] == kind and e[1] != first]
    assert later, events[:60]


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_bounded_in_flight(runs, name):
    run, _ = runs[name]
    events = run["events"]
    in_flight = [e[2] for e in events if e[0] == "rs"]
    print(f"\n{name}: reduce-scatters in flight at each launch {in_flight[:12]}…")
    assert max(in_flight) <= zero_runtime.REDUCE_SCATTERS_IN_FLIGHT, in_flight
    if name == "zero3":  # the layer computing and the one arriving
        alive = [e[2] for e in events if e[0] == "start_gather"]
        print(f"{name}: gathered buckets alive at each gather start {alive[:24]}…")
        assert alive and max(alive) <= 2, alive


def _join_body(ctx, rounds: int):
    import torch.distributed as dist

    zero_runtime._Collective.LET_GO_S = 60.0  # no time bound here: the test is about who holds the buffers
    left, right = [], []
    for i in range(rounds):
        full, mine = torch.empty(2 * 4096), torch.full((4096,), float(ctx.rank + i))
        gather = zero_runtime._Collective(lambda: dist.all_gather_into_tensor(full, mine, async_op=True), full, mine)
        flat, out = torch.arange(2 * 4096, dtype=torch.float32) * (ctx.rank + 1), torch.empty(4096)
        reduce = zero_runtime._Collective(lambda: dist.reduce_scatter_tensor(out, flat, async_op=True), flat, out)
        gather.join()
        reduce.join()
        left.append([t._use_count() for t in (full, mine, flat, out)])
        right.append(torch.equal(full, torch.cat([torch.full((4096,), float(r + i)) for r in range(ctx.world_size)]))
                     and torch.equal(out, 3 * torch.arange(4096, dtype=torch.float32) + 3 * 4096 * ctx.rank))
    return left, right


def test_join_leaves_the_buffers_to_the_runtime():
    """After `_Collective.join` the buffers handed to a collective are held by the runtime's tensors alone: gloo's
    worker thread has let go of the work, so the program's last reference frees them, on its own thread (the
    class's docstring says why; without the wait, 5–7% of bench/zero3_vs_fsdp2.py's gathers were still held, and
    this test, run with `LET_GO_S = 0`, failed twice in two runs). The gathered and reduced values are checked too."""
    for left, right in spawn(2, _join_body, 40):
        assert all(counts == [1, 1, 1, 1] for counts in left), left
        assert all(right)
