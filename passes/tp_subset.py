"""Values held as a kv subset: grouped-query attention with fewer kv heads than tp, Megatron's way (used by
passes/tp_layouts.py's dispatcher; the subset is made by passes/tensor_parallel.py `kv_subset`).

Start at `propagate`. With K kv heads, tp T a multiple of K and H q heads, tp rank r holds q heads
[r·H/T, (r+1)·H/T), which all map to kv head c = r // (T/K). So the k and v projections run only that
head's rows of their weights on rank r: the weight is stored whole (replicated), each rank takes its head's
rows (a `slice`), and the output is a `Shard(dim, parts=K)`: K chunks along the features, chunk c on the T/K
ranks of its group. This module follows such a value through the ops between the projection and attention
(the view into heads, transposes, RoPE's elementwise arithmetic and its half-rotation, a per-head k norm,
the repeat to q's heads), making their size constants local to one chunk of K, not of T.

Where the subset meets q's heads (attention, the scores' matmul, any op with a whole tp shard), the subset
is *refined*: after the repeat each kv chunk holds the H/K q-head positions of its group, of which rank r
keeps its own H/T (a local `slice` at offset (r mod T/K)·H/T). Under `enable_gqa` attention takes the one
kv head as it is (tp_layouts `_sdpa`).

Gradients: the refining slice gives rank r only its q heads' share of its kv head's gradient, and the weight
slice carries that share into the rows of that head. The weight, a replicated parameter whose only use is
an op with a sharded output, therefore has a Partial gradient, which passes/tp_grads.py sums over tp once a
step (`tp_partial_grads`): for the rows of head c the sum is over the T/K ranks of c's group, each
contributing its own q heads (the other ranks add zeros), which is the serial gradient; the projection's
input gets Megatron's f like a column layer's, summing the input gradient the same way. A per-head k norm's
weight meets the subset and q alike: also Partial, summed the same way. No activation gradient is gathered.

Anything else a subset reaches (a reduction or norm over its heads, a concatenation along them, a replicated
operand of the heads' extent, dropout, an op parc has no rule for) is refused, located, with the hint to
mark the k and v projections `replicate` (the layer then runs whole on every rank: passes/tp_gqa.py).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from parc.passes.tp_shard import LIKE, SAME_LAYOUT, VIEWS, Shard, shape

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
# ops a subset is followed through as the ops of a whole tp shard are (passes/tp_layouts.py), with a subset's
# chunk count in place of tp; reductions and norms only over other dims (checked in `_along`)
MOVES = VIEWS | SAME_LAYOUT | LIKE | {
    aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default, aten.type_as.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.expand.default, aten.slice.Tensor,
    aten.cat.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
    aten.view_as_complex.default, aten.view_as_real.default, aten._assert_tensor_metadata.default,
    aten.repeat_interleave.self_int,
    aten.softmax.int, aten._softmax.default}
CUTS = {aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2, aten.cat.default: 1,
        aten.slice.Tensor: 1}  # where each takes its dim
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.dim,
              aten.var.correction, aten.std.dim, aten.std.correction}
NORMS = {aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default}
HINT = "mark the k and v projections `replicate` (each rank then computes every kv head: exact, more compute)"


def is_subset(layout) -> bool:
    return isinstance(layout, Shard) and layout.parts > 0


def propagate(lay, node: fx.Node, ins: list[fx.Node]):
    """The layout of `node`, some of whose inputs are kv subsets: refined where they meet whole tp shards,
    else followed through the ops of `MOVES` (and reductions or norms over other dims) as a subset."""
    subs = [a for a in ins if is_subset(lay.get(a))]
    whole = [a for a in ins if isinstance(lay.get(a), Shard) and not lay.get(a).parts]
    gqa = node.target is SDPA and node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
    if whole and not gqa:
        ref = whole[0]
        for a in dict.fromkeys(subs):
            node.replace_input_with(a, refine(lay, node, a, ref))
        return lay._dispatch(node)
    if whole:
        return lay.follow(node, ins)  # `enable_gqa`: tp_layouts `_sdpa` takes the one kv head as it is
    kinds = {lay.get(a) for a in subs}
    s = lay.get(subs[0])
    if len(kinds) > 1:
        lay.fail(node, f"its inputs are kv subsets cut differently: {sorted(map(repr, kinds))}", s, HINT)
    t = node.target
    pointwise = isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags \
        and getattr(t, "namespace", None) in ("aten", "prims")
    if t in REDUCTIONS or t in NORMS:
        _along(lay, node, s)
    elif not (pointwise or t in MOVES):
        lay.fail(node, f"a kv subset ({s.parts} chunks of dim {s.dim} over tp {lay.tp}: fewer kv heads than tp) "
                 "reaches an op parc follows only on whole tp shards", s, HINT)
    if t in CUTS:
        at = CUTS[t]
        dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
        if isinstance(dim, int) and dim % len(shape(node if t is aten.cat.default else node.args[0])) == s.dim:
            lay.fail(node, f"it cuts or joins dim {s.dim}, along which tp ranks hold a kv subset", s, HINT)
    return _retag(lay, node, lay.follow(node, ins), s)


def refine(lay, node: fx.Node, a: fx.Node, ref: fx.Node) -> fx.Node:
    """Subset value `a`, beside `ref` sharded in tp chunks on the same dim and extent (counted from the
    right), narrowed to this rank's tp chunk: a local slice of its kv chunk, at (rank mod tp/parts) · n/tp."""
    s, r = lay.get(a), lay.get(ref)
    n = shape(a)[s.dim]
    same = len(shape(a)) - s.dim == len(shape(ref)) - r.dim and n == shape(ref)[r.dim] and r.blocks == 1 \
        and s.blocks == 1 and s.seq == r.seq
    if not same or n % lay.tp:
        lay.fail(node, f"a kv subset `{a.name}` {shape(a)} (chunks of dim {s.dim}) meets `{ref.name}` {shape(ref)}, "
                 f"sharded on dim {r.dim}: parc narrows a kv subset to this rank's heads only along the same dim "
                 "and extent", s, HINT)
    width = n // lay.tp
    at = (lay.tp_rank % (lay.tp // s.parts)) * width  # this rank's heads within its group's kv chunk
    with lay.gm.graph.inserting_before(node):
        cut = lay.gm.graph.call_function(aten.slice.Tensor, (a, s.dim, at, at + width))
    lay.made.append(cut)
    cut.meta["val"] = a.meta["val"]  # the traced (full) shape, as every value's before local shapes
    cut.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
    lay.of[cut] = Shard(s.dim, 1, s.seq, s.rule)
    return cut


def _along(lay, node: fx.Node, s: Shard) -> None:
    """A reduction or norm must leave the subset's dim alone: over it, a sum over tp would add each kv head
    tp/parts times (and miss the other heads)."""
    n = len(shape(node.args[0]))
    if node.target in NORMS:
        dims = set(range(n - len(node.args[1]), n))
    else:
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
        dims = {d % n for d in ([dims] if isinstance(dims, int) else dims)}
    if s.dim in dims:
        lay.fail(node, f"it reduces over dim {s.dim}, along which tp ranks hold a kv subset", s, HINT)


def _retag(lay, node: fx.Node, out, s: Shard):
    """A rule's result, its shards marked as `s.parts` chunks (rules build tp shards); any other layout (a
    partial sum, rows) would be a tp one, and is refused."""
    if isinstance(out, list):
        return [_retag(lay, node, o, s) for o in out]
    if out is not None and not isinstance(out, Shard):
        lay.fail(node, f"its rule makes a {type(out).__name__} layout from a kv subset", s, HINT)
    return dataclasses.replace(out, parts=s.parts) if isinstance(out, Shard) else out
