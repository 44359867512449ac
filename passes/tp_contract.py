"""Sharding rules for ops that contract or reduce dims, and for stacking and indexing (used by
passes/tp_layouts.py's dispatcher).

Start at `RULES`. Each rule gets the `Layouts` and the node, returns the node's layout, and may
insert a collective where one makes the op exact:

- a **reduction over the sharded dim** (sum, mean; a matmul contracting two operands sharded along
  the contracted dim) leaves each rank a *partial* value; Megatron's g (`parc.allreduce_identity`:
  all-reduce forward, identity backward) sums it, as Megatron sums a norm's statistics over a
  sharded hidden. A mean is the sum of the local means over tp, divided by tp.
- a **replicated operand meeting a sharded one** along a dim of the same extent keeps this rank's
  chunk (`parc.split_allgather`: slice forward, all-gather of the gradient backward), so the
  replicated side's gradient stays whole on every rank (`Layouts.localize`).
- batched matmuls (`matmul`, `bmm`, `mm`, `einsum`) follow a shard through the batch dims and the
  free row (n) and column (m) dims; the contracted dim k is the reduction case.
- `pad`, `cumsum`, `tril`, `triu` along dims other than the sharded one keep the shard.
- a **variance** (`var`, `std`) over the sharded dim is computed in two passes with two sums over
  tp (the mean, then the squared deviations), as the serial op does.

Gradients: passes/tp_grads.py completes every gradient after the walk, whatever these rules
produce; the collectives here carry their own backward.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.passes.tp_shard import Shard, shape

aten = torch.ops.aten
parc_ops = torch.ops.parc


def _insert(lay, node: fx.Node, op, args, val, layout, after: bool = False) -> fx.Node:
    """A new node computing `op(*args)` just before (or after) `node`, in its module, with traced value
    `val` and the given layout; recorded in `lay.made`, so a refused attempt can be undone."""
    with (lay.gm.graph.inserting_after(node) if after else lay.gm.graph.inserting_before(node)):
        n = lay.gm.graph.call_function(op, args)
    n.meta["val"], n.meta["nn_module_stack"] = val, node.meta.get("nn_module_stack")
    lay.made.append(n)
    lay.of[n] = layout
    return n


def _sum_over_tp(lay, node: fx.Node, scale: float | None = None):
    """Insert g after `node` (and a division by tp for a mean): the node's users get the full value."""
    users, val = list(node.users), node.meta["val"]
    out = _insert(lay, node, parc_ops.allreduce_identity.default, (node, "tp"), val, None, after=True)
    if scale is not None:
        out = _insert(lay, out, aten.div.Tensor, (out, scale), val, None, after=True)
    for u in users:
        u.replace_input_with(node, out)
    return "partial"


def reduction(lay, node: fx.Node):
    """sum / mean over dims: over unsharded dims the shard moves; over the sharded dim, a sum over tp."""
    s = lay.get(node.args[0])
    n = len(shape(node.args[0]))
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(n))
    dims = [d % n for d in ([dims] if isinstance(dims, int) else dims)]
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if s.dim not in dims:
        return s if keep else Shard(s.dim - sum(d < s.dim for d in dims), s.blocks, s.seq, s.rule)
    if node.target not in (aten.sum.dim_IntList, aten.mean.dim) or s.blocks != 1:  # amax, amin, logsumexp
        lay.fail(node, f"it reduces over dim {s.dim}, which is sharded across tp (parc sums only sum and mean "
                 "over tp)", s)
    if node.kwargs.get("dtype") is not None or (len(node.args) > 3 and node.args[3] is not None):
        lay.fail(node, f"it reduces over sharded dim {s.dim} with a dtype argument", s)
    return _sum_over_tp(lay, node, float(lay.tp) if node.target is aten.mean.dim else None)


def variance(lay, node: fx.Node):
    """var / std over dims. Over unsharded dims the shard moves. Over the sharded dim, in two passes as
    the serial op computes it (not E[x²] − E[x]², which loses digits): the mean from a sum over tp, then
    the squared deviations' sum over tp, divided by N − correction (N: the full count of reduced elements)."""
    x, s = node.args[0], lay.get(node.args[0])
    full = shape(x)
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(len(full)))
    dims = sorted(d % len(full) for d in ([dims] if isinstance(dims, int) else dims))
    if node.target in (aten.var.dim, aten.std.dim):
        correction = int(node.args[2] if len(node.args) > 2 else node.kwargs.get("unbiased", True))
        keep = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    else:
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction
        keep = node.kwargs.get("keepdim", False)
    if s.dim not in dims:
        return s if keep else Shard(s.dim - sum(d < s.dim for d in dims), s.blocks, s.seq, s.rule)
    if s.blocks != 1:
        lay.fail(node, f"a variance over a fused output of {s.blocks} blocks", s)
    count = 1
    for d in dims:
        count *= full[d]
    kept = [1 if d in dims else n for d, n in enumerate(full)]
    result = node.meta["val"]

    def make(op, args, layout, size):
        return _insert(lay, node, op, args, torch.empty(size, dtype=result.dtype, device="meta"), layout)

    local_sum = make(aten.sum.dim_IntList, (x, dims, True), "partial", kept)
    total = make(parc_ops.allreduce_identity.default, (local_sum, "tp"), None, kept)
    mean = make(aten.div.Tensor, (total, count), None, kept)
    dev = make(aten.sub.Tensor, (x, mean), s, full)
    sq = make(aten.sum.dim_IntList, (make(aten.mul.Tensor, (dev, dev), s, full), dims, keep), "partial",
              result.shape)
    out = make(aten.div.Tensor, (make(parc_ops.allreduce_identity.default, (sq, "tp"), None, result.shape),
                                 max(count - correction, 0)), None, result.shape)
    if node.target in (aten.std.dim, aten.std.correction):
        out = make(aten.sqrt.default, (out,), None, result.shape)
    node.replace_all_uses_with(out)
    return None


def einsum(lay, node: fx.Node):
    """`torch.einsum`: the sharded operands' sharded dims must carry one subscript. In the output it
    stays sharded there (replicated operands that have it keep this rank's chunk); summed over, each rank
    holds a partial sum, summed over tp by g."""
    eq, tensors = node.args[0].replace(" ", ""), list(node.args[1])
    subs = _einsum_subscripts(eq, [len(shape(t)) for t in tensors])
    if subs is None:
        lay.fail(node, f"an einsum equation parc cannot read: {eq!r}", next(lay.get(t) for t in tensors if lay.get(t)))
    ins, out = subs
    sharded = [(t, lay.get(t), sub) for t, sub in zip(tensors, ins) if lay.get(t) is not None]
    letters = {sub[s.dim] for _, s, sub in sharded}
    s = sharded[0][1]
    if len(letters) != 1 or any(x.blocks != 1 for _, x, _ in sharded) or len({x for _, x, _ in sharded}) != 1:
        lay.fail(node, f"einsum {eq!r} with operands sharded on different subscripts or layouts", s)
    (letter,) = letters
    for t, sub in zip(tensors, ins):
        if lay.get(t) is None and letter in sub and shape(t)[sub.index(letter)] != 1:
            lay.localize(node, t, sub.index(letter), s)
    if letter in out:
        return Shard(out.index(letter), 1, s.seq, s.rule)
    return _sum_over_tp(lay, node)


def _einsum_subscripts(eq: str, ranks: list[int]) -> tuple[list[str], str] | None:
    """Each operand's subscripts and the output's, one character per dim ('...' spelled out as its
    broadcast dims, right-aligned across operands as torch aligns them); None if malformed."""
    left, arrow, right = eq.partition("->")
    ins = left.split(",")
    if len(ins) != len(ranks):
        return None
    pool = [chr(0x3B1 + i) for i in range(24)]  # Greek letters: never an einsum subscript
    ell = max((r - (len(sub) - 3) for sub, r in zip(ins, ranks) if "..." in sub), default=0)
    spelled = []
    for sub, r in zip(ins, ranks):
        if "..." in sub:
            k = r - (len(sub) - 3)
            sub = sub.replace("...", "".join(pool[ell - k:ell]))
        if len(sub) != r:
            return None
        spelled.append(sub)
    if arrow:
        out = right.replace("...", "".join(pool[:ell]))
    else:  # implicit: the broadcast dims, then the subscripts seen once, in alphabetical order
        once = sorted(c for c in set("".join(ins)) if c.isalpha() and "".join(ins).count(c) == 1)
        out = "".join(pool[:ell]) + "".join(once)
    return spelled, out


def matmul(lay, node: fx.Node):
    """`a @ b` with a (..., n, k) and b (..., k, m) (1-D operands promoted as torch does)."""
    a, b = node.args[0], node.args[1]
    sa, sb = lay.get(a), lay.get(b)
    ra, rb, ro = len(shape(a)), len(shape(b)), len(shape(node))
    if ra < 2 or rb < 2:
        lay.fail(node, "a matmul with a 1-D operand on a sharded value", sa or sb)
    for s in (sa, sb):
        if s is not None and s.blocks != 1:
            lay.fail(node, f"a matmul on a fused output of {s.blocks} blocks before it is split", s)
    # each operand's sharded dim, as a role: ("batch", dim counted from the right), "n", "k", "m"
    role_a = _role(sa, ra, "n", "k")
    role_b = _role(sb, rb, "k", "m")
    if sa is not None and sb is not None:
        if role_a != role_b:
            lay.fail(node, f"its operands are sharded on different dims ({role_a} and {role_b})", sa)
        if role_a == "k":  # both sharded along the contracted dim: each rank holds a partial product
            return _sum_over_tp(lay, node)
        return Shard(ro - 1 - role_a[1], 1, sa.seq, sa.rule)  # the same batch dim of both
    s, role, other, r_other = (sa, role_a, b, rb) if sa is not None else (sb, role_b, a, ra)
    if role in ("n", "m"):  # a free dim: the other operand is used whole
        return Shard(ro - 2 if role == "n" else ro - 1, 1, s.seq, s.rule)
    if role == "k":  # the replicated operand keeps this rank's rows (or columns) of k; then sum
        lay.localize(node, other, r_other - 2 if other is b else r_other - 1, s)
        return _sum_over_tp(lay, node)
    back = role[1]  # a batch dim, counted from the right: the other operand broadcasts or is cut alike
    d = r_other - 1 - back
    if d >= 0 and shape(other)[d] != 1:
        lay.localize(node, other, d, s)
    return Shard(ro - 1 - back, 1, s.seq, s.rule)


def _role(s: Shard | None, rank: int, row: str, col: str):
    if s is None:
        return None
    if s.dim == rank - 1:
        return col
    if s.dim == rank - 2:
        return row
    return ("batch", rank - 1 - s.dim)


def max_min(lay, node: fx.Node):
    """max / min over one dim, with their indices: over an unsharded dim both move with the shard."""
    s = lay.get(node.args[0])
    n = len(shape(node.args[0]))
    dim = node.args[1] % n
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if dim == s.dim:
        lay.fail(node, f"it takes a max or min over dim {dim}, which is sharded across tp", s)
    out = s if keep else Shard(s.dim - (dim < s.dim), s.blocks, s.seq, s.rule)
    return [out, out]


def stack(lay, node: fx.Node):
    tensors = node.args[0]
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape(node))
    shards = {lay.get(a) for a in tensors}
    if len(shards) != 1 or None in shards:
        lay.fail(node, "it stacks tensors with different layouts", next(s for s in shards if s))
    (s,) = shards
    return Shard(s.dim + (dim <= s.dim), s.blocks, s.seq, s.rule)


def select(lay, node: fx.Node):
    s = lay.get(node.args[0])
    dim = node.args[1] % len(shape(node.args[0]))
    if dim == s.dim:
        lay.fail(node, f"it selects one index of dim {dim}, which is sharded across tp", s)
    return Shard(s.dim - (dim < s.dim), s.blocks, s.seq, s.rule)


def unbind(lay, node: fx.Node):
    s = lay.get(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape(node.args[0]))
    if dim == s.dim:
        lay.fail(node, f"it unbinds dim {dim}, which is sharded across tp", s)
    return [Shard(s.dim - (dim < s.dim), s.blocks, s.seq, s.rule)] * len(node.meta["val"])


def index_select(lay, node: fx.Node):
    """index_select / gather along a dim: fine along an unsharded dim when the index is not sharded."""
    s, idx = lay.get(node.args[0]), node.args[2]
    dim = node.args[1] % len(shape(node.args[0]))
    if s is None or lay.get(idx) is not None and node.target is aten.index_select.default:
        lay.fail(node, "a sharded index", s or lay.get(idx))
    if dim == s.dim:
        lay.fail(node, f"it indexes along dim {dim}, which is sharded across tp", s)
    if node.target is aten.gather.default and lay.get(idx) != s:
        if lay.get(idx) is not None:
            lay.fail(node, "gather's index is sharded unlike its input", s)
        if shape(idx)[s.dim] != 1:  # the index's rows along the sharded dim: this rank's chunk
            lay.localize(node, idx, s.dim, s)
    return s


def along_other_dims(lay, node: fx.Node):
    """Ops that work along some dims and leave every other dim alone: `pad` / `constant_pad_nd` (the dims
    their pad pairs name, counted from the last), `cumsum` (its dim), `tril` / `triu` (the last two dims).
    Fine when the sharded dim is not one of them: each slice along it is computed as in the serial op."""
    s = lay.get(node.args[0])
    n = len(shape(node.args[0]))
    if node.target in (aten.pad.default, aten.constant_pad_nd.default):
        amounts = list(node.args[1])
        touched = {n - 1 - i // 2 for i, k in enumerate(amounts) if k != 0}
    elif node.target is aten.cumsum.default:
        touched = {node.args[1] % n}
    else:
        touched = {n - 2, n - 1}
    if s.dim in touched:
        lay.fail(node, f"it works along dim {s.dim}, which is sharded across tp", s)
    return s


RULES = {aten.pad.default: along_other_dims, aten.constant_pad_nd.default: along_other_dims,
         aten.cumsum.default: along_other_dims, aten.tril.default: along_other_dims,
         aten.triu.default: along_other_dims, aten.matmul.default: matmul, aten.bmm.default: matmul, aten.mm.default: matmul,
         aten.sum.dim_IntList: reduction, aten.mean.dim: reduction, aten.amax.default: reduction,
         aten.amin.default: reduction, aten.logsumexp.default: reduction, aten.max.dim: max_min,
         aten.min.dim: max_min, aten.stack.default: stack, aten.select.int: select,
         aten.unbind.int: unbind, aten.index_select.default: index_select, aten.gather.default: index_select,
         aten.var.dim: variance, aten.var.correction: variance, aten.std.dim: variance,
         aten.std.correction: variance, aten.einsum.default: einsum}
