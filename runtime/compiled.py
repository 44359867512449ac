"""The plan's `compile`: each generated program run through torch.compile (see docs/compile.md).

Start at `program`, which the runtime applies where it loads a program (runtime/train.py,
runtime/parallel/pipeline.py), then `warm_up`, which the Trainer calls once at start-up.

- `none` (the default): the program runs as written, op by op (eager), each `torch.ops` callee bound
  once when it is loaded (runtime/eager.py: `load_program(..., eager=True)`).
- `inductor`: `torch.compile(forward, backend="inductor", fullgraph=True, dynamic=False)`.
  Dynamo captures the whole program as ONE graph (fullgraph: a graph break is an error,
  not a silent fallback); AOTAutograd derives its backward; inductor fuses both.
- `aot_eager`: the same capture and AOTAutograd, run by eager kernels (torch's debugging
  backend): it proves capture of every op in seconds, where inductor's codegen takes minutes
  on a CPU. The tests use it for their distributed cases.

What lets a program with parc's ops compile whole: every `torch.ops.parc.*` op is a
`torch.library.custom_op` with a fake (shape) implementation, and every backward formula
that communicates calls an opaque op (runtime/parallel/ops.py `bwd_*`, runtime/parallel/zero.py
`zero_reduce_grad`), never torch.distributed directly; ops that communicate are registered
ORDERED effects, so the compiled graph keeps the program's order of collectives on every
rank. Keyed dropout reads its key when the op runs (runtime/dropout.py), never at trace time.
A recomputed region that holds a collective keeps the collective's output instead of running it
again in backward (runtime/recompute_policy.py): inductor cannot compile an ordered op recomputed.

Compile time is paid once, before step 0: `warm_up` runs one forward and backward of every
program on this rank and returns the seconds it took (parc.run prints them). It leaves no
trace in the training state (tests/test_compile_inductor.py checks it bitwise): the
backward is `torch.autograd.grad`, which returns gradients instead of accumulating them, so
no `.grad`, no gradient-bucket hook and no optimizer state is touched; ZeRO-3's gathers and
reduce-scatters, which the program's own ops run, are drained and zeroed after it; bf16's
compute copies are made from the masters as step 0 makes them again; it draws from no random generator; the data it reads is
step 0's batch from the run's source, a pure function of the step (runtime/data.py).
"""

from __future__ import annotations

import contextlib
import time

import torch

from parc.errors import ParcError

MODES = ("none", "inductor", "aot_eager")


def program(forward, mode: str):
    """`forward` as the plan's `compile` runs it."""
    if mode == "none":
        return forward
    if mode not in MODES:
        raise ValueError(f"compile {mode!r}: not one of {', '.join(MODES)}")  # validate.py refuses it first
    from parc.runtime.parallel import ops

    if not ops.ORDERED_EFFECTS:
        raise ParcError(f"compile {mode}: torch {torch.__version__} cannot mark parc's collectives as ordered "
                        "effects, so the compiler could reorder them across ranks", hint="use `compile none`")
    # dynamic=False: a step's shapes never change (the micro-batch is fixed at `parc compile`)
    return torch.compile(forward, backend=mode, fullgraph=True, dynamic=False)


def split_backward(mode: str) -> None:
    """Let a compiled program's backward run twice: a zero-bubble schedule computes a micro-batch's
    input gradients (I, `retain_graph=True`) apart from its weight gradients (W). AOTAutograd's
    donated buffers (the compiled backward freeing saved tensors as it reads them) forbid that, so
    they are turned off. A process-wide torch setting, read when a program compiles and when its
    backward runs; a rank's process runs one plan. The compiled backward is one autograd node, so
    I and W each run all of it (W's input gradients, and I's weight gradients, are computed and
    dropped): exact, but the split saves no compute under `compile`."""
    if mode != "none":
        torch._functorch.config.donated_buffer = False


def warm_up(trainer) -> float | None:
    """Compile every program of this rank now, by one forward and backward that changes no training
    state (see the module docstring); the seconds it took, or None when the plan compiles nothing."""
    if trainer.art.plan["plan"].get("compile", "none") == "none":
        return None
    t0 = time.perf_counter()
    micro_batch = trainer.local_batches(0)[0]
    trainer.casts.refresh()  # bf16: the compute copies the programs read (runtime/precision.py); step 0 remakes them
    zero = trainer.zero
    if zero is not None:
        zero.start_micro_batch(sync=True)
    with zero.active() if zero is not None else contextlib.nullcontext(), trainer.dropout_key(0):
        if trainer.pipeline is None:
            (loss,) = trainer.forward(*trainer.state, *micro_batch)
            _grad([loss], [None], list(trainer.params.values()))
        else:
            for stage in sorted(trainer.pipeline.stages.values(), key=lambda st: st.index):
                _warm_stage(stage, micro_batch, trainer.ctx.device)
    if zero is not None and zero.stage == 3:  # its gathers and reduce-scatters ran: drain them, then forget them
        zero.finish()
        zero.zero()
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize(trainer.ctx.device)
    return time.perf_counter() - t0


def _warm_stage(stage, micro_batch, device) -> None:
    """One pipeline stage on stand-in received activations (zeros of the received shapes)."""
    leaves = [torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
              .requires_grad_(spec["grad"]) for spec in stage.recv]
    out = stage.forward(*stage.state, *leaves, *micro_batch)
    if stage.last:
        tensors, grads = [out[0]], [None]
    else:
        carry = [o for o, spec in zip(out, stage.send) if spec["grad"] and o.requires_grad]
        tensors, grads = carry, [torch.zeros_like(o) for o in carry]
    _grad(tensors, grads, stage.params + [x for x in leaves if x.requires_grad])


def _grad(tensors, grads, inputs) -> None:
    """Run backward through `tensors` (compiling it) and drop the gradients: nothing accumulates."""
    inputs = [t for t in inputs if t.requires_grad]
    if tensors and inputs:
        torch.autograd.grad(tensors, inputs, grads, allow_unused=True)
