"""A sharded dim merged under outer dims, as rows (used by passes/tp_layouts.py's `_view`).

Start at `merge`. Qwen3-Next's and Qwen3.5's gated RMSNorm flattens head-sharded values
(B, T, H, d) into rows, `x.reshape(-1, d)` (B·T·H, d), normalizes each row, and reshapes back to
(B, T, H·d) before the row-parallel output layer. On a tp rank the local (B, T, H/tp, d) flattens to
B·T·H/tp rows: not a contiguous chunk of the global rows (a `Shard`) but every (b, t) with this
rank's heads. `Rows(dim, outer, n)` names that layout: dim `dim` is the merge of `outer` leading
positions and a sharded dim of global size n, innermost.

Only what is exact on such rows is followed: ops that compute each row alone (elementwise ops with
replicated operands broadcast along the rows, casts, reductions and norms over the other dims),
and the reshape that splits the rows back into the same `outer` positions, after which the sharded
dim is a plain `Shard` again (chunk `tp_rank` of n, times the dims merged after it). Anything else
on rows (an op mixing rows, a replicated operand with one value per row, a random op) is refused,
located. Gradients: rows are a sharded layout (passes/tp_grads.py `sharded`), so a replicated
parameter used on them (the norm's weight) gets its Partial gradient summed over tp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from parc.passes.tp_shard import LIKE, SAME_LAYOUT, VIEWS, Shard, dim_groups, shape

aten = torch.ops.aten
ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim}


@dataclass(frozen=True)
class Rows:
    """Dim `dim` holds `outer` × n/tp positions: for each of the `outer` leading positions, this rank's
    chunk of a sharded dim of global size n (module docstring)."""

    dim: int
    outer: int
    n: int
    rule: object = field(default=None, compare=False)
    seq: bool = False  # never a sequence slice; here for code that reads `.seq` of any layout


def merge(lay, node: fx.Node, s: Shard, gi: list[int], go: list[int]) -> Rows | None:
    """The layout of a reshape merging sharded dim s.dim, innermost, under outer dims gi[:-1] into one dim."""
    a = shape(node.args[0])
    if s.blocks != 1 or s.seq or gi[-1] != s.dim or len(go) != 1 or node.target not in (
            aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    outer = 1
    for k in gi[:-1]:
        outer *= a[k]
    sizes = list(node.args[1])
    if sizes[go[0]] != -1:
        sizes[go[0]] //= lay.tp
        node.args = (node.args[0], sizes, *node.args[2:])
    return Rows(go[0], outer, a[s.dim], s.rule)


def propagate(lay, node: fx.Node):
    """The layout of an op with an input laid out as rows, or a refusal."""
    t, r = node.target, next(lay.get(a) for a in node.all_input_nodes if isinstance(lay.get(a), Rows))
    if t is aten._assert_tensor_metadata.default:
        if node.kwargs.get("size") is not None or len(node.args) > 1:
            lay.fail(node, "it asserts a full shape on rows of a sharded value", r)
        return None
    if t in SAME_LAYOUT or t in LIKE or t is aten.type_as.default or (
            isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
        if t in (aten.dropout.default,) or (isinstance(t, torch._ops.OpOverload)
                                            and torch.Tag.nondeterministic_seeded in t.tags):
            lay.fail(node, "a random op on rows of a sharded value", r)
        return _rowwise(lay, node, r)
    if t in ROW_REDUCTIONS:
        return _reduce(lay, node, r)
    if t in (aten.layer_norm.default, aten.rms_norm.default):
        n = len(shape(node.args[0]))
        if r.dim >= n - len(node.args[1]) or any(isinstance(lay.get(a), (Rows, Shard)) for a in node.args[2:4]):
            lay.fail(node, "a norm over rows of a sharded value", r)
        return r
    if t in VIEWS:
        return _split_back(lay, node, r)
    lay.fail(node, f"rows merged from a sharded dim under outer dims ({r.outer} × {r.n}) are followed only "
              "through row-wise ops and the reshape that splits them back; parc has no rule for this op here", r)


def _rowwise(lay, node: fx.Node, r: Rows):
    out = len(shape(node)) if isinstance(node.meta.get("val"), torch.Tensor) else 0
    for a in node.all_input_nodes:
        s = lay.get(a)
        if s is None:
            d = r.dim - (out - len(shape(a)))
            if d >= 0 and shape(a)[d] != 1:
                lay.fail(node, f"replicated `{a.name}` {shape(a)} has one value per row of rows of a sharded value", r)
        elif s != r:
            lay.fail(node, f"its inputs are laid out differently: {s} and {r}", r)
    return r


def _reduce(lay, node: fx.Node, r: Rows):
    n = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
    dims = [d % n for d in ([dims] if isinstance(dims, int) else dims)]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if r.dim in dims:
        lay.fail(node, "a reduction over rows of a sharded value", r)
    return r if keep else Rows(r.dim - sum(d < r.dim for d in dims), r.outer, r.n, r.rule)


def _split_back(lay, node: fx.Node, r: Rows):
    """A reshape that splits the rows into dims whose leading product is `outer` and whose next dim starts
    with the sharded n (times dims merged after it): that dim is `Shard`ed again, its size made local."""
    a, b = shape(node.args[0]), shape(node)
    for gi, go in dim_groups(a, b):
        if r.dim not in gi:
            continue
        if gi[0] != r.dim:
            break
        lead, j = 1, 0
        while j < len(go) and lead < r.outer:
            lead *= b[go[j]]
            j += 1
        if lead != r.outer or j == len(go) or b[go[j]] % r.n:
            break
        o = go[j]
        sizes = list(node.args[1])
        if sizes[o] != -1:
            sizes[o] //= lay.tp
            node.args = (node.args[0], sizes, *node.args[2:])
        return Shard(o, 1, False, r.rule)
    lay.fail(node, f"it reshapes rows merged from a sharded dim ({r.outer} × {r.n}) other than back into "
              f"{r.outer} leading positions", r)
