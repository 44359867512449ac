"""ZeRO stages 1–3: the sharded optimizer that executes the compiler's partition table.

Start here: `ZeroOptimizer` takes the place of `GradBuckets` + the optimizer in
`parc.runtime.train.Trainer` when plan.json says `zero` ≥ 1. The table
(`parc.passes.zero`) lists flat buckets — one per layer — and each dp rank's
equal range of each. Per bucket this rank holds:

  stage | parameters                            | gradients               | optimizer (Adam)
  1     | full flat buffer (bf16: + fp32 range) | full flat buffer (fp32) | its range: exp_avg, exp_avg_sq
  2     | full flat buffer (bf16: + fp32 range) | its range only (fp32)   | its range
  3     | its range only (fp32)                 | its range only (fp32)   | its range
Stages 2–3's gradient range exists within a step only: made by the bucket's first reduce-scatter, freed
after the update (FSDP2's `zero_grad(set_to_none=True)`), so between steps a rank holds no gradient.

Bytes per parameter, N = dp, Adam (padding aside):
  stage | fp32             | bf16
  1     | 4 + 4 + 8/N      | 2 + 4/N (masters) + 4 + 8/N = 6 + 12/N  (Megatron's distributed optimizer)
  2     | 4 + 4/N + 8/N    | 2 + 4/N + 4/N + 8/N = 2 + 16/N, plus a bucket's transient bf16 gradient
  3     | 16/N             | 16/N, plus the gathered bf16 working set
  bf16 with `reduce=bf16 accumulate=bf16` (the ZeRO paper's and DeepSpeed's bf16 gradients):
  1     | 2 + 4/N + 2 + 8/N = 2 + 2 + 12/N
  2     | 2 + 4/N + 2/N + 8/N = 2 + 14/N
  (the step's fp32 copy of the rank's reduced range, 4/N, lives from `finish` to `zero` only)

The optimizer is the plan's own (AdamW, …) run on one fp32 tensor per bucket,
the rank's range ("master"); every update is elementwise, so it is the serial
update of those elements. In fp32 the master of stages 1–2 is a view into the
full buffer, so no weight is stored twice.

Communication per step (`reduce_scatter_tensor` / `all_gather_into_tensor`, one flat
tensor per bucket, padded to equal ranges):
  stage 1: reduce-scatter gradients once, after the last micro-batch's backward
           (launched per bucket as its gradients land), then all-gather the
           updated parameters: 2Ψ(N−1)/N — all-reduce's volume.
  stage 2: reduce-scatter each bucket in every micro-batch's backward as it
           lands, accumulate into the range, free the full gradient.
  stage 3: as stage 2, and parameters are all-gathered per layer just before
           its forward (`torch.ops.parc.zero_unshard`, inserted by the zero
           pass) and again in backward when autograd first needs a saved
           weight (a saved-tensor hook), then freed: 3Ψ(N−1)/N per micro-batch.
With accumulation k, stages 2–3 send their reduce-scatter k times.

HSDP (`zero stage=N shard=K`, PyTorch FSDP2's HybridShard, ZeRO++'s hpZ): the table is cut for
K ranks, and `group` is this rank's shard group (K consecutive dp ranks, parc/mesh.py
`zero_groups`), `replicate` its replicate group (the R = dp / K ranks holding the same
ranges). Everything above happens inside the shard group, with N = K; the sum of the
gradients still runs over all dp ranks: each reduce-scatter pre-divides by dp, and
`finish` all-reduces each reduced range once a step across the replicas (after the
last micro-batch; ranges are linear in the gradients, so summing micro-batches first
is the same sum). Per rank, Ψ' the padded numel, w the gradient wire bytes, g the
gathered bytes, k the accumulation, a the numel ZeRO-3 re-gathers in backward:
  reduce-scatter (shard group): 1 (stage 1) or k (2–3) × Ψ'·w·(K−1)/K
  all-reduce (replicate group): 2·(Ψ'/K)·w·(R−1)/R, once a step
  all-gather (shard group):     stages 1–2: Ψ'·g·(K−1)/K; stage 3: k·(Ψ' + a)·g·(K−1)/K
Only the all-reduce crosses nodes when a shard group is a node: Ψ'/K elements, not Ψ'.
Memory is the table above with N = K.

Overlap: every collective is async; what waits, and when (`parc report` prices the
same, parc/analysis/cost.py `zero_exposed`):
  reduce-scatter  launched by a bucket's last gradient hook (stages 1–2, DDP's buckets; stage 1
                  in the last micro-batch only) or by `zero_unshard`'s backward (stage 3), so it
                  runs under the rest of that backward. Stages 2–3 keep at most
                  `REDUCE_SCATTERS_IN_FLIGHT` (1) in flight, as FSDP2 does: launching the next bucket's
                  first waits for the one before, which ran under this bucket's backward, so one whole
                  bucket gradient is alive as a collective's input, never the model's (it was two).
                  The last is waited on at the next micro-batch's start or in `finish`, before the update
                  needs it. Every wait is a `_Collective.join`: it also waits for gloo's worker thread to let
                  go of the collective's buffers, so each is freed where the runtime or the program drops it
                  (bench/zero3_vs_fsdp2.py, 48 profiled steps over its 2 ranks: a step's rise 4.92–5.02 MiB,
                  4.92–5.11 without the join; FSDP2's 5.05–5.24).
  all-gather, 1–2 launched by `step` bucket by bucket in forward order (the first layer's first)
                  and, run eagerly (`lazy_gather`), not waited on there: the zero pass put a
                  `zero_wait_gather` before each bucket's first use, so the next forward waits for
                  a layer's own bucket just before the layer, and later layers' gathers run under
                  earlier layers' compute. Anything else that reads or writes the weights first
                  calls `settle` (checkpoints, `held`, `load_full`, the next `step`, the end of
                  `active`). Under `compile` too: its wait op declares that it writes the bucket's
                  weights (`zero_wait_gather_into`), so the compiled graph reads them after it.
  all-gather, 3   forward: `unshard(b)` waits for b and starts b−1's (the next layer's) before b
                  computes; backward: the first unpack of b gathers it and starts the next bucket
                  backward needs. At most two gathered layers are alive at once in either pass (the
                  one computing and the one arriving): the report's ZeRO-3 working set.

ZeRO-Offload (`zero stage=N offload=cpu`, table["offload"]): `HostOptimizer` (runtime/parallel/offload.py)
keeps each master range, the optimizer state and the step on the host; `master` stays on the device as
the gradient holder (fp32: also the weights the all-gather sends, refreshed after each step; bf16: a
stand-in, and `_range_in` fetches what a gather sends from the host). `optimizer`/`pieces` are then the
host ones, so checkpoints and the lr schedule see them.

Under `precision bf16` (runtime/precision.py) the masters and the gradient
accumulators stay fp32, and only the rank's range of the masters exists, as in
DeepSpeed and Megatron's distributed optimizer. Stages 1–2: the whole flat
parameter buffer is bf16 (`compute_dtype`) and is what the program computes with
(no `StepCasts` copy); the master is a separate fp32 tensor, the rank's range,
taken from the fp32 weights before they were cast. After the update each rank
casts its master to bf16 and the bf16 buffer is all-gathered (half the bytes of
an fp32 gather). The program's gradients are bf16: stage 1 adds each one into
the fp32 flat gradient buffer as it lands (a post-accumulate-grad hook, Megatron's
`main_grad`) and frees it; stage 2 reduce-scatters each micro-batch's bucket and
adds the result into the fp32 range, as in fp32. These are the casts and fp32
sums the serial reference (runtime/serial_reference.py) does: bf16(master) in,
each micro-batch's bf16 gradient summed in fp32. Stage 3's gather casts the
rank's fp32 range to bf16 and gathers bf16, so the program's weights and their
gradients are bf16, as FSDP2's `param_dtype`. Each reduce-scatter moves
`reduce_dtype` (fp32 unless `reduce=bf16`) and its result is added into the fp32 range.

bf16 accumulation (`precision bf16 reduce=bf16 accumulate=bf16`, stages 1–2; DeepSpeed's
`grad_accum_dtype`): the accumulators are bf16 too. Stage 1's whole flat gradient buffer is bf16 and
each program gradient is a view of it, so autograd adds every micro-batch's bf16 gradient into it in
place (no hook copy); at the last micro-batch the buffer is divided by dp in bf16 and reduce-scattered
as it is. Stage 2 adds each micro-batch's reduce-scattered bf16 range into a bf16 range. `finish` hands
the optimizer an fp32 copy of the reduced range (freed by `zero`). With one micro-batch a step this is
bitwise `reduce=bf16` (adding into zeros is exact, and dividing in bf16 rounds once, as the fp32 divide
then the cast do); with k micro-batches each of the k − 1 additions rounds to bf16's 8 bits, where fp32
accumulation rounds to 24 (tests/test_zero_bf16_accumulate.py states the tolerance this costs).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from parc.runtime import saved
from parc.runtime.parallel.offload import HostOptimizer
from parc.runtime.parallel.ops import mark_ordered
from parc.runtime.param_groups import RangeGroups
from parc.runtime.optim_step import step_unless



def quiet_renamed_collectives() -> None:
    """torch 2.13 renamed these two to *_single and warns on the old names; parc supports torch ≥ 2.11,
    which has only the old ones (tests/test_torch_api.py), so the warning says nothing a user can act on
    (also called by `parc calibrate`'s gloo workers)."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                            r"is deprecated", category=FutureWarning)


quiet_renamed_collectives()

_ACTIVE: list["ZeroOptimizer"] = []  # the ZeRO-3 runtime of the step running now (see `active`)
# stages 1–2 runtimes whose post-step all-gathers the program's `zero_wait_gather` ops wait on (see `step`)
_GATHERING: list["ZeroOptimizer"] = []
REDUCE_SCATTERS_IN_FLIGHT = 1  # stages 2–3: whole bucket gradients alive at once (`_bound_reduce_scatters`)


class _Collective:
    """One async collective and the buffers handed to it, joined on this thread (`join`).

    A bucket's buffers (the gathered weights, a reduce-scatter's input and output) must be freed where the
    runtime or the program drops them. On CPU ranks `work.wait()` returns as soon as gloo's worker thread
    marks the result done, but that thread still holds the work, and through it the buffers, until it next
    gets a core: measured, after 5–7% of the stage-3 gathers of bench/zero3_vs_fsdp2.py (2 ranks, 2 cores), for
    up to 10 yields. A buffer whose last reference gloo's thread drops is freed there, later than the program
    let go of it, and is never seen freed by the profiler, which then counts it for the rest of the step: the
    lm_head's forward bucket (64 KiB) counted through the backward, or a block's (195 KiB) through the loss,
    took ZeRO-3's measured step rise from at most 5.02 MiB to up to 5.11. `join` therefore also waits, yielding,
    until each buffer is held by no more references than before the launch: the work's own are gone."""

    __slots__ = ("work", "buffers", "held")
    LET_GO_S = 0.01  # past this the buffers are left to gloo's thread, as before (a memory delay, not an error)

    def __init__(self, start, *buffers: torch.Tensor):
        """`start()` launches the collective (async_op=True) on `buffers`, or is None for no collective (one rank)."""
        self.buffers = buffers
        self.held = [t._use_count() for t in buffers]  # tensor references (views included) before the launch
        self.work = start() if start is not None else None

    def join(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None  # the runtime's reference; gloo's worker thread drops its own when it next runs
        if self.buffers[0].device.type != "cpu":
            return  # NCCL: `wait` orders streams, the caching allocator keeps the memory safe; nothing to wait for
        deadline = time.perf_counter() + self.LET_GO_S
        while any(t._use_count() > n for t, n in zip(self.buffers, self.held)) and time.perf_counter() < deadline:
            os.sched_yield()  # the core to gloo's thread (measured: about 0.2 ms a step, of 30)


class ZeroOptimizer:
    """Sharded parameters/gradients/optimizer state of one program's dp group.

    Interface used by the Trainer: `start_micro_batch(sync)`, `finish()`,
    `grad_ranges()`, `step()`, `zero()`, `active()` (context for
    the micro-batch loop), `full_params()` (gathered, for --verify/checkpoints), `full_grads()` (gathered,
    for --verify's first-step gradient check).
    """

    def __init__(self, params: dict[str, torch.Tensor], table: dict, group, dp: int, dp_rank: int, make_opt,
                 decay_of: dict[str, bool] | None = None, read_range=None,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 divisor: int | None = None, replicate=None, replica: int = 0, lazy_gather: bool = False,
                 accumulate_dtype: torch.dtype | None = None):
        """`read_range(name, a, e)` (stage 3, pretrained weights: runtime/checkpoint/weights.py): elements [a, e) of
        parameter `name`, flattened; the `params` are then stand-ins, and no rank builds a whole bucket.
        `compute_dtype`, `reduce_dtype` (`precision bf16 [reduce=bf16]`): what stage 3 gathers, and the
        wire dtype of the gradient reduction; None is the masters' fp32. `divisor` (default dp): the sum
        over `group` is divided by it; expert parallelism's experts sum over edp, divided by all of dp.
        `replicate`, `replica` (HSDP, `zero shard=K`): the process group of the ranks holding this rank's
        ranges (None: no other copy), and this rank's index in it; `group`, `dp`, `dp_rank` are then the
        shard group's, and `divisor` all of dp.
        `lazy_gather` (stages 1–2, a program with `zero_wait_gather` ops, eager or compiled): the post-step
        all-gathers are waited on per bucket by the next forward, not by `step` (see "Overlap" above).
        `accumulate_dtype` (stages 1–2, `precision bf16 reduce=bf16 accumulate=bf16`): the dtype of the
        gradient accumulators, stage 1's whole flat buffer and stage 2's range (see "bf16 accumulation")."""
        self.stage, self.group, self.dp, self.rank = table["stage"], group, dp, dp_rank
        self.divisor = divisor or dp
        self.replicate, self.replica = replicate, replica
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype  # None: the masters' fp32
        self.accumulate_dtype = accumulate_dtype or torch.float32
        self.table = table
        self.params = params
        self.buckets = table["buckets"]
        self.full: list[torch.Tensor | None] = []     # stages 1–2: the whole flat parameter buffer (compute dtype)
        self.master: list[torch.Tensor] = []           # this rank's range, fp32, what the optimizer updates
        self.grad_flat: list[torch.Tensor] = []        # stage 1: whole flat gradient buffer
        # stages 2–3: this rank's range of the reduced gradient, made by the step's first reduce-scatter of the
        # bucket and freed after the update (None between steps: the table at the top of this module)
        self.grad_acc: list[torch.Tensor | None] = []
        self.released_grad_bytes = 0                   # bytes of the ranges the last `zero` freed (`held`)
        self._bucket_of: dict[int, int] = {}
        self._offset_of: dict[int, int] = {}           # stage 1 under bf16: where a parameter's gradient goes
        # stages 1–2 under a compute dtype: the program's weights are a low-precision flat buffer
        self._low = self.stage < 3 and compute_dtype is not None
        # ... whose gradients also accumulate in it: the program's gradient lands in the accumulator itself
        self._low_acc = self._low and self.accumulate_dtype == compute_dtype
        shared = None
        for b, bucket in enumerate(self.buckets):
            ps = [params[p["name"]] for p in bucket["params"]]
            if self.stage == 3 and read_range is not None:
                shared = self._master_from_weights(bucket, ps, read_range, shared)
                continue
            full = torch.zeros(bucket["padded"], dtype=ps[0].dtype, device=ps[0].device)
            for p, spec in zip(ps, bucket["params"]):
                full[spec["offset"]:spec["offset"] + spec["numel"]].copy_(p.detach().reshape(-1))
            lo, n = self.rank * bucket["shard"], bucket["shard"]
            if self.stage < 3:
                master = full[lo:lo + n]
                if self._low:
                    # bf16: the rank keeps only its range of the fp32 masters, taken before the cast; the
                    # whole buffer is the program's bf16 weights, refreshed by the post-step all-gather
                    master = master.clone()
                    full = full.to(compute_dtype)
                for p, spec in zip(ps, bucket["params"]):
                    # the program's parameter becomes a view into the flat buffer: all-gather writes it in place
                    p.data = full[spec["offset"]:spec["offset"] + spec["numel"]].view_as(p)
                self.full.append(full)
                self.master.append(master)
            else:
                self.full.append(None)
                self.master.append(full[lo:lo + n].clone())
                shared = shared if shared is not None else torch.zeros(1, dtype=ps[0].dtype, device=ps[0].device)
                for p in ps:
                    # stage 3 keeps no full weight: the program's input is a stand-in of the right shape on one
                    # shared element; `zero_unshard` ignores its data and returns the gathered bucket instead
                    p.data = shared.expand(p.shape)
            if self.stage == 1:
                g = torch.zeros(bucket["padded"], dtype=self.accumulate_dtype, device=full.device)
                if not self._low or self._low_acc:  # autograd adds each micro-batch's gradient into g in place
                    for p, spec in zip(ps, bucket["params"]):
                        p.grad = g[spec["offset"]:spec["offset"] + spec["numel"]].view_as(p)
                # bf16: a bf16 parameter cannot hold an fp32 .grad; `_on_grad` adds each bf16 gradient in
                self.grad_flat.append(g)
            else:
                self.grad_acc.append(None)
            if self.stage < 3:
                for p, spec in zip(ps, bucket["params"]):
                    self._bucket_of[id(p)] = b
                    self._offset_of[id(p)] = spec["offset"]
                    p.register_post_accumulate_grad_hook(self._on_grad)
            del full
        # the optimizer sees runs of each range split by weight decay (runtime/param_groups.py): torch groups
        self.offload = None
        if table.get("offload"):  # ZeRO-Offload: the ranges' masters, state and step on the host (offload.py)
            self.offload = HostOptimizer(self.master, self.buckets, self.rank, decay_of or {}, make_opt,
                                         compute_dtype, keep=self.stage == 3)
            self.pieces, self.optimizer = self.offload.pieces, self.offload.optimizer
        else:
            self.pieces = RangeGroups(self.master, self.buckets, self.rank, decay_of or {})
            self.optimizer = make_opt(self.pieces.groups())
        self._pending: list[int] = []
        self._works: list = []
        self._launched = 0                              # reduce-scatters launched: their order, for the bound
        self._sync = False
        # stage 3 bookkeeping: the storage of each bucket's latest gather (weak: forward frees it by dropping
        # references), buckets re-gathered for backward (strong, until their gradient is reduced), prefetches
        self._live: dict[int, StorageWeakRef] = {}
        self._resident: dict[int, torch.Tensor] = {}
        self._prefetch: dict[int, tuple] = {}
        self._reduced: set[int] = set()               # buckets whose gradient this backward has reduced
        self.lazy_gather = lazy_gather and self.stage < 3
        self._gathers: dict[int, tuple] = {}          # stages 1–2: post-step all-gathers not yet waited on
        self._needed_in_backward: set[int] = set()    # buckets whose weights autograd saved (seen so far)

    def _master_from_weights(self, bucket: dict, ps: list[torch.Tensor], read_range, shared):
        """Stage 3 from a weights file: this rank's range of the bucket, read parameter by parameter."""
        lo, n = self.rank * bucket["shard"], bucket["shard"]
        master = torch.zeros(n, dtype=ps[0].dtype, device=ps[0].device)
        for spec in bucket["params"]:
            a, e = max(spec["offset"], lo), min(spec["offset"] + spec["numel"], lo + n)
            if a < e:
                master[a - lo:e - lo] = read_range(spec["name"], a - spec["offset"], e - spec["offset"])
        self.full.append(None)
        self.master.append(master)
        self.grad_acc.append(None)
        shared = shared if shared is not None else torch.zeros(1, dtype=ps[0].dtype, device=ps[0].device)
        for p in ps:
            p.data = shared.expand(p.shape)
        return shared

    # --- backward: gradients -------------------------------------------------------------

    def start_micro_batch(self, sync: bool) -> None:
        """Call before each backward; `sync` on the last micro-batch of the step."""
        self._drain()
        self._reduced = set()
        self._sync = sync
        self._pending = [len(b["params"]) for b in self.buckets]
        self._works = [None] * len(self.buckets)

    def _on_grad(self, p: torch.Tensor) -> None:
        b = self._bucket_of[id(p)]
        if self.stage == 1 and self._low and not self._low_acc:
            # bf16: the micro-batch's bf16 gradient summed into the fp32 flat buffer, then freed (the
            # fp32 accumulation that `StepCasts`' cast backward used to do into an fp32 master's .grad)
            o = self._offset_of[id(p)]
            self.grad_flat[b][o:o + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        if self.stage == 1 and not self._sync:
            return  # stage 1 accumulates whole gradients locally and reduces once per step
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if self.stage == 1:
            flat = self.grad_flat[b]
        else:
            flat = self._flat_grad(b)
            for spec in bucket["params"]:
                self.params[spec["name"]].grad = None  # ZeRO-2: the full gradient lives only until reduced
        self._reduce_scatter(b, flat)

    def _flat_grad(self, b: int, grads: list | None = None) -> torch.Tensor:
        """The bucket's gradient as one padded flat tensor; a parameter without gradient gives zeros."""
        bucket = self.buckets[b]
        if grads is None:
            grads = [self.params[s["name"]].grad for s in bucket["params"]]
        ref = self.master[b]
        dtype = next((g.dtype for g in grads if g is not None), ref.dtype)  # bf16 under stages 2–3's bf16
        parts = [g.reshape(-1) if g is not None else torch.zeros(s["numel"], dtype=dtype, device=ref.device)
                 for g, s in zip(grads, bucket["params"])]
        parts.append(torch.zeros(bucket["padded"] - bucket["numel"], dtype=parts[0].dtype, device=ref.device))
        return torch.cat(parts)

    def _reduce_scatter(self, b: int, flat: torch.Tensor) -> None:
        if not self._low_acc:  # bf16 accumulation: already the wire's dtype, divided in it (the same bits)
            flat = flat.float()  # stages 2–3 under bf16: the bf16 bucket gradient (else a no-op)
        if self.divisor > 1:
            flat.div_(self.divisor)  # average: pre-divide in fp32, as DDP does, to keep sums in range
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)  # `reduce=bf16`: half the bytes on the wire
        out = torch.empty(self.buckets[b]["shard"], dtype=flat.dtype, device=flat.device)
        if self.stage >= 2:
            self._bound_reduce_scatters()
        if self.dp > 1:
            work = _Collective(lambda: dist.reduce_scatter_tensor(out, flat, group=self.group, async_op=True), flat, out)
        else:
            out.copy_(flat)
            work = _Collective(None)
        self._launched += 1
        self._works[b] = (work, flat, out, self._launched, self._sync)

    def _bound_reduce_scatters(self) -> None:
        """Stages 2–3: before another bucket's reduce-scatter starts, wait for the oldest ones beyond
        `REDUCE_SCATTERS_IN_FLIGHT − 1`, so at most that many whole bucket gradients (the collective's
        input) are alive, not the whole model's by the end of backward. Collectives of one group finish
        in launch order, so the oldest is the one nearest done; which bucket waits when changes no value
        (each adds into its own range)."""
        pending = [k for k, w in enumerate(self._works) if isinstance(w, tuple)]
        pending.sort(key=lambda k: self._works[k][3])
        for k in pending[:max(len(pending) - REDUCE_SCATTERS_IN_FLIGHT + 1, 0)]:
            self._wait(k)

    def _wait(self, b: int) -> None:
        work, _flat, out, _order, last = self._works[b]
        self._works[b] = True
        work.join()
        del work
        if self.stage == 1:
            self.master[b].grad = out.float()
        else:
            if self.grad_acc[b] is None:  # the step's first range of bucket b: zeros + out, the same bits as before
                self.grad_acc[b] = torch.zeros(out.shape, dtype=self.accumulate_dtype, device=out.device)
            self.grad_acc[b].add_(out)
        if last and self.offload is not None and self.replicate is None:
            # the step's last reduce of this bucket: its range is final, so ZeRO-Offload starts copying it to
            # the host now, under the rest of backward (offload.py `download`)
            self.offload.download(b, self.master[b].grad if self.stage == 1 else self.grad_acc[b])

    def _drain(self) -> None:
        for b, w in enumerate(self._works):
            if isinstance(w, tuple):
                self._wait(b)

    def finish(self) -> None:
        """Reduce any bucket whose gradients never all arrived (unused parameters), then wait for all."""
        for b, w in enumerate(self._works):
            if w is None:
                if self.stage < 3:
                    self._launch(b)
                else:
                    # no backward reached this bucket's unshard: its gradient is zero
                    self._reduce_scatter(b, self._flat_grad(b, [None] * len(self.buckets[b]["params"])))
        self._drain()
        self._reduce_replicas()
        if self.stage >= 2:
            for m, g in zip(self.master, self.grad_acc):
                m.grad = g.float()  # bf16 accumulation: an fp32 copy for the step, freed by `zero` (else g)

    def _reduce_replicas(self) -> None:
        """HSDP: sum each reduced range over the replicas of this rank's shard (one all-reduce a bucket, a step).

        Stage 1's range is the step's `master.grad`; stages 2–3 accumulated every micro-batch's into `grad_acc`.
        The wire moves `reduce_dtype` when the plan says so, as the reduce-scatter did."""
        if self.replicate is None:
            return
        ranges = [m.grad for m in self.master] if self.stage == 1 else self.grad_acc
        wires = [r.to(self.reduce_dtype) if self.reduce_dtype is not None else r for r in ranges]
        works = [dist.all_reduce(w, group=self.replicate, async_op=True) for w in wires]
        for r, w, work in zip(ranges, wires, works):
            work.wait()
            if w is not r:
                r.copy_(w)

    def counts_in_norm(self) -> bool:
        """Whether this rank's ranges count in the global gradient norm: under HSDP the R replicas hold the same
        ranges, so only the first counts (the norm sums squares over dp: runtime/parallel/grad_norm.py)."""
        return self.replica == 0

    # --- the update --------------------------------------------------------------------

    def grad_ranges(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """After `finish`: name → (view of this rank's reduced gradient, start, end) for each parameter
        whose elements [start, end) (flattened) fall in this rank's range of its bucket.

        Each element lives in exactly one dp rank's range (padding is zero), so these views are what
        this rank owns for the global norm (`parc.runtime.parallel.grad_norm`); writing them in place changes
        what the optimizer sees (tp-partial and tied sums after the dp reduce-scatter).
        """
        out = {}
        for b, bucket in enumerate(self.buckets):
            lo, hi = self.rank * bucket["shard"], (self.rank + 1) * bucket["shard"]
            for s in bucket["params"]:
                a, e = max(s["offset"], lo), min(s["offset"] + s["numel"], hi)
                if a < e:
                    out[s["name"]] = (self.master[b].grad[a - lo:e - lo], a - s["offset"], e - s["offset"])
        return out

    def master_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer updates from (what clipping scales)."""
        return [m.grad for m in self.master]

    def step(self, found: torch.Tensor | None = None) -> None:
        """The update of this rank's ranges (skipped where `found` > 0: runtime/optim_step.py), then stages
        1–2 all-gather the updated parameters."""
        self.settle()
        if self.offload:
            self.offload.step(found)  # gradients down, the host step, the updated ranges back into `master`
        else:
            self.pieces.bind_grads()
            step_unless(self.optimizer, found)
        if self.stage == 3:
            return  # parameters stay sharded; the next forward gathers them
        # in forward order (buckets are in backward order): the first layer's weights arrive first
        for b in reversed(range(len(self.full))):
            full = self.full[b]
            mine = self._range_in(b, full.dtype).clone()  # input must not alias the output buffer
            if self.dp > 1:
                self._gathers[b] = _Collective(
                    lambda: dist.all_gather_into_tensor(full, mine, group=self.group, async_op=True), mine)
            elif self._low:
                full.copy_(mine)  # one rank: the bf16 buffer is not a view of the master
        if self.lazy_gather and self._gathers:
            _GATHERING.append(self)  # the next forward's `zero_wait_gather` ops wait bucket by bucket
        else:
            self.settle()

    def wait_gather(self, b: int, into: list[torch.Tensor] = ()) -> None:
        """Stages 1–2: bucket b's weights are whole again (its post-step all-gather is done).

        `into` (from `zero_wait_gather`): the tensors the program hands the wait as the bucket's parameters,
        in the bucket's order. They are the parameters themselves (views of the flat buffer the gather
        wrote), except in a compiled graph that functionalizes the op without writing it back in place
        (`aot_eager`): there they are copies taken before the wait, and the op's contract (it writes them)
        is kept by copying the gathered weights in."""
        pending = self._gathers.pop(b, None)
        if pending is not None:
            pending.join()
            del pending
            full = self.full[b]
            with torch.no_grad():
                for spec, p in zip(self.buckets[b]["params"], into):
                    if p.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                        p.copy_(full[spec["offset"]:spec["offset"] + spec["numel"]].view_as(p))
        if not self._gathers and self in _GATHERING:
            _GATHERING.remove(self)

    def settle(self) -> None:
        """Wait for every post-step all-gather still in flight: before anything but the program reads
        or writes the parameters (the next update, a checkpoint, `held`, `load_full`), and after each
        forward for a bucket no op of it waited on."""
        for b in list(self._gathers):
            self.wait_gather(b)

    def zero(self) -> None:
        for g in self.grad_flat:
            g.zero_()
        # stages 2–3: the ranges go (FSDP2's `zero_grad(set_to_none=True)`): between steps no gradient is held
        self.released_grad_bytes = sum(g.untyped_storage().nbytes() for g in self.grad_acc if g is not None)
        self.grad_acc = [None] * len(self.grad_acc)
        for m in self.master:
            m.grad = None  # stage 1's reduced range is a temporary, 2–3's `grad_acc` (freed above)
        (self.offload or self.pieces).clear_grads()

    # --- stage 3: gather on demand -------------------------------------------------------

    def _start_gather(self, b: int, dtype: torch.dtype | None = None):
        """Gather bucket b's ranges in `dtype` (default: the compute dtype; the fp32 masters for state)."""
        bucket = self.buckets[b]
        dtype = dtype or self.compute_dtype or self.master[b].dtype
        mine = self._range_in(b, dtype)
        full = torch.empty(bucket["padded"], dtype=dtype, device=mine.device)
        if self.dp > 1:
            work = _Collective(lambda: dist.all_gather_into_tensor(full, mine, group=self.group, async_op=True),
                               full, mine)
        else:
            full.copy_(mine)
            work = _Collective(None)
        return work, full

    def _range_in(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's range of bucket b on the device in `dtype`, as a gather sends it; under offload with a
        compute dtype the device holds no fp32 range: the host's (runtime/parallel/offload.py)."""
        if self.offload is not None and self.offload.stands_in:
            return self.offload.range_in(b, dtype)
        return self.master[b].detach().to(dtype)

    def _gathered(self, b: int) -> torch.Tensor:
        if b in self._prefetch:
            work, full = self._prefetch.pop(b)
        else:
            work, full = self._start_gather(b)
        work.join()  # and gloo's thread has let go of `full`: the program's last reference frees it
        del work
        self._live[b] = StorageWeakRef(full.untyped_storage())
        return full

    def _prefetch_bucket(self, b: int | None) -> None:
        # Which collectives run must not depend on what Python happens to keep alive (a reference
        # cycle freed later on one rank than another would desynchronize the group): decide from
        # explicit bookkeeping only.
        if b is not None and 0 <= b < len(self.buckets) and b not in self._prefetch and \
                b not in self._resident and b not in self._reduced:
            self._prefetch[b] = self._start_gather(b)

    def unshard(self, b: int) -> torch.Tensor:
        """Forward: bucket b's whole flat parameter; starts gathering the next layer's meanwhile."""
        full = self._gathered(b)
        self._prefetch_bucket(b - 1)  # buckets are in backward order: b − 1 runs next in forward
        return full

    def reduce_bucket_grad(self, b: int, grad: torch.Tensor) -> None:
        """Backward of `zero_unshard`: reduce-scatter the bucket's gradient and drop the gathered weights."""
        self._resident.pop(b, None)
        self._reduced.add(b)
        self._reduce_scatter(b, grad.contiguous().clone())

    def pack(self, t: torch.Tensor):  # runtime/saved.py: a saved view of a gathered bucket
        # Is `t` a view of a gathered bucket? Decided by storage identity alone, which is the same on every
        # rank: the weak reference keeps the bucket's StorageImpl address from being reused, and `t` keeps its
        # own storage alive, so equal addresses mean the same storage. Never by whether the gathered *tensor*
        # object is still alive: under `compile` the graph saves views and drops that tensor, whose lifetime
        # then hangs on references outside the program (an async collective's work object, a cycle awaiting
        # the collector), different per rank; a rank that re-gathered alone in backward hung its group.
        mine = StorageWeakRef(t.untyped_storage())
        for b, ref in self._live.items():
            if ref == mine:
                return (b, t.storage_offset(), tuple(t.shape), t.stride())
        return t

    def unpack(self, packed):
        b, offset, shape, stride = packed
        full = self._resident.get(b)
        if full is None:
            full = self._resident[b] = self._gathered(b)
            self._needed_in_backward.add(b)
            # prefetch the next bucket backward will need: buckets run in increasing order, and which
            # ones backward reads at all (an embedding's does not) is learned from earlier backwards
            self._prefetch_bucket(min((k for k in self._needed_in_backward if k > b), default=None))
        return full.as_strided(shape, stride, offset)

    @contextlib.contextmanager
    def active(self):
        """Around the micro-batch loop: lets `torch.ops.parc.zero_unshard` find this runtime and, at
        stage 3, replaces every weight autograd saves by a reference that re-gathers it in backward."""
        if self.stage < 3:
            try:
                yield
            finally:
                self.settle()  # buckets the forward never waited for (parameters it did not use)
            return
        try:
            with saved.hooks(self, _ACTIVE):
                yield
        finally:
            self._resident.clear()
            for b in list(self._prefetch):
                self._prefetch.pop(b)[0].join()

    # --- state -------------------------------------------------------------------------

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, by placeholder name (collective over the dp group at stage 3)."""
        self.settle()
        out = {}
        for b, bucket in enumerate(self.buckets):
            if self.stage < 3 and not self._low:
                full = self.full[b]
            else:  # stage 3, and bf16's stages 1–2: only the ranges are fp32
                work, full = self._start_gather(b, self.master[b].dtype)  # the fp32 masters, not bf16 copies
                work.join()
            out.update(self._split(bucket, full))
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        """After `finish`: every parameter's reduced gradient whole, by placeholder name, as the optimizer is
        about to read it (collective over the dp group: each rank holds only its ranges; --verify's
        first-step check, runtime/verify_grads.py)."""
        out = {}
        for b, bucket in enumerate(self.buckets):
            mine = self.master[b].grad.detach().contiguous()
            full = torch.empty(bucket["padded"], dtype=mine.dtype, device=mine.device)
            if self.dp > 1:
                dist.all_gather_into_tensor(full, mine, group=self.group)
            else:
                full.copy_(mine)
            out.update(self._split(bucket, full))
        return out

    @staticmethod
    def _split(bucket: dict, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """A whole flat bucket as its parameters' shapes, by placeholder name (views, padding dropped)."""
        return {s["name"]: full[s["offset"]:s["offset"] + s["numel"]].view(s["shape"]).detach()
                for s in bucket["params"]}

    def full_optimizer_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """(per-parameter state by placeholder name, whole; scalar state such as Adam's `step`)."""
        per, scalars = {}, {}
        for b, bucket in enumerate(self.buckets):
            # sorted: one all-gather per key, so every rank must walk the keys in one order; a dict's
            # order is how it was filled, which after `load_full` once followed each rank's string hashes
            for key, v in sorted(self.pieces.state(self.optimizer, b).items()):
                if v.dim() == 0:
                    scalars[key] = v.detach().clone()
                    continue
                v = v.to(self.master[b].device)  # offload: the host state, gathered where the group's collectives run
                full = torch.empty(bucket["padded"], dtype=v.dtype, device=v.device)
                if self.dp > 1:
                    dist.all_gather_into_tensor(full, v.detach().contiguous(), group=self.group)
                else:
                    full.copy_(v)
                for sp in bucket["params"]:
                    per.setdefault(sp["name"], {})[key] = full[sp["offset"]:sp["offset"] + sp["numel"]].view(sp["shape"])
        return per, scalars

    def load_full(self, params: dict[str, torch.Tensor], optim: dict[str, dict[str, torch.Tensor]],
                  scalars: dict[str, torch.Tensor]) -> None:
        """Take whole parameters and optimizer state (by placeholder name); keep this rank's ranges."""
        self.settle()  # no gather may land on what is loaded
        for b, bucket in enumerate(self.buckets):
            lo, n = self.rank * bucket["shard"], bucket["shard"]

            def flat(tensors: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
                out = torch.zeros(bucket["padded"], dtype=like.dtype, device=like.device)
                for sp in bucket["params"]:
                    out[sp["offset"]:sp["offset"] + sp["numel"]].copy_(tensors[sp["name"]].reshape(-1))
                return out

            whole = flat(params, self.master[b])
            with torch.no_grad():
                if self.stage < 3:
                    self.full[b].copy_(whole)  # fp32: the master is a range of it; bf16: the compute weights
                if (self.stage == 3 or self._low) and not (self.offload and self.offload.stands_in):
                    self.master[b].copy_(whole[lo:lo + n])
                if self.offload:
                    self.offload.load(b, whole[lo:lo + n])  # the host master (and what the device keeps of it)
            # sorted, never a set: the state's order is the order `full_optimizer_state` gathers in
            keys = sorted({k for sp in bucket["params"] for k in optim.get(sp["name"], {})})
            none = torch.zeros(())  # a parameter that never had a gradient has no state yet: Adam starts at 0
            state = {k: flat({sp["name"]: optim.get(sp["name"], {}).get(k, none) for sp in bucket["params"]},
                             self.master[b])[lo:lo + n].clone() for k in keys}
            state.update({k: v.clone() for k, v in sorted(scalars.items())})
            if state:
                host = self.pieces.master[b].device  # the optimizer's own tensors: on the host under offload
                self.pieces.set_state(self.optimizer, b, {k: v.to(host) if v.dim() else v for k, v in state.items()})

    def backward_gathered_numel(self) -> int:
        """Padded numel of the buckets ZeRO-3 re-gathers in each backward."""
        return sum(self.buckets[b]["padded"] for b in self._needed_in_backward)

    def held(self) -> dict[str, list[torch.Tensor]]:
        """What this rank keeps between steps, by kind, for the memory test (`tests/test_zero.py`). Stages 2–3's
        gradient ranges are not among them: they live from the step's first reduce-scatter to its update, and
        `released_grad_bytes` says how many bytes the last step's were (runtime/memory.py `held_state` adds them:
        they are part of every step's peak)."""
        self.settle()
        program = [p.detach() for p in self.params.values()]
        # at stage 3 the program's inputs are stand-ins sharing one element: listed apart, not weights
        params = [m.detach() for m in self.master] + (program if self.stage < 3 else [])
        if self.offload is not None and self.offload.stands_in:  # the masters are stand-ins, not weights
            params = self.offload.device_tensors() + (program if self.stage < 3 else [])
        grads = [p.grad for p in self.params.values() if p.grad is not None] + self.grad_flat + \
            [g for g in self.grad_acc if g is not None]
        opt = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        opt = [] if self.offload else opt  # offload: in host memory (`HostOptimizer.host_bytes`), none on the device
        return {"params": params, "grads": grads, "optimizer": opt, "stand_ins": program if self.stage == 3 else []}


def _bucket_numel(table: dict) -> int:
    return sum(b["padded"] for b in table["buckets"])


def shard_ranks(table: dict) -> int:
    """K, the ranks one copy of the state is cut over: `zero shard=K` (HSDP), else all of dp."""
    return table.get("shard_size", table["dp"])


def analytic_bytes(table: dict, elem: int = 4, adam_states: int = 2, compute_elem: int | None = None,
                   grad_elem: int | None = None) -> dict[str, int]:
    """DESIGN.md's memory table for this rank, on the padded numel Ψ': params, grads, optimizer state.

    `compute_elem` (2 under bf16): stages 1–2 hold the whole flat buffer in the compute dtype and their
    fp32 master range beside it; the gradients they accumulate stay fp32 (the module docstring's table),
    unless `grad_elem` (2 under `accumulate=bf16`) says they accumulate in the compute dtype.
    Under offload (`table["offload"]`) the optimizer state is in host memory (`analytic_host_bytes`): 0 here;
    with a compute dtype so are the fp32 masters (stage 3 keeps its range in the compute dtype)."""
    psi, n, s = _bucket_numel(table), shard_ranks(table), table["stage"]
    params = psi * elem // (n if s >= 3 else 1)
    if compute_elem is not None and s < 3:
        params = psi * compute_elem + psi * elem // n
    if compute_elem is not None and table.get("offload"):  # the fp32 ranges live on the host; stage 3 keeps bf16
        params = psi * compute_elem // (n if s >= 3 else 1)
    return {"params": params, "grads": psi * (grad_elem or elem) // (n if s >= 2 else 1),
            "optimizer": 0 if table.get("offload") else adam_states * psi * elem // n}


def analytic_host_bytes(table: dict, elem: int = 4, adam_states: int = 2) -> dict[str, int]:
    """What ZeRO-Offload keeps in host memory per rank (runtime/parallel/offload.py): the fp32 master range,
    the buffer its reduced gradient is copied into, and the optimizer state, Ψ'/N elements each; none without
    offload."""
    if not table.get("offload"):
        return {"params": 0, "grads": 0, "optimizer": 0}
    mine = _bucket_numel(table) * elem // shard_ranks(table)
    return {"params": mine, "grads": mine, "optimizer": adam_states * mine}


def analytic_comm_bytes(table: dict, accumulation: int = 1, elem: int = 4, backward_numel: int | None = None,
                        gather_elem: int | None = None) -> int:
    """Bytes this rank sends per step (ring algorithms, DESIGN.md), on the padded numel Ψ'.

    ZeRO-3 gathers again in backward only the buckets whose weights autograd saved
    (`backward_numel` of them; an embedding's backward needs only the indices): 3Ψ' when all are.
    `gather_elem` (2 under bf16): stages 1–2 all-gather the updated parameters in the compute dtype.
    """
    return sum(analytic_comm_parts(table, accumulation, elem, backward_numel, gather_elem).values())


def analytic_comm_parts(table: dict, accumulation: int = 1, elem: int = 4, backward_numel: int | None = None,
                        gather_elem: int | None = None) -> dict[str, int]:
    """`analytic_comm_bytes` by collective: "reduce_scatter" and "all_gather" inside the shard group (all of dp
    without HSDP), and, under HSDP, "all_reduce" of this rank's ranges across the replicate group (the module
    docstring's formulas)."""
    psi, n, s = _bucket_numel(table), shard_ranks(table), table["stage"]
    replicas = table["dp"] * table.get("cp", 1) // n  # HSDP (× cp: passes/zero.py)
    gathered = psi * (gather_elem or elem) * (n - 1) // n
    out = {"reduce_scatter": (1 if s == 1 else accumulation) * psi * elem * (n - 1) // n}
    if s < 3:
        out["all_gather"] = gathered
    else:
        again = psi if backward_numel is None else backward_numel
        out["all_gather"] = accumulation * (psi + again) * (gather_elem or elem) * (n - 1) // n
    if replicas > 1:
        out["all_reduce"] = 2 * (psi // n) * elem * (replicas - 1) // replicas
    return out



@torch.library.custom_op("parc::zero_unshard", mutates_args=())
def zero_unshard(params: list[torch.Tensor], bucket: int) -> torch.Tensor:
    """ZeRO-3's gather of one bucket (a layer), inserted by the zero pass before the layer's first use.

    Forward: all-gather the dp ranks' ranges into the bucket's whole flat parameter (padded); the
    `params` are the program's stand-in inputs, read for nothing but tying the gradient to them.
    Backward: reduce-scatter the flat gradient over dp into this rank's range (accumulated across
    micro-batches), free the re-gathered weights, and give the stand-ins no gradient.
    """
    return _ACTIVE[-1].unshard(bucket)


@zero_unshard.register_fake
def _(params, bucket):
    # traced by `compile` (runtime/compiled.py) inside the step's `active()`: the bucket's padded flat size
    # is in the runtime's table, which is where the real op reads it too
    if not _ACTIVE:
        raise RuntimeError("zero_unshard is traced only inside ZeroOptimizer.active(), as the trainer runs it")
    zero = _ACTIVE[-1]
    return params[0].new_empty((zero.buckets[bucket]["padded"],), dtype=zero.master[bucket].dtype)


@torch.library.custom_op("parc::zero_reduce_grad", mutates_args=())
def zero_reduce_grad(grad: torch.Tensor, bucket: int) -> None:
    """Backward of `zero_unshard`, opaque to `compile`: reduce-scatter the bucket's flat gradient into this
    rank's range and free the re-gathered weights (`ZeroOptimizer.reduce_bucket_grad`)."""
    _ACTIVE[-1].reduce_bucket_grad(bucket, grad)


zero_reduce_grad.register_fake(lambda grad, bucket: None)


def _unshard_setup(ctx, inputs, output):
    ctx.n, ctx.bucket = len(inputs[0]), inputs[1]


def _unshard_backward(ctx, grad):
    torch.ops.parc.zero_reduce_grad(grad, ctx.bucket)
    return [None] * ctx.n, None


zero_unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)
for _op in (zero_unshard, zero_reduce_grad):
    mark_ordered(_op)  # collectives with side effects on the runtime: torch.compile keeps them, in program order


@torch.library.custom_op("parc::zero_wait_gather", mutates_args=())
def zero_wait_gather(params: list[torch.Tensor], bucket: int) -> None:
    """ZeRO-1/2: wait for bucket `bucket`'s post-step all-gather, inserted by the zero pass before the
    layer's first use of its weights (`params`, listed so the program shows what waits; not read).

    The step launches every bucket's gather and returns; the next forward then waits for each layer's
    own bucket just before that layer computes, so the gathers of later layers overlap the earlier
    layers' compute. A no-op when nothing is pending (a recomputed region run again in backward).
    The form of eager programs: a compiled one waits with `zero_wait_gather_into`.
    """
    for z in list(_GATHERING):
        z.wait_gather(bucket)


zero_wait_gather.register_fake(lambda params, bucket: None)


@torch.library.custom_op("parc::zero_wait_gather_into", mutates_args=("params",))
def zero_wait_gather_into(params: list[torch.Tensor], bucket: int) -> None:
    """`zero_wait_gather` for a compiled program (`compile` ≠ none): the same wait, declared as writing
    `params`, which is what it means (the gather writes the updated weights into them, whole once it returns).

    That declaration is the data dependency a compiled program needs: AOTAutograd's functionalization makes
    every later read of `params` read this op's result, so no compiled graph can run the layer before its
    wait (inductor writes the op back in place, on the same storage: no copy; `aot_eager` hands it copies,
    which `wait_gather` fills). Eager programs keep the undeclared form: autograd counts a declared write as
    a change of the weights (their version), and a recomputed region that saved them before its wait would
    then refuse to run again in backward.
    """
    for z in list(_GATHERING):
        z.wait_gather(bucket, params)


zero_wait_gather_into.register_fake(lambda params, bucket: None)
