"""How a tensor-parallel shard flows through ordinary aten ops (used by passes/tensor_parallel.py).

Start at `Layouts.propagate(node)`: given the layouts of a node's inputs it
returns the node's layout and, where the local shapes differ from the traced
ones, rewrites the node's shape constants (view/reshape/expand sizes, split
sizes) for this rank. A layout is None (replicated: every tp rank holds the full
value) or a `Shard`. Every op that sees a sharded input is either in one of the
tables below, with the condition under which it is safe, or rejected with a
ParcError naming the node and its module path: never a silently wrong result.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import parc.runtime.parallel.ring_attention  # noqa: F401 — registers torch.ops.parc.ring_attention
import parc.runtime.parallel.ulysses  # noqa: F401 — registers torch.ops.parc.ulysses_attention
from parc.errors import ParcError
from parc.passes import tp_channels, tp_contract, tp_norms, tp_pieces, tp_pointwise, tp_rows, tp_subset
from parc.passes.tp_shard import LIKE, SAME_LAYOUT, VIEWS, Shard, is_param, shape, slice_bounds  # noqa: F401 (re-exported)
from parc.passes.tp_shard import dim_groups as _groups
from parc.runtime.checkpoint.state import block_sizes
from parc.traced import module_path

aten = torch.ops.aten


RESHAPES = VIEWS | {aten.flatten.using_ints, aten.unflatten.int}  # regroup dims; only VIEWS carry all sizes
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
# `torch.tensor_split(x, [i, …], dim)` / `(x, n, dim)`: pieces at indices, not sizes (Qwen3.5's linear
# attention cuts its sequence into chunks and a remainder); followed only along a dim that is not sharded
TENSOR_SPLITS = {aten.tensor_split.indices, aten.tensor_split.sections}
SDPA = {aten.scaled_dot_product_attention.default}
# passes/context_parallel.py's attentions (run before tensor parallelism): (B, H, T/cp, hs) q, k, v, heads local
CP_ATTENTION = {torch.ops.parc.ring_attention.default, torch.ops.parc.ulysses_attention.default}
NEW = {aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}


class Layouts:
    def __init__(self, gm: fx.GraphModule, tp: int, tp_rank: int, sequence_parallel: bool):
        self.gm, self.tp, self.tp_rank, self.sp = gm, tp, tp_rank, sequence_parallel
        self.of: dict[fx.Node, object] = {}
        self.feeds_tp: set[fx.Node] = set()  # nodes whose values still reach a sharded layer (set by the tp pass)
        self.gathered: dict[fx.Node, fx.Node] = {}  # sequence slice → its all-gather
        self.made: list[fx.Node] = []  # nodes this class inserted, so a failed attempt can be undone
        self.indivisible = _raise  # what to do with a size tp does not divide; the tp pass collects them

    def get(self, a):
        return self.of.get(a) if isinstance(a, fx.Node) else None

    # --- errors ---------------------------------------------------------------------

    def fail(self, node: fx.Node, why: str, shard: Shard | None = None, hint: str | None = None):
        rule = shard.rule if shard is not None else None
        target = getattr(node.target, "__name__", str(node.target))
        where = module_path(node) or "<top level>"
        raise ParcError(f"tensor parallelism: cannot prove `{node.name}` ({target}) in module `{where}` safe on a "
                        f"sharded dim: {why}", getattr(rule, "span", None),
                        hint or "shard fewer modules, or mark the producing layer `replicate`")

    # --- the dispatcher -------------------------------------------------------------

    def propagate(self, node: fx.Node):
        """The node's layout. An op parc cannot follow on a sequence slice (sequence parallelism) gets the
        whole sequence instead: the slice is all-gathered first, as Megatron gathers before its output
        layer. That is exact (the slice and its gather hold the same numbers), only more communication."""
        args, kwargs, made = node.args, node.kwargs, len(self.made)
        try:
            return self._dispatch(node)
        except ParcError:
            node.args, node.kwargs = args, kwargs  # undo the failed attempt
            for n in reversed(self.made[made:]):
                if not n.users:
                    self.gm.graph.erase_node(n)
            del self.made[made:]
            seq = [a for a in node.all_input_nodes if isinstance(self.get(a), Shard) and self.get(a).seq
                   and self.get(a).blocks == 1]
            if not seq:
                raise
            for a in seq:
                node.replace_input_with(a, self.gather(a, node))
            return self._dispatch(node)

    def gather(self, x: fx.Node, before: fx.Node) -> fx.Node:
        """The whole sequence of slice `x` (`parc.allgather_split`), made once, before its first user `before`."""
        if x not in self.gathered:
            s = self.get(x)
            with self.gm.graph.inserting_before(before):
                g = self.gm.graph.call_function(torch.ops.parc.allgather_split.default, (x, "tp", s.dim, self.tp))
            g.meta["val"] = x.meta["val"]  # the traced (full) shape
            g.meta["nn_module_stack"] = before.meta.get("nn_module_stack")
            self.of[g] = None
            self.gathered[x] = g
        return self.gathered[x]

    def _dispatch(self, node: fx.Node):
        ins = [a for a in node.all_input_nodes if self.get(a) is not None]
        t = node.target
        if t is operator.getitem:
            src = self.get(node.args[0])
            return src[node.args[1]] if isinstance(src, list) else src
        if not ins:
            return None
        if any(isinstance(self.get(a), tp_rows.Rows) for a in ins):
            return tp_rows.propagate(self, node)  # a sharded dim merged under outer dims: row-wise ops only
        if any(isinstance(self.get(a), Shard) and self.get(a).parts for a in ins):
            return tp_subset.propagate(self, node, ins)  # a kv subset (fewer kv heads than tp): passes/tp_subset.py
        return self.follow(node, ins)

    def follow(self, node: fx.Node, ins: list[fx.Node]):
        """The op's rule, for inputs that are whole tp shards (or a kv subset passes/tp_subset.py let through)."""
        t = node.target
        if t is aten._assert_tensor_metadata.default:
            s = self.get(node.args[0])
            if node.kwargs.get("size") is not None or len(node.args) > 1:
                self.fail(node, "it asserts a full shape on a sharded tensor", s)
            return None
        if t in SAME_LAYOUT or (isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags):
            return self._pointwise(node)
        if t in LIKE or t is aten.type_as.default:  # the first input's shape (or values) in a new dtype or fill
            return self.get(node.args[0])
        if t in NEW:
            return self._new(node)
        if t is aten.view_as.default:  # `view` to the traced shape, which `_view` then makes local
            node.target, node.args = aten.view.default, (node.args[0], list(shape(node)))
            return self._view(node)
        if t in RESHAPES:
            return self._view(node)
        if t in SPLITS:
            return self._split(node)
        if t in TENSOR_SPLITS:
            return self._tensor_split(node)
        if t in SDPA:
            return self._sdpa(node)
        if t in CP_ATTENTION:
            return self._cp_attention(node)
        handler = {aten.transpose.int: self._transpose, aten.permute.default: self._permute,
                   aten.t.default: self._t, aten.unsqueeze.default: self._unsqueeze,
                   aten.expand.default: self._expand, aten.slice.Tensor: self._slice,
                   aten.cat.default: self._cat,
                   aten.linear.default: self._linear, aten.embedding.default: self._embedding,
                   aten.view_as_complex.default: self._complex, aten.view_as_real.default: self._complex,
                   aten.copy_.default: self._copy}.get(t)
        if handler is not None:
            return handler(node)
        if t in SOFTMAX:
            s = self.get(node.args[0])
            if node.args[1] % len(shape(node)) == s.dim:
                self.fail(node, f"softmax over dim {s.dim}, which is sharded across tp", s)
            return s
        if t in tp_contract.RULES:
            return tp_contract.RULES[t](self, node)
        if t in tp_norms.RULES:
            return tp_norms.RULES[t](self, node)
        if t in tp_channels.RULES:
            return tp_channels.RULES[t](self, node)
        self.fail(node, "parc has no sharding rule for this op", self.get(ins[0]))

    # --- elementwise ---------------------------------------------------------------

    def _pointwise(self, node: fx.Node):
        out_rank = len(shape(node)) if isinstance(node.meta.get("val"), torch.Tensor) else 0
        shards = {self.get(a) for a in node.all_input_nodes if self.get(a) is not None}
        if len(shards) > 1:
            self.fail(node, f"its inputs are sharded differently: {sorted(map(repr, shards))}", next(iter(shards)))
        (s,) = shards
        for a in node.all_input_nodes:
            if self.get(a) is not None or not isinstance(a.meta.get("val"), torch.Tensor):
                continue
            d = s.dim - (out_rank - len(shape(a)))  # the input's dim that broadcasts against the sharded one
            if d < 0 or shape(a)[d] == 1:
                continue  # broadcast: the replicated operand is the same on every chunk
            if s.blocks == 1:
                self.localize(node, a, d, s)  # a whole value meeting a slice (sequence, heads, features)
                continue
            self.fail(node, f"replicated input `{a.name}` {shape(a)} meets a tensor sharded on dim {s.dim} in "
                      f"{s.blocks} blocks", s)
        if tp_pointwise.needs_check(node):  # a user's op: its tag is checked on this very cut
            why = tp_pointwise.check(node, s, self.tp, {a for a in node.all_input_nodes if self.get(a) is not None})
            if why is not None:
                self.fail(node, f"it is tagged `torch.Tag.pointwise`, but {why}", s,
                          hint="drop the tag if the op is not elementwise (forward and backward), and mark the "
                               "producing layer `replicate`")
        return s

    def localize(self, node: fx.Node, a: fx.Node, d: int, s: Shard) -> None:
        """Replicated `a`, used by `node` beside a value sharded like `s`, keeps this rank's chunk along its
        dim `d` (`parc.split_allgather`: no communication forward; backward all-gathers the gradient, so a
        replicated parameter's gradient stays whole on every rank: a norm weight over a sharded hidden)."""
        if s.parts:
            self.fail(node, f"replicated input `{a.name}` {shape(a)} meets a kv subset (tp {self.tp} ranks share "
                      f"{s.parts} chunks of dim {d}); parc keeps a replicated operand's chunk only beside tp chunks", s)
        if shape(a)[d] % self.tp:
            self.fail(node, f"replicated input `{a.name}` {shape(a)} meets a value sharded on its dim {d}, whose "
                      f"size {shape(a)[d]} tp {self.tp} does not divide", s)
        with self.gm.graph.inserting_before(node):
            cut = self.gm.graph.call_function(torch.ops.parc.split_allgather.default, (a, "tp", d, self.tp))
        self.made.append(cut)
        cut.meta["val"] = a.meta["val"]  # the traced (full) shape, as everywhere before local shapes
        cut.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        self.of[cut] = Shard(d, 1, s.seq, s.rule)
        node.replace_input_with(a, cut)

    # --- shape ops -----------------------------------------------------------------

    def _view(self, node: fx.Node):
        s, src = self.get(node.args[0]), node.args[0]
        a, b = shape(src), shape(node)
        if s.blocks != 1:
            self.fail(node, f"it reshapes a fused output of {s.blocks} blocks before splitting it", s)
        for gi, go in _groups(a, b):
            if s.dim not in gi:
                continue
            if any(a[k] != 1 for k in gi if k < s.dim):
                if s.parts:  # rows are tp chunks under each outer position: no kv subset's
                    self.fail(node, f"it merges a kv subset's dim {s.dim} under outer dims {[a[k] for k in gi]}", s)
                rows = tp_rows.merge(self, node, s, gi, go)  # (B, T, H, d) → (B·T·H, d): rows (passes/tp_rows.py)
                if rows is not None:
                    return rows
                self.fail(node, f"sharded dim {s.dim} is merged under outer dims {[a[k] for k in gi]}", s)
            # the outermost dim the sharded one becomes; a one-chunk kv subset (one kv head) may be the
            # heads dim of size 1 (passes/tp_subset.py)
            outs = [o for o in go if b[o] != 1 or s.parts == 1]
            if not outs:
                self.fail(node, f"sharded dim {s.dim} disappears", s)
            o, parts = outs[0], s.parts or self.tp  # a kv subset (passes/tp_subset.py): `parts` chunks, not tp
            if b[o] % parts:  # reported, and the walk goes on (see `indivisible`)
                heads = " (grouped-query attention: kv heads at least tp must be a multiple of it; fewer than tp " \
                    "are kept whole by the pass, or mark the k and v projections `replicate`)" if len(go) > 1 else ""
                try:
                    self.fail(node, f"it splits sharded dim {s.dim} of size {a[s.dim]} into {tuple(b[k] for k in go)}, "
                              f"and {b[o]} is not divisible by {'tp' if not s.parts else 'its kv chunks'} {parts}{heads}", s,
                              f"use a tp that divides {b[o]}")
                except ParcError as e:
                    self.indivisible(e)
            if node.target in VIEWS:  # the size constant of the sharded dim becomes the local one
                sizes = list(node.args[1])
                if sizes[o] != -1:
                    sizes[o] = sizes[o] // parts
                    node.args = (node.args[0], sizes, *node.args[2:])
            elif node.target is aten.unflatten.int:  # unflatten(x, dim, sizes): sizes of the dims it makes
                d, sizes = node.args[1] % len(a), list(node.args[2])
                if sizes[o - d] != -1:
                    sizes[o - d] = sizes[o - d] // parts
                    node.args = (node.args[0], node.args[1], sizes)
            return Shard(o, 1, s.seq, s.rule)
        self.fail(node, "cannot follow the sharded dim through this reshape", s)

    def _transpose(self, node):
        s = self.get(node.args[0])
        n = len(shape(node))
        d0, d1 = node.args[1] % n, node.args[2] % n
        dim = d1 if s.dim == d0 else d0 if s.dim == d1 else s.dim
        return Shard(dim, s.blocks, s.seq, s.rule)

    def _permute(self, node):
        s = self.get(node.args[0])
        n = len(shape(node))
        return Shard([p % n for p in node.args[1]].index(s.dim), s.blocks, s.seq, s.rule)

    def _t(self, node):
        s = self.get(node.args[0])
        return Shard(1 - s.dim if len(shape(node)) == 2 else s.dim, s.blocks, s.seq, s.rule)

    def _unsqueeze(self, node):
        s = self.get(node.args[0])
        d = node.args[1] % len(shape(node))
        return Shard(s.dim + 1 if d <= s.dim else s.dim, s.blocks, s.seq, s.rule)

    def _expand(self, node):
        s = self.get(node.args[0])
        sizes = list(node.args[1])
        lead = len(sizes) - len(shape(node.args[0]))
        o = s.dim + lead
        if sizes[o] != -1:
            sizes[o] = sizes[o] // (s.parts or self.tp)
            node.args = (node.args[0], sizes, *node.args[2:])
        return Shard(o, s.blocks, s.seq, s.rule)

    def _new(self, node):
        """`x.new_empty(sizes)` shaped like sharded x (its sizes are x's, as `x.shape[:-1] + (w,)` writes
        them) holds nothing until written: it is sharded like x, to be filled by x's kind of values
        (`_copy`), with the sharded size made local. Any other `new_*` is a whole tensor of its written
        sizes on every rank (zeros, ones, a fill: the same numbers everywhere)."""
        s, sizes = self.get(node.args[0]), list(node.args[1])
        full = shape(node.args[0])
        if node.target is aten.new_empty.default and s is not None and s.blocks == 1 and len(sizes) == len(full) \
                and sizes[s.dim] == full[s.dim]:
            sizes[s.dim] //= self.tp
            node.args = (node.args[0], sizes, *node.args[2:])
            return Shard(s.dim, 1, s.seq, s.rule)
        return None

    def _copy(self, node):
        """`dst.copy_(src)` in place: dst keeps its layout; src must match it (a replicated src keeps this
        rank's chunk, or broadcasts); a sharded src into a whole dst would leave the other ranks' part stale."""
        d, src = self.get(node.args[0]), node.args[1]
        if d is None:
            self.fail(node, "it copies a sharded value into a whole (replicated) tensor", self.get(src))
        if self.get(src) is None:
            k = d.dim - (len(shape(node.args[0])) - len(shape(src)))
            if k >= 0 and shape(src)[k] != 1:
                self.localize(node, src, k, d)
        elif self.get(src) != d:
            self.fail(node, f"it copies a value sharded as {self.get(src)} into one sharded as {d}", d)
        return d

    def _complex(self, node):
        """view_as_complex folds the last dim (the pairs) into the dtype; view_as_real unfolds it."""
        s = self.get(node.args[0])
        if s.dim >= len(shape(node)):
            self.fail(node, "it folds the sharded dim into complex numbers", s)
        return s

    def _slice(self, node):
        """Along another dim the shard stays. Along the sharded dim, only one whole block of a fused output
        (Phi-3's q, k, v sliced from `qkv_proj`): this rank's chunk of it, a plain shard."""
        s = self.get(node.args[0])
        dim, lo, hi, step = slice_bounds(node)
        if dim != s.dim:
            return s
        bounds, at = [], 0
        for size in block_sizes(shape(node.args[0])[dim], s.blocks):
            bounds.append((at, at + size))
            at += size
        if s.blocks == 1 or step != 1 or (lo, hi) not in bounds:
            self.fail(node, f"it slices dim {dim}, which is sharded across tp" + (
                f", at [{lo}:{hi}], not one of the fused blocks {bounds}" if s.blocks != 1 else ""), s)
        # every block before it is cut by tp too: this rank's chunk of the block starts at lo / tp
        node.args = (node.args[0], dim, lo // self.tp, hi // self.tp, *node.args[5:])
        return Shard(dim, 1, s.seq, s.rule)

    def _cat(self, node):
        """Along an unsharded dim, of values sharded alike; a replicated one with the sharded dim's full
        extent (a per-head attention sink beside head-sharded scores) keeps this rank's chunk. Along the
        sharded dim: passes/tp_channels.py."""
        tensors, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0) % len(shape(node))
        if any(isinstance(self.get(a), Shard) and self.get(a).dim == dim for a in tensors):
            return tp_channels.cat(self, node, dim)  # along the sharded dim: the operands' blocks, concatenated
        shards = {self.get(a) for a in tensors} - {None}
        if len(shards) != 1:
            self.fail(node, f"it concatenates tensors sharded differently: {sorted(map(repr, shards))}",
                      next(iter(shards)))
        (s,) = shards
        for a in tensors:
            if self.get(a) is None:
                if len(shape(a)) != len(shape(node)) and a.meta["val"].numel() == 0:
                    continue  # an empty 1-D tensor, which cat skips (a cache's empty start)
                if s.blocks != 1 or len(shape(a)) != len(shape(node)) or shape(a)[s.dim] != shape(node)[s.dim]:
                    self.fail(node, f"it concatenates replicated `{a.name}` {shape(a)} with values sharded on "
                              f"dim {s.dim}", s)
                self.localize(node, a, s.dim, s)
        return s

    def _split(self, node):
        """A fused projection's split: blocks of a column output become one plain shard each."""
        s = self.get(node.args[0])
        full = shape(node.args[0])
        dim = (node.args[2] if len(node.args) > 2 else 0) % len(full)
        pieces = [tuple(v.shape)[dim] for v in node.meta["val"]]
        if dim != s.dim:
            return [s] * len(pieces)
        if s.blocks == 1 and not s.seq and tp_pieces.per_head_norms(self, node, s):
            return None  # one norm per head, rewritten into one norm on the local heads; the split is now dead
        if s.blocks == 1 or pieces != block_sizes(full[dim], s.blocks):
            self.fail(node, f"it splits sharded dim {dim} into {pieces}, not into the blocks "
                      f"{block_sizes(full[dim], s.blocks)} the weight was sharded by", s)
        arg = node.args[1]
        local = arg // self.tp if isinstance(arg, int) else [p // self.tp for p in arg]
        if node.target is aten.chunk.default:
            local = arg
        node.args = (node.args[0], local, *node.args[2:])
        return [Shard(dim, 1, s.seq, s.rule)] * len(pieces)

    def _tensor_split(self, node):
        """Pieces cut along a dim that is not sharded keep the input's shard (their indices are along that dim);
        along the sharded dim each rank's cut would fall elsewhere in its slice: refused."""
        s = self.get(node.args[0])
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(shape(node.args[0]))
        if dim == s.dim:
            self.fail(node, f"it cuts sharded dim {dim} at indices of the full tensor", s)
        return [s] * len(node.meta["val"])

    # --- compute ops ---------------------------------------------------------------

    def _sdpa(self, node):
        """Heads sharded alike. Replicated k and v beside head-sharded q (grouped-query attention with fewer
        kv heads than tp: k/v projections left whole, their heads repeated to q's count) keep this rank's
        heads (`localize`); k/v with fewer heads than q under `enable_gqa` must shard alike with q."""
        q, k, v = (self.get(a) for a in node.args[:3])
        gqa = node.kwargs.get("enable_gqa", node.args[7] if len(node.args) > 7 else False)
        if gqa and q is not None and not q.parts and q.dim == 1 and k == v and isinstance(k, Shard) and k.parts \
                and k.dim == 1 and shape(node.args[1])[1] == k.parts:
            return q  # one kv head per rank, the one its q heads use: `enable_gqa` maps them to it (tp_subset.py)
        if q is not None and q.dim == 1 and q.blocks == 1 and not q.seq:
            for a, s in zip(node.args[1:3], (k, v)):
                if s is None and shape(a)[1] == shape(node.args[0])[1]:
                    self.localize(node, a, 1, q)
            k, v = (self.get(a) for a in node.args[1:3])
        if not (q == k == v) or q is None or q.dim != 1 or q.blocks != 1:
            self.fail(node, f"attention needs q, k, v sharded alike on the heads dim 1, got {q}, {k}, {v}",
                      q or k or v)
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            if self.get(mask) is None and len(shape(mask)) == 4 and shape(mask)[1] != 1:
                self.localize(node, mask, 1, q)  # a per-head mask (ALiBi's biases): this rank's heads
            elif self.get(mask) not in (None, q):
                self.fail(node, f"an attention mask sharded as {self.get(mask)} beside heads sharded as {q}", q)
        return q

    def _cp_attention(self, node):
        """Ring or all-to-all attention over cp (passes/context_parallel.py) on q, k, v whose heads are
        sharded alike over tp: each head's attention is independent, so each tp rank runs its heads' ring
        in its own cp group. The ring's second output, the (B, H, T/cp) log-sum-exps, has the same heads."""
        q, k, v = (self.get(a) for a in node.args[:3])
        if not (q == k == v) or q is None or q.dim != 1 or q.blocks != 1:
            self.fail(node, f"context-parallel attention needs q, k, v sharded alike on the heads dim 1, got "
                      f"{q}, {k}, {v}", q or k or v)
        if len(node.args) > 7 and node.args[7]:  # attention dropout: passes/dropout.py keys it by global heads
            node.meta["parc_shard"] = q
        if node.target is torch.ops.parc.ring_attention.default:
            return [q, q]
        heads, cp = shape(node.args[0])[1], node.args[6]
        if heads // self.tp % cp:
            self.fail(node, f"all-to-all attention scatters this tp rank's heads over cp: {heads} heads / tp "
                      f"{self.tp} = {heads // self.tp} are not divisible by cp {cp}", q,
                      "use ring attention (`context_parallel ring`), or a tp and cp whose product divides the heads")
        return q

    def _linear(self, node):
        """A linear no rule names: fine on a tensor sharded along a row dim (tokens), not on its features.
        On a sequence slice with no sharded layer after it (a replicated lm head), it takes the whole
        sequence, as Megatron's output layer does: the ops after a head (flattening B and T for the loss)
        could not follow a slice anyway, and gathering the hidden state moves H, not V, values per token."""
        s = self.get(node.args[0])
        if any(self.get(a) is not None for a in node.args[1:]):
            self.fail(node, "an unsharded linear uses a sharded weight", s)
        if s.seq and s.blocks == 1 and node not in self.feeds_tp:
            node.replace_input_with(node.args[0], self.gather(node.args[0], node))
            return None
        if s.dim == len(shape(node)) - 1:
            self.fail(node, "its input is sharded along its input features but no `row` rule names it", s,
                      f'add `"{module_path(node)}" : row` to tensor_parallel')
        return s

    def _embedding(self, node):
        s = self.get(node.args[1])
        if self.get(node.args[0]) is not None:
            self.fail(node, "a sharded embedding table without a `vocab` rule", s)
        return s


def _raise(e: ParcError) -> None:
    raise e
