"""Context parallelism (mesh cp > 1): the sequence of every sample split over the cp ranks.

Start at `run`. The pass walks the traced loss graph once, in order, and gives every value a sequence
layout: replicated (None), or `Seq(dim, merged)`: dimension `dim` holds the sequence, with `merged` outer
elements folded into it (a `(B, T)` → `B·T` reshape gives `Seq(0, B)`), this rank's 2·c = T / cp tokens
of it in the load-balanced order (runtime/parallel/ring_attention.py: chunks r and 2·cp−1−r). It changes:

- each batch input whose dim 1 is the sequence (length T, the attentions' length) enters through
  `parc.cp_shard`: the program takes the whole micro-batch and keeps this rank's chunks;
- `arange(T)` (the serial model's positions) becomes `parc.cp_positions`: the global positions of this
  rank's tokens, so learned position embeddings and anything computed from positions see them;
- each `scaled_dot_product_attention` becomes `parc.ring_attention` (K/V blocks around the cp ring,
  exact log-sum-exp merging, causal masks from global positions), or with `context_parallel alltoall`
  `parc.ulysses_attention` (runtime/parallel/ulysses.py: heads scattered, sequence gathered, whole SDPA);
- an SDPA `attn_mask` computed from no input (HF's causal mask from `arange` positions) is evaluated here
  on the serial graph first; exactly causal, it becomes `is_causal=True` (all-keep: no mask) and its ops go
  (`_fold_constant_masks`); `enable_gqa` with fewer kv heads repeats each kv head before the ring;
- view / reshape / expand sizes along the sequence become local;
- a reduction over the sequence (the loss: `cross_entropy` mean, `mean`, `sum`) becomes this rank's sum
  divided by the whole micro-batch's count (`token_count`: on the whole targets input where it can, with
  no communication): this rank's share of the serial loss (`Share`), exact under uneven `ignore_index`
  masks. Ops linear in a share keep it one; any other use sums it over cp first with `parc.cp_sum`
  (all-reduce forward, identity backward). A share reaching the output stays one: the runtime sums the
  ranks' losses over cp when it reads them (plan.json `context_parallel.loss_share`), outside the forward.

Every other op a sequence-sharded value reaches must be one the pass knows is local along the sequence
(pointwise, linear, layer norm, reductions / cat / slices along other dims, embedding lookups, views that
keep the sequence a dimension, softmax along another dim, dropout: its sequence dim is marked in
`meta["parc_cp"]` for passes/dropout.py, which keys each token's mask by its global position); anything else
— an unfused attention (`q @ kᵀ`), a mask or bias built with the sequence's length, slicing along the
sequence — is refused at its line in the model file, the op and the module named, all such errors at once.
Attention dropout (SDPA's `dropout_p`) goes to the ring / all-to-all op as its `p`, the serial probabilities'
shape in `meta["parc_attention_full"]`; passes/dropout.py keys it. Tensor parallelism runs after this pass, on
the cp-local program (passes/tp_layouts.py `_cp_attention` shards the ring's heads).

Assumes: the graph is `parc.trace`'s (state placeholders, then inputs; output `(loss,)`) with full
shapes in `meta["val"]`; parc/analysis/cp_support.py has refused every feature cp does not compose with.
Guarantees: the program computes, on every cp rank, the serial micro-batch's loss, or with `loss_share`
this rank's share of it (the cp ranks' shares sum to it); its parameter gradients, summed over cp, are the
serial micro-batch's; `meta["val"]` holds local shapes (re-propagated:
a wrong rewrite fails at compile time); `ctx.notes["context_parallel"]` records what was rewritten.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import parc.runtime.parallel.ring_attention  # noqa: F401 — registers torch.ops.parc.cp_* and ring_attention
import parc.runtime.parallel.ulysses  # noqa: F401 — registers torch.ops.parc.ulysses_attention
from parc.errors import Diagnostic, ParcError, Span
from parc.passes.tp_shared import _PARC, _TORCH
from parc.trace_sizes import refuse_resharding
from parc.traced import ancestors, module_path

NAME = "context_parallel"
AXIS = "cp"
aten = torch.ops.aten
parc_ops = torch.ops.parc

# ops whose output keeps the layout of their tensor operands, broadcast from the right
POINTWISE = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.rsqrt.default,
    aten.sqrt.default, aten.exp.default, aten.tanh.default, aten.sigmoid.default, aten.gelu.default,
    aten.relu.default, aten.silu.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
    aten.detach.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default,
    aten.dropout.default, aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
    aten._log_softmax.default, aten.cos.default, aten.sin.default,
    # comparisons and selection, elementwise (a loss's mask of the targets: `where(t < 32, -100, t)`)
    *(getattr(aten, op).Scalar for op in ("eq", "ne", "lt", "le", "gt", "ge")),
    *(getattr(aten, op).Tensor for op in ("eq", "ne", "lt", "le", "gt", "ge")),
    aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther,
}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int}
NORMS = {aten.layer_norm.default, *((aten.rms_norm.default,) if hasattr(aten, "rms_norm") else ())}
SDPA = aten.scaled_dot_product_attention.default
# reductions along a dim list that keep the others: local when the sequence is not reduced
DIM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
ASSERT_META = aten._assert_tensor_metadata.default
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class Seq:
    """Dimension `dim` holds the sequence, with `merged` outer elements folded in before it."""

    dim: int
    merged: int = 1


@dataclass(frozen=True)
class Share:
    """A value of which each cp rank holds a share: summed over the cp ranks, it is the serial value (a loss
    reduced over this rank's tokens). Ops linear in it keep it a share; any other use sums it over cp first
    (`parc.cp_sum`). A share reaching the output is left to the runtime to sum (`Trainer.global_losses`),
    so no rank waits for the others in the forward for a value only the log reads."""


SHARE = Share()
# ops linear in their share operands (the others replicated): the result is a share of the serial result
SHARE_SCALED = {aten.div.Tensor, aten.div.Scalar, aten.mul.Scalar}  # share ∘ replicated, share first
SHARE_KEPT = {aten.neg.default, aten.clone.default, aten.alias.default, aten.detach.default}
SHARE_SUMMED = {aten.add.Tensor, aten.sub.Tensor}  # share ± share
# ops through which the targets are the batch input's own values (`_whole_input`)
SAME_VALUES = VIEWS | {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default}


class _Refused(Exception):
    """One located refusal; `run` collects them and raises every one at once."""


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    cp = plan.mesh.cp
    if cp == 1:
        return gm
    refuse_resharding(gm, "context parallelism", plan.context_parallel.span or plan.mesh.span)  # `_propagate`
    folded = _fold_constant_masks(gm)
    walk = _Walk(gm, plan, ctx, cp)
    walk.masks = folded
    walk.run()
    if walk.errors:
        raise ParcError(diagnostics=walk.errors)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _propagate(gm)
    ctx.notes[NAME] = walk.summary()
    return gm


class _Walk:
    def __init__(self, gm: fx.GraphModule, plan, ctx, cp: int):
        self.gm, self.plan, self.ctx, self.cp = gm, plan, ctx, cp
        self.method = plan.context_parallel.method
        self.errors: list[Diagnostic] = []
        self.seen: set = set()
        self.lay: dict[fx.Node, Seq | tuple | None] = {}
        self.sharded_inputs: list[str] = []
        self.attentions = 0
        self.positions = 0
        self.masks = 0  # attention masks folded into is_causal (`_fold_constant_masks`)
        self.loss_share = False  # the output is this rank's share of the loss (`Share`)
        self.counted = {"whole": 0, "summed": 0}  # how each mean's count of targets was made (`token_count`)
        self.seq_len = self._sequence_length()
        self.local = self.seq_len // cp if self.seq_len else 0

    # --- the walk ------------------------------------------------------------------------------

    def run(self) -> None:
        if not self.seq_len:
            return
        for node in list(self.gm.graph.nodes):
            try:
                self.lay[node] = self.visit(node)
            except _Refused as e:
                self.refuse_at(node, str(e))
                self.lay[node] = None

    def visit(self, node: fx.Node):
        if node.op == "placeholder":
            return self.placeholder(node)
        if node.op == "output":
            (result,) = node.args
            lays = [self.lay.get(a) for a in result if isinstance(a, fx.Node)]
            if any(isinstance(lay, Seq) for lay in lays):
                raise _Refused("the loss is still split along the sequence: parc cannot tell what sums it over cp")
            self.loss_share = any(lay == SHARE for lay in lays)
            return None
        if node.op != "call_function":
            return None
        if node.target is aten.arange.default or node.target is aten.arange.start:
            return self.arange(node)
        if any(self.lay.get(a) == SHARE for a in node.all_input_nodes):
            if self.keeps_share(node):
                return SHARE
            self.sum_shares(node)
        ins = [a for a in node.all_input_nodes if self.lay.get(a) is not None]
        if not ins:
            return None  # nothing split along the sequence reaches it: it runs whole on every cp rank
        t = node.target
        if t is operator.getitem:
            parent = self.lay[node.args[0]]
            return parent[node.args[1]] if isinstance(parent, tuple) else None
        if t in POINTWISE:
            return self.pointwise(node)
        if t is aten.embedding.default:
            return self.only_operand(node, 1, "the table")
        if t is aten.linear.default:
            return self.linear(node)
        if t in NORMS:
            return self.norm(node)
        if t in VIEWS:
            return self.view(node)
        if t in SPLITS:
            return self.split(node)
        if t is aten.transpose.int:
            return self.transpose(node)
        if t is aten.permute.default:
            return self.permute(node)
        if t is aten.unsqueeze.default:
            return self.unsqueeze(node)
        if t is SDPA:
            return self.attention(node)
        if t is aten.expand.default:
            return self.expand(node)
        if t is aten.cat.default:
            return self.cat(node)
        if t is aten.stack.default:
            return self.stack(node)
        if t is aten.flatten.using_ints:
            return self.flatten(node)
        if t is aten.repeat_interleave.self_int:
            return self.repeat_interleave(node)
        if t is aten.slice.Tensor:
            return self.slice(node)
        if t in DIM_REDUCTIONS:
            return self.reduce_dims(node)
        if t is ASSERT_META:  # export's check of a `.to()`'s dtype/device/layout: no shape, nothing to localize
            if node.kwargs.get("size") is not None or node.kwargs.get("stride") is not None:
                raise _Refused("`_assert_tensor_metadata` of a size along the sequence")
            return None
        if t is aten.cross_entropy_loss.default:
            return self.cross_entropy(node)
        if t in (aten.mean.default, aten.sum.default):
            return self.reduce_all(node)
        if t in (aten.matmul.default, aten.bmm.default, aten.mm.default) and \
                all(self.lay.get(a) is not None for a in node.args[:2]):
            raise _Refused(f"`{_op(node)}` of two values split along the sequence (an attention written out as "
                           "q @ kᵀ, softmax, @ v?): context parallelism rewrites only "
                           "F.scaled_dot_product_attention")
        raise _Refused(f"context parallelism cannot prove `{_op(node)}` is local along the sequence")

    # --- sources of the split --------------------------------------------------------------------

    def _sequence_length(self) -> int:
        """T: the one query and key length of every SDPA (each one refused otherwise)."""
        lengths = set()
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target is SDPA:
                q, k = (_shape(a) for a in node.args[:2])
                if q[-2] != k[-2]:
                    self.refuse_at(node, f"attention of {q[-2]} queries over {k[-2]} keys (cross attention): "
                                         "context parallelism splits one sequence")
                    continue
                lengths.add(q[-2])
        if not lengths:  # no fused attention: the first batch input's dim 1 (an unfused one is refused at its op)
            lengths = {next((_shape(n)[1] for n in self.gm.graph.nodes if n.op == "placeholder" and
                             n.name.startswith("batch_") and len(_shape(n)) > 1), 0)}
        if len(lengths) > 1:
            self.refuse_at(None, f"attentions over sequences of different lengths {sorted(lengths)}: context "
                                 "parallelism splits one sequence")
            return 0
        (t,) = lengths
        parts = 2 * self.cp  # both methods use the load-balanced layout (ring needs it; all-to-all shares it)
        if t % parts:
            why = "2 × cp chunks (causal load balancing: rank r holds chunks r and 2·cp−1−r)"
            self.refuse_at(None, f"sequence length {t} is not divisible by {why} = {parts}",
                           plan_key="mesh.cp", hint=f"use a sequence length that is a multiple of {parts}, "
                                                    "or another cp")
            return 0
        return t

    def placeholder(self, node: fx.Node):
        if not node.name.startswith("batch_"):  # state: replicated on every cp rank
            return None
        s = _shape(node)
        if len(s) < 2 or s[1] != self.seq_len:
            return None  # a per-sample input: every cp rank reads it whole
        users = list(node.users)
        with self.gm.graph.inserting_after(node):
            shard = self.gm.graph.call_function(parc_ops.cp_shard.default, (node, AXIS, 1, self.cp))
        for u in users:
            u.replace_input_with(node, shard)
        shard.meta.update(node.meta)
        self.lay[shard] = Seq(1)
        self.sharded_inputs.append(node.name)
        self.ctx.count(NAME)
        return None

    def arange(self, node: fx.Node):
        """`arange(T)`: positions. Any other arange is replicated (it never meets the split sequence, or
        meeting it is refused)."""
        args = list(node.args)
        start, end = (0, args[0]) if node.target is aten.arange.default else (args[0], args[1])
        step = args[2] if node.target is aten.arange.start and len(args) > 2 else 1
        if (start, end, step) != (0, self.seq_len, 1) or node.kwargs.get("dtype") not in (None, torch.int64):
            return None
        # a batch input, for the device only: a parameter here would be one more use of it, which tensor
        # parallelism (run after this pass) would have to shard or refuse
        like = next(n for n in self.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("batch_"))
        with self.gm.graph.inserting_before(node):
            pos = self.gm.graph.call_function(parc_ops.cp_positions.default, (like, self.seq_len, AXIS, self.cp))
        pos.meta.update(node.meta)
        node.replace_all_uses_with(pos)
        self.gm.graph.erase_node(node)
        self.positions += 1
        self.ctx.count(NAME)
        self.lay[pos] = Seq(0)
        return Seq(0)

    # --- ops local along the sequence ------------------------------------------------------------

    def pointwise(self, node: fx.Node):
        out = _shape(node)
        found = None
        for a in node.args:
            if not isinstance(a, fx.Node) or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            s, lay = _shape(a), self.lay.get(a)
            if lay is not None:
                aligned = Seq(len(out) - len(s) + lay.dim, lay.merged)
                if found is not None and aligned != found:
                    raise _Refused(f"`{_op(node)}` combines values split along different dims {found} and {aligned}")
                found = aligned
        for a in node.args:  # a replicated operand must be broadcast along the sequence, not indexed by it
            if isinstance(a, fx.Node) and self.lay.get(a) is None and isinstance(a.meta.get("val"), torch.Tensor):
                s = _shape(a)
                k = found.dim - (len(out) - len(s))
                if 0 <= k < len(s) and s[k] != 1:
                    raise _Refused(f"`{_op(node)}` combines a value split along the sequence with "
                                   f"`{a.name}` {tuple(s)}, which has the sequence's {s[k]} positions along dim "
                                   f"{k} but is not built from `arange` positions: context parallelism cannot "
                                   "prove which of them this rank's tokens need")
        for dim_arg in _dim_args(node):
            if dim_arg % len(out) == found.dim:
                raise _Refused(f"`{_op(node)}` along the sequence dim {found.dim}")
        if node.target is aten.dropout.default:
            self.keyed_dropout(node, found)
        return found

    def keyed_dropout(self, node: fx.Node, lay: Seq) -> None:
        """A dropout on this rank's tokens: passes/dropout.py keys its mask by each element's serial index,
        reading the sequence's layout from `meta["parc_cp"]`; the cp rank's chunks are resolved at run time
        (runtime/dropout.py THIS_CP_RANK). A sequence folded with outer dims has no such record."""
        if lay.merged != 1:
            raise _Refused(f"dropout on a sequence folded with {lay.merged} outer elements (dim {lay.dim}): "
                           "keyed dropout under context parallelism needs the sequence a dim of its own")
        node.meta["parc_cp"] = lay.dim

    def only_operand(self, node: fx.Node, index: int, what: str):
        for k, a in enumerate(node.args):
            if k != index and isinstance(a, fx.Node) and self.lay.get(a) is not None:
                raise _Refused(f"`{_op(node)}`: {what} is split along the sequence")
        return self.lay[node.args[index]]

    def linear(self, node: fx.Node):
        x = self.lay.get(node.args[0])
        if x is None or any(self.lay.get(a) is not None for a in node.args[1:] if isinstance(a, fx.Node)):
            raise _Refused(f"`{_op(node)}` with a weight split along the sequence")
        if x.dim == len(_shape(node.args[0])) - 1:
            raise _Refused(f"`{_op(node)}` contracts the sequence dim")
        return x

    def norm(self, node: fx.Node):
        x = self.only_operand(node, 0, "a weight")
        if x.dim >= len(_shape(node.args[0])) - len(node.args[1]):
            raise _Refused(f"`{_op(node)}` normalizes over the sequence dim")
        return x

    def transpose(self, node: fx.Node):
        x, n = self.lay[node.args[0]], len(_shape(node.args[0]))
        d0, d1 = node.args[1] % n, node.args[2] % n
        return Seq({d0: d1, d1: d0}.get(x.dim, x.dim), x.merged)

    def permute(self, node: fx.Node):
        x, n = self.lay[node.args[0]], len(_shape(node.args[0]))
        dims = [d % n for d in node.args[1]]
        return Seq(dims.index(x.dim), x.merged)

    def unsqueeze(self, node: fx.Node):
        x, n = self.lay[node.args[0]], len(_shape(node))
        d = node.args[1] % n
        return Seq(x.dim + (d <= x.dim), x.merged)

    def split(self, node: fx.Node):
        x, n = self.lay[node.args[0]], len(_shape(node.args[0]))
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        if node.target is aten.unbind.int:
            dim = node.args[1] if len(node.args) > 1 else 0
        if dim % n == x.dim:
            raise _Refused(f"`{_op(node)}` splits along the sequence dim")
        parts = len(node.meta["val"])
        lay = x if node.target is not aten.unbind.int else Seq(x.dim - (dim % n < x.dim), x.merged)
        return tuple(lay for _ in range(parts))

    def expand(self, node: fx.Node):
        """`expand(sizes)`: new dims in front, size-1 dims broadcast; the sequence's size becomes local."""
        x, src, sizes = self.lay[node.args[0]], _shape(node.args[0]), list(node.args[1])
        d = x.dim + len(sizes) - len(src)
        if sizes[d] not in (-1, src[x.dim]) or x.merged != 1:
            raise _Refused(f"`{_op(node)}` {tuple(src)} → {tuple(sizes)} of the sequence dim {x.dim} (folded with "
                           f"{x.merged} outer elements)")
        if sizes[d] != -1:
            sizes[d] = self.local
        node.args = (node.args[0], sizes, *node.args[2:])
        return Seq(d, x.merged)

    def cat(self, node: fx.Node):
        """`cat` along another dim of values split alike (rotary's `cat((-x2, x1), -1)`)."""
        parts = node.args[0]
        lays = {self.lay.get(a) for a in parts}
        if len(lays) != 1:
            raise _Refused(f"`{_op(node)}` of values split and not split along the sequence")
        (x,) = lays
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim % len(_shape(node)) == x.dim:
            raise _Refused(f"`{_op(node)}` along the sequence dim")
        return x

    def stack(self, node: fx.Node):
        """`stack` of values split alike, along a new dim (the interleaved rotary's pairs: `stack((a, b), -1)`):
        no element moves to another sequence position, so the split stays, one dim further out when the new
        dim comes before it."""
        parts = node.args[0]
        lays = {self.lay.get(a) for a in parts}
        if len(lays) != 1:
            raise _Refused(f"`{_op(node)}` of values split and not split along the sequence")
        (x,) = lays
        dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(_shape(node))
        return Seq(x.dim + (dim <= x.dim), x.merged)

    def flatten(self, node: fx.Node):
        """`flatten(start, end)`: dims after the sequence's (the stacked pairs' `flatten(-2)`) or before it
        keep the split, moved in by the dims folded before it; the sequence folded with the dims before it
        (`logits.flatten(0, 1)`) is split with those outer elements merged in, as a reshape's. Folding it
        with dims after it is refused (a layout keeps only outer elements folded in)."""
        src = _shape(node.args[0])
        x, n = self.lay[node.args[0]], len(src)
        start = (node.args[1] if len(node.args) > 1 else 0) % n
        end = (node.args[2] if len(node.args) > 2 else -1) % n
        if x.dim < start or start == end:
            return x
        if end < x.dim:
            return Seq(x.dim - (end - start), x.merged)
        if x.dim == end:
            return Seq(start, x.merged * math.prod(src[start:end]))
        raise _Refused(f"`{_op(node)}` folds the sequence dim {x.dim} with the dims after it (to {end})")

    def repeat_interleave(self, node: fx.Node):
        """`repeat_interleave(x, r, dim)` along another dim (kv heads copied to their query heads, GQA written
        out): each sequence position's values are repeated in place, so the split stays; along the sequence,
        or flattened (no dim), refused."""
        x = self.lay[node.args[0]]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if dim is None or dim % len(_shape(node.args[0])) == x.dim:
            raise _Refused(f"`{_op(node)}` repeats along the sequence dim {x.dim}" if dim is not None else
                           f"`{_op(node)}` without a dim flattens the sequence")
        return x

    def slice(self, node: fx.Node):
        """`x[..., a:b]` along another dim keeps the split (rotary's halves); along the sequence it is refused."""
        x = self.lay[node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else 0
        if dim % len(_shape(node.args[0])) == x.dim:
            raise _Refused(f"`{_op(node)}` slices along the sequence dim")
        return x

    def reduce_dims(self, node: fx.Node):
        """`mean(dims)` / `sum(dims)` / `amax(dims)` over other dims (RMSNorm written out: `pow(2).mean(-1)`)."""
        x, n = self.lay[node.args[0]], len(_shape(node.args[0]))
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if dims is None or len(dims) == 0:
            raise _Refused(f"`{_op(node)}` over every dim, the sequence's included")
        dims = [d % n for d in dims]
        if x.dim in dims:
            raise _Refused(f"`{_op(node)}` reduces over the sequence dim")
        return x if keep else Seq(x.dim - sum(d < x.dim for d in dims), x.merged)

    def view(self, node: fx.Node):
        """A reshape keeps the sequence a dimension (alone or with outer dims folded in) or is refused;
        its size becomes local."""
        x, src, out = self.lay[node.args[0]], _shape(node.args[0]), _shape(node)
        before = math.prod(src[:x.dim]) * x.merged  # elements in front of the sequence, flattened
        after = math.prod(src[x.dim + 1:])
        for j in range(len(out)):
            head = math.prod(out[:j])
            if math.prod(out[j + 1:]) == after and before % head == 0 and out[j] == before // head * self.seq_len:
                merged = before // head
                local = list(out)
                local[j] = merged * self.local
                node.args = (node.args[0], local, *node.args[2:])
                return Seq(j, merged)
        raise _Refused(f"`{_op(node)}` {tuple(src)} → {tuple(out)} does not keep the sequence a dimension of "
                       "its own or folded with the dims before it")

    # --- attention and the loss ------------------------------------------------------------------

    def attention(self, node: fx.Node):
        a = _sdpa_args(node)
        q, k, v = a["query"], a["key"], a["value"]
        for name, t in (("query", q), ("key", k), ("value", v)):
            lay = self.lay.get(t)
            if lay != Seq(len(_shape(t)) - 2):
                raise _Refused(f"attention's {name} is not split along its sequence dim -2 ({lay})")
        if a.get("attn_mask") is not None:
            raise _Refused("attention with an attn_mask that reads an input or is not exactly the causal triangle "
                           "(or all-keep): context parallelism builds only causal masks (from global positions); "
                           "pass is_causal=True or no mask")
        if a.get("enable_gqa", False) and _shape(q)[-3] != _shape(k)[-3]:
            k, v = (self.repeat_heads(node, t, _shape(q)[-3] // _shape(t)[-3]) for t in (k, v))
        scale = a.get("scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(_shape(q)[-1])
        args = (q, k, v, AXIS, bool(a.get("is_causal", False)), scale, self.cp)
        p = float(a.get("dropout_p", 0.0) or 0.0)
        if p:  # attention dropout: passes/dropout.py appends its key (site, shape, shard records) after p
            args += (p,)
        if self.method == "alltoall" and _shape(q)[-3] % self.cp:
            heads = _shape(q)[-3]
            raise _Refused(f"all-to-all attention scatters heads over cp: {heads} heads are not divisible by "
                           f"cp {self.cp}")
        with self.gm.graph.inserting_before(node):
            if self.method == "alltoall":  # DeepSpeed-Ulysses: one op, one output
                ring = out = self.gm.graph.call_function(parc_ops.ulysses_attention.default, args)
            else:
                ring = self.gm.graph.call_function(parc_ops.ring_attention.default, args)
                out = self.gm.graph.call_function(operator.getitem, (ring, 0))
        ring.meta["nn_module_stack"] = out.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        if p:  # the serial probabilities' (B, H, L, S) the mask covers, for passes/dropout.py
            ring.meta["parc_attention_full"] = [*_shape(q)[:-1], _shape(k)[-2]]
        ring.meta["stack_trace"] = out.meta["stack_trace"] = node.meta.get("stack_trace")
        out.meta["val"] = node.meta["val"]  # full shapes during the walk; `_propagate` makes them local
        node.replace_all_uses_with(out)
        self.gm.graph.erase_node(node)
        self.attentions += 1
        self.ctx.count(NAME)
        self.lay[out] = Seq(len(_shape(q)) - 2)
        return None

    def repeat_heads(self, node: fx.Node, t: fx.Node, groups: int) -> fx.Node:
        """`enable_gqa`: each kv head repeated for its `groups` query heads (dim −3), what SDPA does with
        enable_gqa; the ring then carries whole heads (its volume is H/Hkv times the kv heads')."""
        with self.gm.graph.inserting_before(node):
            out = self.gm.graph.call_function(aten.repeat_interleave.self_int, (t, groups, -3))
        out.meta["val"] = t.meta["val"].repeat_interleave(groups, -3)
        self.lay[out] = self.lay[t]
        return out

    def cross_entropy(self, node: fx.Node):
        """`F.cross_entropy(logits, targets)` with reduction mean: this rank's sum, summed over cp, over the
        whole micro-batch's count of targets not ignored (what the serial mean divides by)."""
        args = list(node.args) + [None] * (6 - len(node.args))
        x, target, weight, reduction, ignore, smoothing = args
        reduction = 1 if reduction is None else reduction
        ignore = -100 if ignore is None else ignore
        if weight is not None:
            raise _Refused("cross_entropy with class weights under context parallelism is not proven yet")
        if reduction == 0:
            return self.lay[x]  # per-token losses: split like the tokens
        lx, lt = self.lay.get(x), self.lay.get(target)
        if lx is None or lt is None or lx.dim != 0 or lt.dim != 0 or lx.merged != lt.merged:
            raise _Refused(f"`{_op(node)}` of logits {lx} and targets {lt}: context parallelism needs both split "
                           "along their token dim 0")
        g = self.gm.graph
        with g.inserting_before(node):
            local = g.call_function(aten.cross_entropy_loss.default,
                                    (x, target, None, 2, ignore, smoothing or 0.0))
            out = local
            if reduction == 1:
                out = g.call_function(aten.div.Tensor, (local, self.token_count(target, ignore)))
        for n in (local, out):
            n.meta["stack_trace"] = node.meta.get("stack_trace")
            n.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(out)
        g.erase_node(node)
        self.ctx.count(NAME)
        self.lay[out] = SHARE
        return None

    def token_count(self, target: fx.Node, ignore: int) -> fx.Node:
        """The micro-batch's count of targets other than `ignore` (fp32, exact below 2**24), what the serial
        mean divides by. When the targets are a batch input's values seen through views (`SAME_VALUES`), it
        is counted on that input whole (the program takes the whole micro-batch): no communication, known
        before the forward. Otherwise this rank's count, summed over cp (an all-reduce in the forward)."""
        g = self.gm.graph  # inserted where the caller inserts (before the loss)
        whole = _whole_input(target)
        kept = g.call_function(aten.ne.Scalar, (target if whole is None else whole, ignore))
        count = g.call_function(aten.sum.default, (kept,), {"dtype": torch.float32})
        if whole is not None:
            self.counted["whole"] += 1
            return count
        self.counted["summed"] += 1
        return g.call_function(parc_ops.cp_sum.default, (count, AXIS))

    def reduce_all(self, node: fx.Node):
        """`x.mean()` / `x.sum()` over a split value: this rank's sum (÷ the serial count), a share."""
        x = node.args[0]
        g = self.gm.graph
        with g.inserting_before(node):
            out = local = g.call_function(aten.sum.default, (x,), dict(node.kwargs))
            if node.target is aten.mean.default:
                out = g.call_function(aten.div.Scalar, (local, float(math.prod(_shape(x)))))
        for n in (local, out):
            n.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(out)
        g.erase_node(node)
        self.ctx.count(NAME)
        self.lay[out] = SHARE
        return None

    def keeps_share(self, node: fx.Node) -> bool:
        """Whether `node` is linear in its share operands (`Share`), the others replicated: then its result
        is a share of the serial result."""
        t, lays = node.target, [self.lay.get(a) if isinstance(a, fx.Node) else None for a in node.args]
        if t in SHARE_KEPT:
            return True
        if t in SHARE_SCALED:
            return lays[0] == SHARE and all(lay is None for lay in lays[1:])
        if t is aten.mul.Tensor:  # one share, one replicated factor
            return set(lays[:2]) == {SHARE, None}
        if t in SHARE_SUMMED:
            return lays[:2] == [SHARE, SHARE]
        return False

    def sum_shares(self, node: fx.Node) -> None:
        """A use of a share that is not linear in it: each share operand summed over cp first (an all-reduce
        in the forward, its backward the identity: every rank's share gets the one sum's gradient)."""
        g = self.gm.graph
        for a in dict.fromkeys(node.all_input_nodes):
            if self.lay.get(a) != SHARE:
                continue
            with g.inserting_before(node):
                total = g.call_function(parc_ops.cp_sum.default, (a, AXIS))
            total.meta["val"] = a.meta["val"]
            node.replace_input_with(a, total)
            self.lay[total] = None

    # --- diagnostics -----------------------------------------------------------------------------

    def refuse_at(self, node: fx.Node | None, message: str, plan_key: str | None = None,
                  hint: str | None = None) -> None:
        if node is not None:
            message = f"{message} (op `{node.name}` in module `{module_path(node) or '<top level>'}`)"
        span = self.plan.spans.get(plan_key) if plan_key else None
        span = span or (_user_span(node, self.ctx) if node is not None else None) or \
            self.plan.spans.get("mesh.cp") or getattr(self.plan.mesh, "span", None)
        key = (message.split(" (op ")[0], module_path(node).split(".")[-1] if node is not None else "")
        if key in self.seen:  # each layer repeats its blocks' ops: one error per kind of op and module
            return
        self.seen.add(key)
        self.errors.append(Diagnostic(message, span, hint or "docs/context-parallel.md says what cp proves",
                                      "error", self.plan.source if span is not None and span.file == self.plan.file
                                      else None))

    def summary(self) -> dict:
        return {"method": self.method, "cp": self.cp, "seq_len": self.seq_len, "inputs": self.sharded_inputs,
                "attentions": self.attentions, "positions": self.positions, "masks_folded": self.masks,
                # true: each cp rank's loss is its share, summed over cp by the runtime (Trainer.global_losses)
                "loss_share": self.loss_share, "token_counts": self.counted}


def _fold_constant_masks(gm: fx.GraphModule) -> int:
    """An SDPA `attn_mask` computed from no input (HF's `create_causal_mask` builds one from `arange`
    positions) is a constant of the program: computed here on the serial graph, and when it is exactly the
    causal triangle (or keeps every key), the attention gets `is_causal=True` (or no mask) in its place and
    the mask's ops are removed, so the ring builds its masks from global positions. Any other mask is left
    for `attention` to refuse. Returns how many masks were folded."""
    folded, dead = 0, set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        a = _sdpa_args(node)
        mask = a.get("attn_mask")
        if not isinstance(mask, fx.Node) or a.get("is_causal", False):
            continue
        chain = ancestors(mask)
        if any(n.op != "call_function" for n in chain):
            continue  # it reads an input or a parameter: not a constant
        value = _evaluate(gm, chain, mask)
        tq, tk = _shape(a["query"])[-2], _shape(a["key"])[-2]
        allowed = value if value.dtype == torch.bool else value == 0
        if value.dtype != torch.bool and not bool(((value == 0) | (value == float("-inf")) |
                                                    (value == torch.finfo(value.dtype).min)).all()):
            continue  # a bias, not a mask
        causal = torch.ones(tq, tk, dtype=torch.bool).tril()
        if bool((allowed == causal).all()):
            is_causal = True
        elif bool(allowed.all()):
            is_causal = False
        else:
            continue
        kwargs = {k: v for k, v in a.items() if k not in ("query", "key", "value", "attn_mask")}
        kwargs["is_causal"] = is_causal
        node.args, node.kwargs = (a["query"], a["key"], a["value"]), kwargs
        dead |= chain
        folded += 1
    for n in list(gm.graph.nodes):  # export's dtype checks of the mask's `.to()`s would keep it alive
        if n.op == "call_function" and n.target is ASSERT_META and n.args and n.args[0] in dead:
            gm.graph.erase_node(n)
    if folded:
        gm.graph.eliminate_dead_code()
    return folded


def _evaluate(gm: fx.GraphModule, chain: set, target: fx.Node) -> torch.Tensor:
    """The value of `target`, computed by the nodes of `chain` (none reads an input) on the CPU."""
    g = fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        if n in chain:
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[target])
    return fx.GraphModule(gm, g)()


def _whole_input(target: fx.Node) -> fx.Node | None:
    """The whole batch input whose values `target` holds this rank's part of, seen only through views and
    copies (`SAME_VALUES`) of its `cp_shard`; None when anything else computed it."""
    n = target
    while n.op == "call_function" and n.target in SAME_VALUES:
        n = n.args[0]
    return n.args[0] if n.op == "call_function" and n.target is parc_ops.cp_shard.default else None


def _op(node: fx.Node) -> str:
    t = node.target
    return getattr(t, "__name__", str(t)) if not hasattr(t, "_schema") else str(t).removeprefix("aten.")


def _shape(node) -> list[int]:
    return list(node.meta["val"].shape)


def _dim_args(node: fx.Node) -> list[int]:
    """The dim a softmax runs along (the only pointwise ops here that have one)."""
    if node.target in (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default):
        return [node.args[1]]
    return []


def _sdpa_args(node: fx.Node) -> dict:
    a = dict(zip(SDPA_ARGS, node.args))
    a.update(node.kwargs)
    return a


def _user_span(node: fx.Node, ctx) -> Span | None:
    """The innermost line of the user's code (outside torch and parc) in the node's stack trace."""
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")[::-1]:
        if not any(Path(file).resolve().is_relative_to(d) for d in (_TORCH, *_PARC)):
            return Span(file, int(line), _column(file, int(line)))
    return None


def _column(file: str, line: int) -> int:
    """The first non-blank column of `line` (the statement the op came from)."""
    try:
        text = Path(file).read_text().splitlines()[line - 1]
    except (OSError, IndexError):
        return 1
    return len(text) - len(text.lstrip()) + 1


def _propagate(gm: fx.GraphModule) -> None:
    """Re-run every node's shape on fake tensors from the whole micro-batch: the program's own `cp_shard`
    makes them local, so a size the rewrite got wrong fails here, at compile time."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    with mode:
        args = [torch.empty(n.meta["val"].shape, dtype=n.meta["val"].dtype, device="cpu",
                            requires_grad=n.meta["val"].requires_grad) for n in placeholders]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    # FakeTensorProp stores the placeholders detached; tensor parallelism, run after this pass, finds the
    # values that carry a gradient (those it must sum over tp) from the parameters' requires_grad
    for n, a in zip(placeholders, args):
        n.meta["val"] = a

