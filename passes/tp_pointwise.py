"""A user's op tagged `torch.Tag.pointwise`, checked before the tp pass cuts its input.

Start at `check`. The tag is the op author's word that each output element depends on the input
element at the same index only, forward and backward; the tp pass relies on it to run the op on
each rank's chunk (passes/tp_layouts.py `_pointwise`). A wrong tag (a normalisation over the last
dim, a cumulative sum, a backward that mixes elements) would train silently wrong under tp. So,
where the op has a CPU kernel, parc checks the promise on the very cut it is about to make: random
inputs of the traced shapes, the op on the whole tensor against the op on each of the tp chunks
along the sharded dim, forward and, when the op has autograd, backward (a random output gradient).
A mismatch is refused at the plan's rule. An op with no CPU kernel (a CUDA-only kernel) cannot be
run here: its tag is trusted, as before, and docs/model-convention.md says so.

Assumes: node.meta["val"] holds the traced (whole) shapes; the inputs whose layout is sharded, and
the replicated ones `_pointwise` cuts to match (same dim, not broadcast), are cut alike.
Guarantees: the graph is not changed; the check runs on CPU in the traced dtype, outside any fake mode, and costs one op call per chunk.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from parc.passes.tp_shard import Shard, shape

_OWN = ("aten", "prims", "parc")  # ops whose pointwise tag torch (or parc) stands behind


def needs_check(node: fx.Node) -> bool:
    """A user's op (not aten's) that reaches the tp pass through its pointwise tag."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace not in _OWN and torch.Tag.pointwise in t.tags


def check(node: fx.Node, s: Shard, tp: int, sharded: set[fx.Node]) -> str | None:
    """Why the op is not elementwise along `s.dim` when cut in `tp` chunks, or None (also when it has no CPU
    kernel to run)."""
    out_rank = len(shape(node))
    g = torch.Generator().manual_seed(0)
    whole, cut_dims = [], {}
    for a in node.args:
        if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            val = a.meta["val"]
            t = torch.randn(val.shape, generator=g).to(val.dtype) if val.dtype.is_floating_point else \
                torch.randint(0, 3, val.shape, generator=g).to(val.dtype)
            d = s.dim - (out_rank - t.dim())
            if a in sharded or (d >= 0 and t.shape[d] != 1):
                cut_dims[len(whole)] = d
            whole.append(t)
        else:
            whole.append(a)
    with unset_fake_temporarily():
        return _compare(node.target, whole, cut_dims, s.dim, tp, g)


def _compare(op, whole: list, cut_dims: dict[int, int], dim: int, tp: int, g: torch.Generator) -> str | None:
    leaves = [i for i, t in enumerate(whole) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    ins = [t.requires_grad_() if i in leaves else t for i, t in enumerate(whole)]
    try:
        out = op(*ins)
    except NotImplementedError:
        return None  # no CPU kernel (a CUDA-only op): it cannot run here, and its tag is trusted
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = _grads(out, grad_out, [ins[i] for i in leaves])
    for k in range(tp):
        part = [t.detach().chunk(tp, cut_dims[i])[k].requires_grad_(i in leaves) if i in cut_dims else
                (t.detach().requires_grad_() if i in leaves else t) for i, t in enumerate(ins)]
        try:
            part_out = op(*part)
        except RuntimeError as e:  # runs on the whole tensor, not on a shard of it: not elementwise
            return f"it fails on chunk {k} of {tp} along dim {dim} ({str(e).splitlines()[0]})"
        if not _close(part_out, out.detach().chunk(tp, dim)[k]):
            return f"its forward on chunk {k} of {tp} along dim {dim} differs from the same chunk of its output"
        if grads is None:
            continue
        part_grads = _grads(part_out, grad_out.chunk(tp, dim)[k], [part[i] for i in leaves])
        for i, gw, gp in zip(leaves, grads, part_grads):
            expect = gw.chunk(tp, cut_dims[i])[k] if i in cut_dims else None
            if expect is not None and not _close(gp, expect):
                return f"its backward on chunk {k} of {tp} along dim {dim} differs from the same chunk of its gradient"
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to rounding: an elementwise kernel on a chunk computes the same numbers (vectorised tails
    may round differently); a wrong tag moves values by their own size."""
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 1e-2
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _grads(out: torch.Tensor, grad_out: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """d(out · grad_out)/d(leaves); None when the op has no backward to check (no autograd, or nothing needs it)."""
    if not leaves or not out.requires_grad:
        return None
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return [gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads, leaves)]
