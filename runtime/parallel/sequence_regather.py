"""Sequence parallelism's gathered inputs: all-gathered again in backward, not kept (Megatron-LM's way).

Under sequence parallelism a column layer's input arrives as this rank's slice of the sequence and is
all-gathered (`parc.allgather_reducescatter`, runtime/parallel/ops.py) before the layer's matmul. The
matmul saves what it multiplied, for its weight gradient: the whole gathered sequence, or under
`precision bf16` autocast's bf16 cast of it, one per matmul that reads it (q, k and v each cast their
own). Kept, each copy is tp times the slice. Megatron-LM keeps the slice and all-gathers it again in the
backward (Korthikanti et al. 2022, arXiv:2205.05198 §4.2.2; `LinearWithGradAccumulationAndAsyncCommunication`);
so does this.

Start at `Regather`. Around each forward of an eager program it is a part of runtime/saved.py's hooks:

- each all-gather the forward runs is noted (`note`, from the op's setup): its input slice, its output's
  storage, its autograd node and how to gather the slice again;
- a saved tensor that is a view of a gathered output (the same storage), or of a dtype cast of one (its
  base's grad_fn is `ToCopyBackward0` and that node's input is the gather's node: autocast's cast), is
  replaced by (the gather, the cast's dtype, the view's geometry); the slice is what is kept (`keeps`);
- in the backward the first unpack of a gather all-gathers its slice again, and casts it as the forward
  did: the same bits, since an all-gather concatenates and a cast is elementwise. The copy is shared by
  the gather's other saved views (q, k and v: one copy, where the forward kept three casts) and freed with
  the last of them. That first unpack also starts the all-gather the backward needs next, the forward's
  gather before this one (`_Gather.prefetch`), so it runs while this layer's gradients are computed, as
  Megatron-LM posts its gather under the input gradient's matmul; only the backward's first gather waits
  whole.

A slice modified in place after its forward stops the backward with an error, as autograd stops for its
own saved tensors (the version counter): gathered again, it would give another gradient, silently.

Only eager programs (`compile none`): under `compile` the gather runs inside the compiled graph, which
saves what it chooses (parc/analysis/activations.py counts the gathered copy there). A region under
`recompute` saves through the checkpoint's hooks, inner to these: its gather runs again with the region.
What it costs: one all-gather per gathered input and micro-batch more, in the backward
(parc/analysis/cost.py prices it); what it saves: tp − 1 of tp of each gathered copy.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from parc.runtime import saved

_ACTIVE: list["Regather"] = []  # the Regather of the forward running now


def note(node, shard: torch.Tensor, whole: torch.Tensor, gather: Callable) -> None:
    """From the all-gather's autograd setup: it gathered `shard` into `whole`; `gather(shard)` starts the same
    all-gather again and returns the call that waits for it."""
    if _ACTIVE:
        _ACTIVE[-1].noted(node, shard, whole, gather)


class _Gather:
    """One all-gather of a forward: its slice, and the copies the backward makes of its output, by dtype."""

    __slots__ = ("shard", "version", "gather", "shape", "copies", "claimed", "before", "started", "__weakref__")

    def __init__(self, shard: torch.Tensor, gather: Callable, shape: tuple, before: "_Gather | None"):
        self.shard = shard.detach()   # the same storage and version counter, without the autograd graph
        self.version = shard._version
        self.gather, self.shape = gather, shape
        self.copies: dict = {}
        self.claimed = False          # a saved tensor of it was replaced (`Regather.pack`): backward will need it
        # the forward's gather before this one, which backward needs next (weak: never kept alive by this one)
        self.before = weakref.ref(before) if before is not None else None
        self.started = None           # its all-gather, started ahead (`prefetch`): the call that waits for it

    def whole(self, dtype):
        """The gathered output again (cast to `dtype` as the forward's autocast did, None: as gathered); the first
        call also starts the gather backward needs next."""
        out = self.copies.get(dtype)
        if out is None:
            self._check()
            finish, self.started = self.started or self.gather(self.shard), None
            self.prefetch()
            with torch.no_grad():
                out = finish()
                if dtype is not None:
                    out = out.to(dtype)
            self.copies[dtype] = out
        return out

    def prefetch(self) -> None:
        """Start the all-gather of the nearest earlier claimed gather of the forward, if not made or started: it
        runs while this layer's gradients are computed (Megatron-LM posts its gather under the input gradient's
        matmul). Which gathers start when is decided by the program alone (claims are made in the forward), the
        same on every rank."""
        g = self.before() if self.before is not None else None
        while g is not None and not g.claimed:
            g = g.before() if g.before is not None else None
        if g is not None and not g.copies and g.started is None:
            g._check()
            g.started = g.gather(g.shard)

    def _check(self) -> None:
        if self.shard._version != self.version:
            raise RuntimeError(
                f"sequence parallelism: the slice {tuple(self.shard.shape)} all-gathered before a column layer "
                f"was modified in place after the forward (version {self.version} → {self.shard._version}); "
                f"the backward gathers it again and would compute another gradient")


class Regather:
    """The runtime/saved.py part that replaces saved gathered inputs by their slices (module docstring)."""

    def __init__(self):
        self._by_storage: dict[int, tuple[StorageWeakRef, _Gather]] = {}
        self._by_node: dict = {}
        self._last: _Gather | None = None   # the forward's latest gather

    @contextlib.contextmanager
    def forward(self):
        """Around one forward (a micro-batch's, or a pipeline stage's)."""
        try:
            with saved.hooks(self, _ACTIVE):
                yield
        finally:
            self._by_storage.clear()
            self._by_node.clear()
            self._last = None

    def noted(self, node, shard: torch.Tensor, whole: torch.Tensor, gather: Callable) -> None:
        if not (whole.is_contiguous() and whole.storage_offset() == 0):
            return  # never so (torch.cat's output); unmatched, its saved views stay as they are
        g = self._last = _Gather(shard, gather, tuple(whole.shape), self._last)
        storage = whole.untyped_storage()
        self._by_storage[storage.data_ptr()] = (StorageWeakRef(storage), g)
        self._by_node[node] = g

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        hit = self._by_storage.get(storage.data_ptr())
        # the weak reference keeps the gathered storage's address from being reused while it is listed
        if hit is not None and hit[0] == StorageWeakRef(storage):
            hit[1].claimed = True
            return hit[1], None, t.storage_offset(), tuple(t.shape), t.stride()
        base = t if t._base is None else t._base
        fn = base.grad_fn
        if fn is None or fn.name() != "ToCopyBackward0" or not fn.next_functions:
            return t
        g = self._by_node.get(fn.next_functions[0][0])
        if g is None or tuple(base.shape) != g.shape or not base.is_contiguous() or base.storage_offset() != 0:
            return t
        g.claimed = True
        return g, base.dtype, t.storage_offset(), tuple(t.shape), t.stride()

    @staticmethod
    def keeps(held) -> tuple:
        return (held[0].shard,)

    @staticmethod
    def unpack(held) -> torch.Tensor:
        g, dtype, offset, shape, stride = held
        return g.whole(dtype).as_strided(shape, stride, offset)
