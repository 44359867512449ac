"""parc's collectives as autograd-aware `torch.ops.parc.*` custom ops.

Start here to see what a `torch.ops.parc.<name>(x, "tp", ...)` line of a
generated program does. Each op is named `<forward>_<backward>`: the forward
collective, then what its backward does, so a program reads the way Megatron's
paper draws it. `identity_allreduce` is Megatron's "f" (at a column layer's
input), `allreduce_identity` its "g" (at a row layer's output).

Group resolution. A compiled program can only name a mesh axis ("tp"), not a
process group, so this module keeps one per-process binding axis →
ProcessGroup, set by `bind_groups(ctx)` from `Trainer.__init__`. This is the one
documented exception to "no process-group globals" (STYLE.md rule 3): the
program text is data and cannot carry a Python object.

Recording. `with record() as log:` appends `(kind, axis, phase)` for every
collective actually issued (phase "fwd", "bwd" or "step"), which is how the tests
count collectives at run time instead of trusting the graph.

gloo has no reduce-scatter; there it is an all-reduce followed by taking this
rank's chunk (same result, twice the traffic). It is still recorded as
"reduce_scatter": the record states what the program asks for.

The ops with a backward are made by `eager.custom_op` / `eager.register_autograd`
(runtime/eager.py): the custom op, and an eager twin (an autograd.Function with the same
forward and backward functions) that a program run uncompiled calls instead, for the custom
op's per-call Python cost.

Under `compile inductor` (runtime/compiled.py) torch.compile traces each op's fake
(shapes only) and, through AOTAutograd, its backward formula. So every backward that
communicates calls an opaque op (`parc::bwd_*` below) rather than torch.distributed,
and every op that communicates is registered ORDERED (`mark_ordered`): the compiled graph
keeps the program's order of collectives, which every rank of a group must share.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from parc.runtime import eager
from parc.runtime.parallel import sequence_regather

_GROUPS: dict[str, object] = {}  # axis → ProcessGroup; see the module docstring for why this is global
_RECORD: list | None = None


def bind_groups(ctx) -> None:
    """Bind each mesh axis name to this rank's process group of `ctx` (a ParallelContext)."""
    _GROUPS.clear()
    _GROUPS.update({axis: g for axis, g in ctx.groups.items() if g is not None})
    parc.runtime.dropout.bind_cp_rank(dist.get_rank(_GROUPS["cp"]) if "cp" in _GROUPS else None)


def group(axis: str):
    if axis not in _GROUPS:
        raise RuntimeError(f"no process group bound for mesh axis {axis!r}; call parc.runtime.parallel.ops.bind_groups(ctx)")
    return _GROUPS[axis]


@contextmanager
def record():
    """Collect `(kind, axis, phase)` of every collective issued inside the block."""
    global _RECORD
    outer, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = outer


def _note(kind: str, axis: str, phase: str) -> None:
    if _RECORD is not None:
        _RECORD.append((kind, axis, phase))


# --- the collectives, on plain tensors ------------------------------------------------

def all_reduce(x: Tensor, axis: str, phase: str, op=dist.ReduceOp.SUM) -> Tensor:
    """A new tensor holding the reduction of `x` over the axis group."""
    _note("all_reduce", axis, phase)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=group(axis))
    return out


def all_gather(x: Tensor, dim: int, axis: str, phase: str) -> Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    return all_gather_start(x, dim, axis, phase)()


def all_gather_start(x: Tensor, dim: int, axis: str, phase: str):
    """`all_gather`, started: returns the call that waits for it and concatenates."""
    _note("all_gather", axis, phase)
    g = group(axis)
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(g))]
    work = dist.all_gather(parts, x.contiguous(), group=g, async_op=True)

    def finish() -> Tensor:
        work.wait()
        return torch.cat(parts, dim=dim)
    return finish


def reduce_scatter(x: Tensor, dim: int, axis: str, phase: str) -> Tensor:
    """Sum over ranks, then keep this rank's chunk along `dim`."""
    _note("reduce_scatter", axis, phase)
    g = group(axis)
    n, i = dist.get_world_size(g), dist.get_rank(g)
    if dist.get_backend(g) == "nccl":
        chunks = [c.contiguous() for c in x.chunk(n, dim)]
        out = torch.empty_like(chunks[i])
        dist.reduce_scatter(out, chunks, group=g)
        return out
    full = x.contiguous().clone()
    dist.all_reduce(full, group=g)
    return full.chunk(n, dim)[i].contiguous()


def split(x: Tensor, dim: int, axis: str) -> Tensor:
    """This rank's chunk of `x` along `dim` (no communication)."""
    g = group(axis)
    # a copy: a custom op's output may not alias its input
    return x.chunk(dist.get_world_size(g), dim)[dist.get_rank(g)].clone(memory_format=torch.contiguous_format)


# --- the backward collectives, as opaque ops ---------------------------------------------
#
# The autograd ops below call these from their backward formulas, which AOTAutograd traces under
# `compile`: a direct torch.distributed call there would run once, on fake tensors, at compile time.

ORDERED_EFFECTS: list[str] = []  # ops registered ORDERED; runtime/compiled.py refuses to compile without them


def mark_ordered(op) -> None:
    """Mark a communicating op as side-effecting: torch.compile neither reorders nor drops it.

    `CustomOpDef.register_effect` is torch 2.13's spelling; older torch (parc supports ≥ 2.11) has the
    private `_register_effectful_op`. Neither: the op stays unmarked, which eager mode does not need,
    and `compile` refuses to run (runtime/compiled.py) rather than risk reordered collectives."""
    try:
        from torch._higher_order_ops.effects import _EffectType
        if hasattr(op, "register_effect"):
            op.register_effect(_EffectType.ORDERED)
        else:
            from torch._higher_order_ops.effects import _register_effectful_op
            _register_effectful_op(op._opoverload, _EffectType.ORDERED)
    except (ImportError, AttributeError):
        return
    ORDERED_EFFECTS.append(op._qualname)


@eager.custom_op("parc::bwd_all_reduce")
def bwd_all_reduce(x: Tensor, axis: str) -> Tensor:
    """Backward's all-reduce (sum) of a gradient over `axis`."""
    return all_reduce(x, axis, "bwd")


bwd_all_reduce.register_fake(lambda x, axis: torch.empty_like(x, memory_format=torch.contiguous_format))


@eager.custom_op("parc::bwd_all_gather")
def bwd_all_gather(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """Backward's all-gather of a gradient along `dim` over `axis` (`parts` ranks)."""
    return all_gather(x, dim, axis, "bwd")


bwd_all_gather.register_fake(lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=True)))


@eager.custom_op("parc::bwd_reduce_scatter")
def bwd_reduce_scatter(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """Backward's reduce-scatter (sum) of a gradient along `dim` over `axis` (`parts` ranks)."""
    return reduce_scatter(x, dim, axis, "bwd")


bwd_reduce_scatter.register_fake(lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=False)))


@eager.custom_op("parc::bwd_split")
def bwd_split(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """This rank's chunk of a gradient along `dim` (no communication; opaque only for its rank)."""
    return split(x, dim, axis)


bwd_split.register_fake(lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=False)))
for _op in (bwd_all_reduce, bwd_all_gather, bwd_reduce_scatter):
    mark_ordered(_op)


# --- autograd-aware ops --------------------------------------------------------------

def _axis_ctx(ctx, inputs, output):
    ctx.args = inputs[1:]


@eager.custom_op("parc::identity_allreduce")
def identity_allreduce(x: Tensor, axis: str) -> Tensor:
    """Megatron's f. Forward: identity (a copy). Backward: all-reduce the gradient over `axis`."""
    return x.clone()


identity_allreduce.register_fake(lambda x, axis: torch.empty_like(x))
eager.register_autograd(identity_allreduce,
                        lambda ctx, g: (eager.call("parc::bwd_all_reduce", g, ctx.args[0]), None),
                        setup_context=_axis_ctx)


@eager.custom_op("parc::allreduce_identity")
def allreduce_identity(x: Tensor, axis: str) -> Tensor:
    """Megatron's g. Forward: all-reduce (sum) over `axis`. Backward: identity."""
    return all_reduce(x, axis, "fwd")


allreduce_identity.register_fake(lambda x, axis: torch.empty_like(x))
eager.register_autograd(allreduce_identity, lambda ctx, g: (g, None), setup_context=_axis_ctx)


def _chunked_shape(x: Tensor, dim: int, axis_size: int, grow: bool):
    shape = list(x.shape)
    shape[dim] = shape[dim] * axis_size if grow else shape[dim] // axis_size
    return shape


@eager.custom_op("parc::allgather_reducescatter")
def allgather_reducescatter(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """Sequence parallelism at a column layer's input. Forward: all-gather along `dim`.
    Backward: reduce-scatter along `dim`."""
    return all_gather(x, dim, axis, "fwd")


def _gather_ctx(ctx, inputs, output):
    _axis_ctx(ctx, inputs, output)
    # an eager forward gathers a slice its backward can gather again (runtime/parallel/sequence_regather.py)
    x, axis, dim, _ = inputs
    sequence_regather.note(ctx, x, output, lambda shard: all_gather_start(shard, dim, axis, "bwd"))


allgather_reducescatter.register_fake(
    lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=True)))
eager.register_autograd(
    allgather_reducescatter,
    lambda ctx, g: (eager.call("parc::bwd_reduce_scatter", g, *ctx.args), None, None, None), setup_context=_gather_ctx)


@eager.custom_op("parc::reducescatter_allgather")
def reducescatter_allgather(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """Sequence parallelism at a row layer's output. Forward: reduce-scatter (sum) along `dim`.
    Backward: all-gather along `dim`."""
    return reduce_scatter(x, dim, axis, "fwd")


reducescatter_allgather.register_fake(
    lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=False)))
eager.register_autograd(
    reducescatter_allgather,
    lambda ctx, g: (eager.call("parc::bwd_all_gather", g, *ctx.args), None, None, None), setup_context=_axis_ctx)


@eager.custom_op("parc::split_allgather")
def split_allgather(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """A replicated tensor entering a sequence-sharded region. Forward: keep this rank's chunk
    along `dim` (no communication). Backward: all-gather the gradient along `dim`, so the
    replicated side keeps a full gradient on every rank."""
    return split(x, dim, axis)


split_allgather.register_fake(lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=False)))
eager.register_autograd(
    split_allgather,
    lambda ctx, g: (eager.call("parc::bwd_all_gather", g, *ctx.args), None, None, None), setup_context=_axis_ctx)


@eager.custom_op("parc::vocab_parallel_cross_entropy")
def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, axis: str, vocab_start: int,
                                 ignore_index: int, reduction: int) -> tuple[Tensor, Tensor]:
    """Cross-entropy of logits sharded along the vocabulary; the full logits are never gathered.
    `reduction` as aten's: 1 the mean over targets not ignored, 2 their sum (context parallelism's
    per-rank share of a mean, passes/context_parallel.py, summed over cp and divided there).

    logits (N, V/tp) hold vocabulary ids [vocab_start, vocab_start + V/tp); target (N,) full ids.
    Forward: all-reduce MAX of the row maxima, then one all-reduce SUM of [sum-exp, target logit].
    Returns (loss, probs): probs (N, V/tp) is this rank's slice of the softmax, kept for backward.
    Backward: (probs − one-hot(target)) · grad / count on the local slice; no communication.
    """
    n_local = logits.shape[-1]
    x = logits.float()
    row_max = all_reduce(x.amax(dim=-1), axis, "fwd", op=dist.ReduceOp.MAX)  # (N,)
    exp = torch.exp(x - row_max.unsqueeze(-1))  # (N, V/tp)
    local_t, mine, valid = _targets(target, vocab_start, n_local, ignore_index)
    picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine  # (N,) target logit, 0 off this rank
    sums = all_reduce(torch.stack([exp.sum(dim=-1), picked]), axis, "fwd")  # (2, N): one collective for both
    sum_exp, target_logit = sums[0], sums[1]
    per_token = (torch.log(sum_exp) + row_max - target_logit) * valid  # (N,)
    loss = per_token.sum() / valid.sum().clamp(min=1) if reduction == 1 else per_token.sum()
    # the loss stays fp32 even for bf16 logits (precision bf16): autocast runs the serial cross_entropy in fp32
    return loss, (exp / sum_exp.unsqueeze(-1)).to(logits.dtype)


def _targets(target: Tensor, vocab_start: int, n_local: int, ignore_index: int):
    valid = (target != ignore_index).float()
    local = target - vocab_start
    mine = ((local >= 0) & (local < n_local)).float() * valid
    return local.clamp(0, n_local - 1), mine, valid


@vocab_parallel_cross_entropy.register_fake
def _(logits, target, axis, vocab_start, ignore_index, reduction):
    return logits.new_empty((), dtype=torch.float32), torch.empty_like(logits)


def _vpce_setup(ctx, inputs, output):
    logits, target, _, vocab_start, ignore_index, reduction = inputs
    ctx.save_for_backward(target, output[1])
    ctx.vocab_start, ctx.ignore_index, ctx.reduction = vocab_start, ignore_index, reduction


def _vpce_backward(ctx, grad_loss, grad_probs):
    target, probs = ctx.saved_tensors
    local_t, mine, valid = _targets(target, ctx.vocab_start, probs.shape[-1], ctx.ignore_index)
    grad = probs.clone()
    grad.scatter_add_(-1, local_t.unsqueeze(-1), -mine.unsqueeze(-1).to(grad.dtype))
    weight = valid / valid.sum().clamp(min=1) if ctx.reduction == 1 else valid  # d loss / d per_token
    grad = grad * (weight * grad_loss).unsqueeze(-1)
    return grad, None, None, None, None, None


eager.register_autograd(vocab_parallel_cross_entropy, _vpce_backward, setup_context=_vpce_setup)


# --- dropout ----------------------------------------------------------------------------
#
# Dropout needs no tp stream or generator bookkeeping: passes/dropout.py rewrites every dropout to
# `parc.keyed_dropout` / `parc.keyed_attention` (runtime/dropout.py), whose masks are a pure function
# of (seed, step, call site, global element index), the same on every plan and in the serial model.

# --- leaving a sequence-parallel region -----------------------------------------------------------

@eager.custom_op("parc::allgather_split")
def allgather_split(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """A sequence slice entering replicated computation (a head no rule shards, or an op parc cannot
    follow on a slice): Megatron's gather before the output layer. Forward: all-gather along `dim`.
    Backward: keep this rank's chunk of the gradient, which every tp rank computed in full and alike."""
    return all_gather(x, dim, axis, "fwd")


allgather_split.register_fake(lambda x, axis, dim, parts: x.new_empty(_chunked_shape(x, dim, parts, grow=True)))
eager.register_autograd(
    allgather_split,
    lambda ctx, g: (eager.call("parc::bwd_split", g, *ctx.args), None, None, None), setup_context=_axis_ctx)
for _op in (allreduce_identity, allgather_reducescatter, reducescatter_allgather, vocab_parallel_cross_entropy,
            allgather_split):
    mark_ordered(_op)


import parc.runtime.dropout  # noqa: E402 — registers torch.ops.parc.keyed_*; bind_groups gives it the cp rank
