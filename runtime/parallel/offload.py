"""ZeRO-Offload (`zero stage=N offload=cpu`): the fp32 masters, the optimizer state and the step in host memory.

Start here from `ZeroOptimizer.step` (runtime/parallel/zero.py), which hands this module its reduced
gradient ranges when the plan's partition table says `"offload": "cpu"`. As DeepSpeed's ZeRO-Offload
(Ren et al., 2021) does it, per bucket this rank holds in host memory, pinned when CUDA is present:

  its fp32 master range        4/N bytes a parameter    (the optimizer's parameters)
  the optimizer state          8/N (Adam's two moments) (created by the host step)
  a gradient buffer            4/N                      (what the reduced range is copied into)

and the step is the plan's optimizer on those host tensors, torch's `foreach` kernels (multi-tensor
loops, bitwise the per-tensor loop the serial reference runs; the fused CPU Adam is not, by 1 ulp on
some elements: measured 6e-8 after five AdamW steps, so it is not used and the tests stay exact).

One step:

  1. device → host: each bucket's reduced fp32 gradient range into its host buffer, `non_blocking`, as
     soon as it is final: `ZeroOptimizer._wait` calls `download` when the last micro-batch's reduce of
     the bucket lands, during backward (stages 2–3 reduce bucket by bucket as backward goes; stage 1 in
     the last micro-batch), so the copies run under the rest of backward, as DeepSpeed's.
     What the step does to the device's gradients after that is the dependency: the sums a gradient
     still lacks (tp partials, tied copies: `Trainer._complete_grads`), fp16's unscale and clipping.
     The two multiplies are declared (`multiplied`: the Trainer passes 1/S and the clip coefficient) and
     the host applies them to its copy, the same fp32 product, so the same bits. Anything else that
     writes a range in place bumps its version counter (views share it), and that bucket is copied
     again at the step: a copy that might be stale is never used. At the step every copy is waited on
     once (`step`);
  2. the host step over all ranges (skipped where `found` says so: runtime/optim_step.py);
  3. host → device: each updated master range into the device's copy of the range (`non_blocking`),
     which the ZeRO runtime then casts and all-gathers as it does without offload; the copy and the
     gather are queued in stream order, and the gathers are waited on by the next forward layer by
     layer (zero.py "Overlap"), so the upload of later layers runs under earlier layers' compute.

What stays on the device: the program's weights and gradients as without offload. `ZeroOptimizer.master`
keeps holding each range's reduced gradient (clipping and the global norm read it there). In fp32 it
is the device's own fp32 range (at stages 1–2 a view into the flat parameter buffer, at stage 3 the
shard the gathers send), which step 3 refreshes: offload frees the 8/N of optimizer state. Under a
16-bit compute dtype (`precision bf16`) the device keeps no fp32 range at all, as DeepSpeed: each
`master` becomes a zero-stride stand-in of its shape that only holds the gradient (`stands_in`), step 3
casts each range to bf16 on the host and uploads that (half the bytes), into a transient the stage 1–2
all-gather sends, or into the 2/N bf16 shard stage 3 keeps for its gathers (`kept`). Offload then frees
4/N + 8/N (stages 1–2) or 2/N + 8/N (stage 3) bytes a parameter.

On a CPU-only machine the "device" is the CPU: the same code path runs, and every copy above is a real
copy between separate buffers (tests/test_zero_offload.py proves the result equals the serial run's).
"""

from __future__ import annotations

import torch

from parc.runtime.optim_step import step_unless
from parc.runtime.param_groups import RangeGroups


def _host_like(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised host tensor of `t`'s shape (and dtype, unless given), page-locked when `pin` (so copies
    to and from the device run asynchronously on its copy engine)."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=pin)


class HostOptimizer:
    """This rank's ZeRO ranges in host memory, and the plan's optimizer stepping them there.

    `ranges`: the ZeRO runtime's fp32 ranges (its `master` list, one per bucket), which hold the reduced
    gradients. `compute_dtype` None: they are the device's weights and receive the updated values; a dtype
    (bf16): they are replaced in the list by stand-ins, and the device gets that dtype's copy instead
    (`range_in`; `keep`: stage 3 keeps it between steps). `make_opt`, `buckets`, `rank`, `decay_of`: as for
    `ZeroOptimizer` (the optimizer sees the same decay runs, runtime/param_groups.py)."""

    def __init__(self, ranges: list[torch.Tensor], buckets: list[dict], rank: int, decay_of: dict, make_opt,
                 compute_dtype: torch.dtype | None = None, keep: bool = False, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.ranges, self.device = ranges, ranges[0].device
        self.master = [_host_like(m, self.pin) for m in ranges]
        self.grads = [_host_like(m, self.pin) for m in ranges]
        with torch.no_grad():
            for h, d in zip(self.master, ranges):
                h.copy_(d)
        self.stands_in = compute_dtype is not None
        self.staging = [_host_like(m, self.pin, compute_dtype) for m in ranges] if self.stands_in else []
        self.kept: list[torch.Tensor] = []
        # bucket → (the device gradient copied early, its version then, factors to apply since), or None
        self.early: list[tuple | None] = [None] * len(ranges)
        self.reused = 0  # buckets whose early copy the last step used (tests/test_zero_offload.py)
        if self.stands_in:
            # the device's fp32 ranges are dropped: one shared element, expanded, holds each range's gradient
            shared = torch.zeros(1, dtype=ranges[0].dtype, device=self.device)
            ranges[:] = [shared.expand(m.shape) for m in ranges]
            if keep:
                self.kept = [torch.empty(m.shape, dtype=compute_dtype, device=self.device) for m in self.master]
                self._upload_kept()
        self.pieces = RangeGroups(self.master, buckets, rank, decay_of)
        self.optimizer = make_opt(self.pieces.groups())
        for group in self.optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True  # multi-tensor host kernels: the serial loop's values, fewer launches

    def download(self, b: int, grad: torch.Tensor) -> None:
        """Bucket b's reduced gradient `grad` is final for this step: start its copy to the host."""
        with torch.no_grad():
            self.grads[b].copy_(grad, non_blocking=True)
        self.early[b] = (grad, grad._version, [])

    def multiplied(self, factor: torch.Tensor) -> None:
        """Every range's gradient on the device was just multiplied in place by the 0-dim `factor`: each early
        copy gets the same product at the step. A copy whose gradient was also written otherwise since
        (its version moved by more than this one multiply) is dropped, and copied again at the step."""
        for b, early in enumerate(self.early):
            if early is not None:
                grad, version, factors = early
                fresh = grad._version == version + 1
                self.early[b] = (grad, version + 1, [*factors, factor]) if fresh else None

    def _gradients_down(self) -> None:
        """Each host gradient buffer := its range's final gradient: the early copy with the declared factors
        applied, or a copy made now where there is none, or it may be stale."""
        late, self.reused = [], 0
        with torch.no_grad():
            for b, (h, d) in enumerate(zip(self.grads, self.ranges)):
                early = self.early[b]
                if early is None or early[0] is not d.grad or d.grad._version != early[1]:
                    h.copy_(d.grad, non_blocking=True)
                    late.append(b)
            _wait_for_device(self.ranges)  # the host step reads what the copies wrote
            for b, early in enumerate(self.early):
                if early is not None and b not in late:
                    self.reused += 1
                    for factor in early[2]:
                        self.grads[b].mul_(factor.to(device="cpu", dtype=self.grads[b].dtype))
        self.early = [None] * len(self.early)

    def step(self, found: torch.Tensor | None) -> None:
        """Gradients down, the host step, parameters up (the module docstring's 1–3)."""
        self._gradients_down()
        for m, g in zip(self.master, self.grads):
            m.grad = g
        self.pieces.bind_grads()
        step_unless(self.optimizer, None if found is None else found.to("cpu"))
        if self.kept:
            self._upload_kept()
        elif not self.stands_in:
            with torch.no_grad():
                for h, d in zip(self.master, self.ranges):
                    d.copy_(h, non_blocking=True)  # ordered before the all-gather that reads it, on d's stream

    def range_in(self, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Under stand-ins: this rank's range of bucket b on the device in `dtype`, for a gather to send. The
        kept copy when there is one of that dtype; else a fresh upload (the compute dtype through its pinned
        staging buffer, fp32, for checkpoints, straight from the master)."""
        if self.kept and dtype == self.kept[b].dtype:
            return self.kept[b]
        out = torch.empty(self.master[b].shape, dtype=dtype, device=self.device)
        with torch.no_grad():
            if dtype == self.staging[b].dtype:
                self.staging[b].copy_(self.master[b])  # the cast on the host: half the bytes cross
                out.copy_(self.staging[b], non_blocking=True)
            else:
                out.copy_(self.master[b])
        return out

    def _upload_kept(self) -> None:
        with torch.no_grad():
            for b, k in enumerate(self.kept):
                self.staging[b].copy_(self.master[b])
                k.copy_(self.staging[b], non_blocking=True)

    def load(self, b: int, values: torch.Tensor) -> None:
        """Bucket b's range := `values` (a checkpoint's, fp32, on the device): the host master, and what the
        device keeps of it."""
        with torch.no_grad():
            self.master[b].copy_(values)
            if not self.stands_in:
                self.ranges[b].copy_(values)
            elif self.kept:
                self.kept[b].copy_(values)

    def clear_grads(self) -> None:
        for m in self.master:
            m.grad = None
        self.pieces.clear_grads()

    def device_tensors(self) -> list[torch.Tensor]:
        """What the device holds for this module between steps (stage 3's bf16 shards), for `held`."""
        return list(self.kept)

    def host_bytes(self) -> dict[str, int]:
        """What this rank holds in host memory, by kind (tests/test_zero_offload.py checks the report's rows);
        the bf16 staging buffers are a transient of the upload, not counted."""
        state = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": size(self.master), "grads": size(self.grads), "optimizer": size(state)}


def _wait_for_device(tensors: list[torch.Tensor]) -> None:
    """Block the host until the device's queued work on `tensors` is done (no-op for host tensors: a copy
    between CPU tensors has completed when it returns)."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()
