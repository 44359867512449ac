"""Data parallelism: bucketed gradient all-reduce, overlapped with backward.

The buckets come from the compiler (`parc.passes.grad_buckets`): lists of
parameters in the order their gradients become ready. Each bucket owns one flat
buffer, and every parameter's `.grad` is a view into it, so autograd accumulates
micro-batches in place and no copy is made (DDP's gradient_as_bucket_view). A
post-accumulate-grad hook counts the gradients of the last micro-batch; when a
bucket's last one lands, its all-reduce is launched asynchronously while backward
goes on. `finish()` waits for them: one collective per bucket per step.

`reduce_dtype` (`precision bf16 reduce=bf16`, runtime/precision.py): the bucket,
already divided by dp in fp32, is cast to bf16, all-reduced in bf16 (half the
bytes), and copied back into the fp32 buffer, where the gradients accumulated.

Nothing to reduce (a group of one and nothing to divide by: dp 1, or an expert
whose edp group is itself at dp 1): no buffers and no hooks. Each step's gradients
start from None, as eager PyTorch's `zero_grad(set_to_none=True)` leaves them:
autograd hands its first gradient of a parameter over as `.grad` (no zeroed
buffer to add it into: the add and the zeroing are each a pass over every
gradient, about 2% of a step of examples/gpt.py on one CPU core, issue 13). The
optimizer sees the same values: 0 + g is g, bit for bit. What stays as before:
`finish()` gives a parameter that got no gradient a zero one, as the buffer gave
it (the optimizer steps it as every other plan does), and the gradients are
dropped only when the next step starts, so after a step every buffer exists (what
runtime/memory.py `held_state` and the report count).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GradBuckets:
    def __init__(self, params: dict[str, torch.Tensor], buckets: list[list[str]], group, dp: int,
                 divisor: int | None = None, reduce_dtype: torch.dtype | None = None):
        # `divisor` (default dp): the sum over `group` is divided by it; expert gradients are summed
        # over the edp group but averaged over all of dp (runtime/parallel/expert_parallel.py). `reduce_dtype`:
        # the wire dtype of the sum (`precision bf16 reduce=bf16`), accumulated back into fp32
        self.group, self.dp, self.divisor, self.reduce_dtype = group, dp, divisor or dp, reduce_dtype
        self.local = dp == 1 and self.divisor == 1  # nothing to reduce: autograd's own gradients (docstring)
        self._stale = False  # local: the gradients held are the last step's, dropped when the next one starts
        self.flat: list[torch.Tensor] = []
        self.members: list[list[torch.Tensor]] = []
        self._bucket_of: dict[int, int] = {}
        for b, names in enumerate(buckets):
            ps = [params[n] for n in names]
            if self.local:
                for p in ps:
                    p.grad = None  # the first backward's gradient becomes `.grad`
                self.members.append(ps)
                continue
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device)
            offset = 0
            for p in ps:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad)
            self.flat.append(flat)
            self.members.append(ps)
        self._pending: list[int] = []
        self._works: list = []
        self._sync = False

    def start_micro_batch(self, sync: bool) -> None:
        """Call before each backward; `sync` on the last micro-batch of the step."""
        if self.local:
            if self._stale:
                for ps in self.members:
                    for p in ps:
                        p.grad = None
                self._stale = False
            return
        self._sync = sync
        self._pending = [len(m) for m in self.members]
        self._works = [None] * len(self.members)

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        b = self._bucket_of[id(p)]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        if self.divisor > 1:
            self.flat[b].div_(self.divisor)  # average: pre-divide, as DDP does, to keep sums in range
        if self.dp > 1:
            wire = self.flat[b] if self.reduce_dtype is None else self.flat[b].to(self.reduce_dtype)
            self._works[b] = (dist.all_reduce(wire, group=self.group, async_op=True), wire)
        else:
            self._works[b] = True

    def finish(self) -> None:
        """Wait for every bucket; launch any whose gradients never all arrived (unused parameters)."""
        if self.local:
            for ps in self.members:
                for p in ps:
                    if p.grad is None:  # unused this step: the zero gradient a bucket would hold
                        p.grad = torch.zeros_like(p)
            return
        for b, work in enumerate(self._works):
            if work is None:
                self._launch(b)
        for b, work in enumerate(self._works):
            if work is not True:
                work[0].wait()
                if work[1] is not self.flat[b]:
                    self.flat[b].copy_(work[1])  # the bf16 sum, back into the fp32 gradients

    def zero(self) -> None:
        """After the optimizer step: the next step's gradients start from zero."""
        if self.local:
            self._stale = True  # dropped by the next start_micro_batch (see the module docstring)
            return
        for flat in self.flat:
            flat.zero_()
