"""The plan's `precision`: how a program's forward runs (see docs/precision.md).

- fp32: as written.
- bf16: mixed precision by autocast. Parameters stay fp32 — they *are* the
  master weights the optimizer updates — and each program's forward runs under
  `torch.autocast(device, bfloat16)`: matmuls (mm/addmm/bmm/linear/sdpa) cast
  their inputs to bf16 and compute in bf16; reductions, softmax/log-softmax and
  the loss stay fp32 by autocast's own op lists. Backward runs outside autocast
  (autograd replays each op's casts), so every parameter gradient is fp32 and
  every dp / ZeRO reduction of gradients is fp32.
- fp16: refused at compile time (`check_supported`): fp16 needs dynamic loss
  scaling, which parc does not implement; silently training in fp32 would lie.

Weights that only matmuls read (the compiler marks them `"autocast_weight"` in
plan.json; parc/analysis/activations.py `autocast_weights`) are cast to bf16 once per step
by `StepCasts`, not by autocast once per micro-batch forward: autocast's cast cache
lives for one forward, and each matmul saves the copy it used, so a pipeline rank
with p micro-batches in flight held p bf16 copies of its weights. The one copy is
the same `to(bfloat16)` autocast would have made, so the numbers do not change;
its gradient flows back into the fp32 weight through the cast, in every
micro-batch's backward. `Trainer.step` clears the copies after the last backward.

The wrapper is applied where a program is loaded (runtime/train.py,
runtime/pipeline.py), and the serial reference (runtime/verify.py) uses the same
`autocast`, so --verify compares bf16 with bf16.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from parc.errors import ParcError

# Only these run; fp16 is parsed (the language names it) but refused below.
SUPPORTED = ("fp32", "bf16")
_DTYPES = {"bf16": torch.bfloat16}


def check_supported(plan) -> None:
    """Compile-time refusal of a precision the runtime cannot honour (`plan` is a parc.grammar.plan.Plan)."""
    if plan.precision == "fp16":
        raise ParcError("precision fp16 needs dynamic loss scaling (fp16's 5 exponent bits underflow small "
                        "gradients), which parc does not implement", plan.spans.get("precision"),
                        hint="use `precision bf16`: same 16-bit compute, fp32's exponent range, no loss scaling")


def autocast(precision: str, device) -> contextlib.AbstractContextManager:
    """The compute context of `precision` on `device` (a no-op for fp32)."""
    if precision not in _DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=_DTYPES[precision])


class StepCasts:
    """One bf16 copy per step of each weight only matmuls read (see the module docstring)."""

    def __init__(self, tensors, dtype: torch.dtype = torch.bfloat16):
        self._ids = {id(t) for t in tensors}
        self._dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __call__(self, args: tuple) -> tuple:
        return tuple(self._cast(a) if id(a) in self._ids else a for a in args)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        c = self._cache.get(id(t))
        if c is None:
            c = self._cache[id(t)] = t.to(self._dtype)  # differentiable: grads reach the fp32 weight
        return c

    def clear(self) -> None:
        """After the step's last backward: the weights are about to change."""
        self._cache.clear()


def wrap(forward, precision: str, device, casts: StepCasts | None = None):
    """`forward` run under `precision`'s autocast; its low-precision float outputs are returned as fp32;
    `casts` replaces the weights it covers by their bf16 copies of this step.

    Why cast outputs back: a pipeline stage's outputs are sent into receive buffers
    allocated with the traced (fp32) dtype, and the loss is reported and verified in
    fp32. The cast is differentiable, so the incoming gradient is cast back to the
    output's bf16 in backward, as autocast itself would have done.
    """
    if precision not in _DTYPES:
        return forward
    low = _DTYPES[precision]

    @functools.wraps(forward)
    def run(*args):
        if casts:
            args = casts(args)
        with autocast(precision, device):
            out = forward(*args)
        return tuple(o.float() if isinstance(o, torch.Tensor) and o.dtype == low else o for o in out)

    return run
