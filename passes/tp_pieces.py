"""Per-head norms written as a split of the sharded heads dim, one norm module per head, and a cat
(StableLM's `qk_layernorm`: `cat([norm_h(x_h) for x_h in x.split(1, dim=1)], dim=1)`); used by
passes/tp_layouts.py's `_split`.

Start at `per_head_norms`. Each tp rank holds only its heads, so only its heads' norms can run there.
Erasing the other heads' norms would leave their parameters unused on that rank (no gradient, and
gradient buckets and ZeRO partitions cut differently on each tp rank). parc instead writes the same
program on every rank: the heads' weights (and biases) are stacked into one (heads, …) tensor, of
which each rank keeps its own heads' rows (`parc.split_allgather`: slice forward; backward
all-gathers the gradient, so every head's parameter gets its whole gradient on every rank, exact as
in the serial model: the rank that holds head h computes all of w_h's gradient, the others none of
it). The norm itself runs once on the local heads without its affine part, which is then applied
per head by broadcasting. The normalisation is the same arithmetic as the per-head modules', so the
values agree with the serial model to rounding.

Anything else that splits the sharded dim into pieces (other ops between split and cat, pieces of
more than one head, a cat along another dim) is refused by the caller, located.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from parc.passes.tp_contract import _insert
from parc.passes.tp_shard import Shard, shape

aten = torch.ops.aten
parc_ops = torch.ops.parc
NORMS = {aten.layer_norm.default: (2, 3, 4), aten.rms_norm.default: (2, None, 3)}  # weight, bias, eps args


def per_head_norms(lay, split: fx.Node, s: Shard) -> bool:
    """Rewrite split → one norm per piece → cat into one norm with stacked per-head parameters; return
    False (and change nothing) when the graph is not that pattern."""
    found = _match(split, s)
    if found is None or len(found[1]) % lay.tp:
        return False
    x, norms, cat = found
    first, n = norms[0], len(norms)
    full = shape(x)
    kind = first.target
    wi, bi, ei = NORMS[kind]
    normalized = list(first.args[1])
    y = _insert(lay, cat, kind, (x, normalized, None, *([None] if bi else []), *_eps(first, ei)), cat.meta["val"], s)
    for i in (wi, bi):
        if i is None or _param(first, i) is None:
            continue
        stacked = _insert(lay, cat, aten.stack.default, ([_param(m, i) for m in norms], 0),
                          torch.empty([n, *normalized], device="meta"), None)
        mine = _insert(lay, cat, parc_ops.split_allgather.default, (stacked, "tp", 0, lay.tp),
                       stacked.meta["val"], Shard(0, 1, False, s.rule))
        # (heads/tp, *normalized) → broadcast against x: 1 everywhere but the heads dim and the normalised dims
        sizes = [1] * len(full)
        sizes[s.dim] = n // lay.tp
        sizes[len(full) - len(normalized):] = normalized
        view = _insert(lay, cat, aten.view.default, (mine, sizes), torch.empty(
            [n if d == s.dim else k for d, k in enumerate(sizes)], device="meta"), s)
        y = _insert(lay, cat, aten.mul.Tensor if i == wi else aten.add.Tensor, (y, view), cat.meta["val"], s)
    cat.replace_all_uses_with(y)
    for dead in [cat, *norms, *list(split.users)]:
        lay.gm.graph.erase_node(dead)
    return True


def _match(split: fx.Node, s: Shard):
    """(x, the norms in piece order, the cat) when `split` cuts the sharded dim into one-head pieces, each
    read only by one norm over trailing dims whose only user is one cat along that dim, in order."""
    x = split.args[0]
    pieces = [tuple(v.shape)[s.dim] for v in split.meta["val"]]
    if split.target is not aten.split.Tensor or set(pieces) != {1}:
        return None
    gets = sorted(split.users, key=lambda g: g.args[1] if g.target is operator.getitem else -1)
    if [g.args[1] for g in gets if g.target is operator.getitem] != list(range(len(pieces))) or len(gets) != len(pieces):
        return None
    norms = []
    for g in gets:
        if len(g.users) != 1:
            return None
        (m,) = g.users
        if m.target not in NORMS or m.args[0] is not g or len(m.users) != 1:
            return None
        norms.append(m)
    (cat,) = norms[0].users
    ndim = len(shape(x))
    first = norms[0]
    same = all(m.target is first.target and list(m.args[1]) == list(first.args[1]) and
               _eps(m, NORMS[m.target][2]) == _eps(first, NORMS[m.target][2]) and
               all((_param(m, i) is None) == (_param(first, i) is None) for i in NORMS[m.target][:2] if i)
               for m in norms)
    if not same or s.dim >= ndim - len(first.args[1]):
        return None
    if cat.target is not aten.cat.default or list(cat.args[0]) != norms or \
            (cat.args[1] if len(cat.args) > 1 else 0) % ndim != s.dim:
        return None
    return x, norms, cat


def _param(m: fx.Node, i: int):
    a = m.args[i] if len(m.args) > i else None
    return a if isinstance(a, fx.Node) else None


def _eps(m: fx.Node, i: int) -> list:
    return [m.args[i]] if len(m.args) > i else []
