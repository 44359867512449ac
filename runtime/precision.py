"""The plan's `precision`: what dtype a program computes in, and what the optimizer updates (docs/precision.md).

- fp32: as written.
- bf16: Megatron's and FSDP2's layout.
  * Masters: every trainable parameter has an fp32 master, and it is what the
    optimizer, clipping and checkpoints see. Optimizer state is fp32 beside it.
    Without ZeRO the master is the parameter itself. Under ZeRO each rank holds
    only its range of the masters, a separate fp32 tensor (runtime/parallel/zero.py),
    and `full_params` gathers them whole for checkpoints and --verify.
  * Compute copy: `StepCasts.refresh()`, at the start of each step, makes one
    bf16 copy of each master (a differentiable `to(bfloat16)`); every
    micro-batch's forward reads the copy instead of the master. The copies are
    kept until the next step's refresh: 2 bytes per parameter of state, as
    Megatron keeps its bf16 model weights beside the fp32 main ones.
  * Gradients: each micro-batch's gradient of a copy (bf16, from the bf16
    matmuls) flows back through the cast into the master's fp32 `.grad`, where
    micro-batches accumulate in fp32 (Megatron's `main_grad`).
  * Forward under `torch.autocast(bf16)`: the matmuls see bf16 weights already;
    autocast keeps its fp32 ops (layer norm, softmax, cross entropy) in fp32,
    so the loss is fp32 as the vocab-parallel cross entropy's is. Everything
    else follows its bf16 inputs: embeddings of bf16 tables, residual adds,
    GELU, attention, so the activations autograd saves are bf16 (a layer
    norm's fp32 output is saved only as the bf16 copy its matmul makes).
  * The dp gradient reduction runs in `reduce_dtype(plan)`: fp32 (default) or
    bf16 (`precision bf16 reduce=bf16`: half the bytes; the reduced gradient
    is added back into the fp32 accumulator).
  * Pipeline: floating values crossing a stage cut travel and wait in bf16
    (`boundary_specs`, `wrap`); the loss stays fp32.
  * ZeRO keeps no whole fp32 weight to copy, so no `StepCasts` there
    (runtime/parallel/zero.py): stages 1–2 hold the whole flat parameter buffer in
    bf16, the program's weights themselves, refreshed by an all-gather of the
    bf16-cast master ranges after each update; their bf16 gradients are summed
    into fp32 accumulators. Stage 3's gather casts the rank's fp32 range to bf16
    and gathers bf16.
- fp16: bf16's layout with float16 in place of bfloat16 everywhere above (compute
  copies, ZeRO's flat buffers and gathers, pipeline boundaries, autocast), plus
  DeepSpeed's dynamic loss scaler (runtime/loss_scale.py): the loss is scaled
  before backward, the fp32 master gradients unscaled before clipping, and a step
  whose gradients overflowed is skipped, decided on the device. `reduce=` stays
  fp32 (validate refuses reduce=bf16 under fp16). The overflow flag is all-reduced
  over dp, cp, tp and pp (runtime/parallel/grad_norm.py `nonfinite`; ep and edp groups
  lie inside dp), so every rank skips the same steps. Under expert parallelism an
  expert's weight gradient is one fp16 output over the tokens of several ranks, so
  near the threshold whether a step overflows can differ from the serial run's
  (docs/precision.md).

The serial reference (runtime/serial_reference.py) applies the same layout, so --verify
compares bf16 with bf16.
"""

from __future__ import annotations

import contextlib
import functools

import torch


SUPPORTED = ("fp32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype parameters and activations compute in, or None for fp32 (nothing is cast)."""
    return _DTYPES.get(precision)


def reduce_dtype(plan_summary: dict) -> torch.dtype | None:
    """plan.json's `precision … reduce=`: the dtype the dp gradient reduction moves, or None for fp32."""
    return _DTYPES.get(plan_summary.get("grad_reduce", "fp32"))


def accumulate_dtype(plan_summary: dict) -> torch.dtype | None:
    """plan.json's `precision bf16 reduce=bf16 accumulate=…`: the dtype ZeRO-1/2 accumulate gradients in
    (runtime/parallel/zero.py), or None for fp32."""
    return _DTYPES.get(plan_summary.get("grad_accumulate", "fp32"))


def autocast(precision: str, device) -> contextlib.AbstractContextManager:
    """The compute context of `precision` on `device` (a no-op for fp32)."""
    if precision not in _DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=_DTYPES[precision])


class StepCasts:
    """The bf16 compute copy of each fp32 master (see the module docstring); empty under fp32."""

    def __init__(self, tensors, dtype: torch.dtype):
        self._masters = list(tensors)
        self._ids = {id(t) for t in self._masters}
        self._dtype = dtype
        self._cache: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._ids)

    def __call__(self, args: tuple) -> tuple:
        return tuple(self._cast(a) if id(a) in self._ids else a for a in args)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        c = self._cache.get(id(t))
        if c is None:
            c = self._cache[id(t)] = t.to(self._dtype)  # differentiable: grads reach the fp32 master
        return c

    def refresh(self) -> None:
        """At the start of a step: new copies of the masters the last step updated. The old copies go first,
        so the copies never exist twice."""
        self._cache.clear()
        for t in self._masters:
            self._cast(t)

    def copies(self) -> list[torch.Tensor]:
        """The copies held now (state: counted by runtime/memory.py `held_state`)."""
        return list(self._cache.values())


def wrap(forward, precision: str, device, casts: StepCasts | None = None):
    """`forward` run under `precision`: `casts` replaces the masters it covers by their bf16 copies, the
    body runs under autocast, floating outputs with dims leave as bf16 and 0-dim ones (the loss) as fp32.

    Why the outputs: a pipeline stage's outputs are what it sends, into receive buffers that
    `boundary_specs` made bf16; the loss is reported and verified in fp32. The casts are
    differentiable, so the incoming gradient reaches the body in the dtype it produced.
    """
    if precision not in _DTYPES:
        return forward
    low = _DTYPES[precision]

    def out_dtype(o: torch.Tensor) -> torch.dtype:
        return low if o.dim() else torch.float32

    @functools.wraps(forward)
    def run(*args):
        if casts:
            args = casts(args)
        with autocast(precision, device):
            out = forward(*args)
        return tuple(o.to(out_dtype(o)) if isinstance(o, torch.Tensor) and o.dtype in (torch.float32, low) else o
                     for o in out)

    return run


def boundary_specs(specs: list[dict], precision: str) -> list[dict]:
    """plan.json's send/recv specs of a pipeline stage as the runtime allocates them: traced fp32 values
    travel in the compute dtype (what `wrap` hands the sender)."""
    low = _DTYPES.get(precision)
    if low is None:
        return specs
    name = str(low).removeprefix("torch.")
    return [{**s, "dtype": name} if s["dtype"] == "float32" and s["shape"] else s for s in specs]
