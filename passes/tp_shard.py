"""The layout of a tensor-parallel value, and small facts about graph nodes (passes/tp_layouts.py
and passes/tp_contract.py use them; passes/tensor_parallel.py starts the walk)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclass(frozen=True)
class Shard:
    """Chunk `tp_rank` of each of `blocks` equal blocks along `dim` (dims counted from 0).

    `parts` > 0 (a kv subset, passes/tp_gqa.py) cuts the dim into `parts` < tp chunks instead: tp rank r
    holds chunk r // (tp / parts), the same one as the other tp / parts ranks of its group (Megatron's
    grouped-query attention with fewer kv heads than tp: each rank holds the kv head its q heads use)."""

    dim: int
    blocks: int = 1
    seq: bool = False  # a sequence-parallel slice (of the token dim), not a slice of features/heads
    rule: object = field(default=None, compare=False)  # the plan rule it came from, for error spans
    parts: int = 0  # 0: tp chunks, one per rank; else a kv subset's chunks, each held by tp / parts ranks


# ops whose output is laid out like their (first) input
SAME_LAYOUT = {aten.dropout.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
               aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
               aten.to.other, aten.lift_fresh_copy.default}
# reshapes that carry every output size (their size constants are made local)
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# a new tensor shaped like the input
LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default}

# ops that read the argument at this index only for its dtype or shape: no value, no gradient flows
SHAPE_ONLY = {aten.type_as.default: 1, aten.view_as.default: 1, aten._assert_tensor_metadata.default: 0}


def reads_only_meta(u: fx.Node, a: fx.Node) -> bool:
    """Does op `u` read `a` only for its dtype or shape (`x.type_as(a)`), not for its values?"""
    i = SHAPE_ONLY.get(u.target)
    return i is not None and len(u.args) > i and u.args[i] is a and a not in u.args[:i]


def slice_bounds(u: fx.Node) -> tuple[int, int, int, object]:
    """(dim, lo, hi, step) of an `aten.slice` node, the bounds as Python reads them (negative from the
    end, clamped to the dim's size); lo or hi stay as given when they are not ints (a symbolic size)."""
    x = u.args[0]
    dim = (u.args[1] if len(u.args) > 1 else 0) % len(shape(x))
    n = shape(x)[dim]
    lo, hi, step = (list(u.args[2:5]) + [None, None, 1][len(u.args[2:5]):])[:3]

    def clamp(i):
        return max(0, min(i + n if i < 0 else i, n)) if isinstance(i, int) else i

    return dim, clamp(0 if lo is None else lo), clamp(n if hi is None else hi), step


def shape(n) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def is_param(n) -> bool:
    """A parameter placeholder of the traced graph (torch.export names them `p_<fqn>`)."""
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name.startswith("p_")


def dim_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of shape a and shape b with equal products (how a reshape regroups dims)."""
    out, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj = [], []
        pa = pb = 1
        if i < len(a):
            gi.append(i); pa = a[i]; i += 1  # noqa: E702
        if j < len(b):
            gj.append(j); pb = b[j]; j += 1  # noqa: E702
        while pa != pb:
            if pa < pb and i < len(a):
                gi.append(i); pa *= a[i]; i += 1  # noqa: E702
            elif j < len(b):
                gj.append(j); pb *= b[j]; j += 1  # noqa: E702
            else:
                break
        out.append((gi, gj))
    return out
