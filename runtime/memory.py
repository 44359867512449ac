"""Measured memory of one rank, by kind, to hold `parc report` to account (tests/test_report_memory.py).

Start at `ActivationProbe`. A CPU has no allocator statistics to read, so the
probe measures activations as what they are: the tensors a forward creates that
are still alive when it ends, because autograd saved them for backward or the
pipeline holds them to send and to backpropagate through. While tracking, a
dispatch mode keeps a weak reference to every tensor an op returns, and a
saved-tensor hook keeps one to every tensor autograd saves (a custom op may save
a tensor it made internally, which the dispatch mode does not see). The hook only
watches (runtime/saved.py): where ZeRO-3 or sequence parallelism replaces a saved
tensor by a reference that makes it again in backward, the tensor itself dies and
is not counted; what the reference keeps (sequence parallelism's slice) is. `sample()`
sums the distinct storages still alive, leaving out the rank's state (weights,
gradients, optimizer) and the step's batch (a micro-batch is a slice of it, so
a target that the loss saves would keep the whole batch alive). A weak reference dies exactly when the tensor is freed:
PyTorch keeps a tensor's Python object alive while C++ (a saved variable) holds it.
A buffer handed to a collective is held by the process group's work until the
backend lets go of it, and gloo's worker thread does that a moment after `wait()`
returns: sampled right after a forward whose last op communicates, the buffer may
or may not still be alive. (1 run in 3 of examples/3d.par counted the sequence-parallel
reduce-scatter's (2, 32, 64) all-reduce buffer, 16 KiB, on some ranks: 67200 B
against 50816. Issue 29 took it for a reference cycle, which a `gc.collect()` before
each sample hid by taking long enough; with the collector off, the same tensors die
by themselves within 50 ms, and no cycle holds a tensor.) So a tensor handed to a
`c10d` op counts only where the step keeps it: saved for backward, or an output
of the forward (`sample(outputs)`); a communication buffer nothing else keeps is
not an activation, however long the backend takes to drop it.

A compiled program (`compile inductor | aot_eager`) is measured by the saved-tensor hook
alone (`saved_only`): dynamo does not capture a program run inside a dispatch mode, and
what a compiled graph keeps for backward is exactly what its autograd function saves
(on an uncompiled tp plan the two ways differ by the 4-byte loss).

`held_state` counts the state the same way, from the tensors themselves.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parc.runtime import saved


def storage_bytes(tensors, exclude: frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors`, leaving out storages at the `exclude` addresses."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class ActivationProbe(TorchDispatchMode):
    """Peak bytes of live forward-created tensors, sampled after each forward (`sample`)."""

    def __init__(self, state: list[torch.Tensor], saved_only: bool = False):
        super().__init__()
        self._state = state
        self._saved_only = saved_only  # a compiled program: the saved-tensor hook only (module docstring)
        self._inputs: set[int] = set()
        self._refs: list[weakref.ref] = []
        self._saved_refs: list[weakref.ref] = []  # what autograd saved
        self._comm_refs: list[weakref.ref] = []   # tensors handed to (or returned by) a collective
        self.peak = 0

    def ignore(self, tensors) -> None:
        """Leave out the storages of `tensors`: the step's batch, which the model's cost does not count."""
        self._inputs |= {t.untyped_storage().data_ptr() for t in tensors}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self._refs += made
        if getattr(func, "namespace", None) == "c10d":  # a collective: its buffers the backend holds a while
            self._comm_refs += made + [weakref.ref(t) for t in tree_leaves((args, kwargs))
                                       if isinstance(t, torch.Tensor)]
        return out

    def saw(self, t: torch.Tensor) -> None:  # runtime/saved.py: what autograd saves, before any part claims it
        self._refs.append(weakref.ref(t))
        self._saved_refs.append(weakref.ref(t))

    @contextlib.contextmanager
    def tracking(self):
        """Around one forward: track what it creates and what autograd saves."""
        with saved.hooks(self), contextlib.nullcontext() if self._saved_only else self:
            yield

    def sample(self, outputs=()) -> int:
        """Live tracked bytes now (state excluded), the forward's `outputs` being kept; updates and returns the
        running peak's sample. A collective's buffer counts only if saved or an output (module docstring)."""
        alive, self._refs = _alive(self._refs)
        saved, self._saved_refs = _alive(self._saved_refs)
        comm, self._comm_refs = _alive(self._comm_refs)
        kept = {_ptr(t) for t in (*saved, *(o for o in outputs if isinstance(o, torch.Tensor)))}
        held_by_backend = {_ptr(t) for t in comm} - kept
        exclude = frozenset(_ptr(t) for t in self._state_tensors()) | self._inputs | held_by_backend
        now = storage_bytes(alive, exclude)
        self.peak = max(self.peak, now)
        return now

    def _state_tensors(self):
        for p in self._state:
            yield p
            if p.grad is not None:
                yield p.grad


def _alive(refs: list[weakref.ref]) -> tuple[list[torch.Tensor], list[weakref.ref]]:
    """The tensors of `refs` still alive, and the references pruned to them."""
    alive = [t for t in (r() for r in refs) if t is not None]
    return alive, [weakref.ref(t) for t in alive]


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def held_state(trainer) -> dict[str, int]:
    """Bytes of the state a rank keeps between steps: trainable weights (with bf16's compute copies),
    gradients, optimizer state. ZeRO-2/3's gradient ranges are counted though the runtime frees them after
    each update (runtime/parallel/zero.py `held`): they exist from backward to the update of every step, so
    they are state for the memory a step needs, as the report counts it (measured: their storages' bytes at
    the last step's end).

    Adam's per-tensor `step` counters are 0-dim tensors, a few bytes outside every
    memory formula: they are left out. Measure after a step, when every buffer exists.
    """
    if trainer.zero is not None:
        held = trainer.zero.held()
        params, grads, opt = held["params"], held["grads"], held["optimizer"]
        released = trainer.zero.released_grad_bytes
    else:
        params = [p.detach() for p in trainer.params.values()]
        grads = [p.grad for p in trainer.params.values() if p.grad is not None]  # views of the flat buckets
        opt = [v for st in trainer.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        released = 0
    params = list(params) + trainer.casts.copies()  # bf16: the compute copies a step keeps (runtime/precision.py)
    return {"params": storage_bytes(params), "grads": storage_bytes(grads) + released,
            "optimizer": storage_bytes([t for t in opt if t.dim() > 0])}
