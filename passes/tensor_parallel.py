"""Tensor parallelism (Megatron-style), as a rewrite of the aten-level loss graph.

Start at `run`. The user's model is not changed and no module is swapped: the
pass rewrites the traced graph of each tp rank. It walks the graph once, in
order, giving every value a layout — replicated (None) or a `Shard`
(passes/tp_layouts.py, which also follows shards through views, SDPA, softmax…):

- `column` linear: weight and bias split along output features (a fused qkv is
  split per block, so each rank holds whole heads of q, k and v). Its input must
  be replicated: Megatron's f (`parc.identity_allreduce`: identity forward,
  all-reduce backward) is put in front, or under sequence parallelism an
  all-gather along the sequence (`parc.allgather_reducescatter`).
- `row` linear: weight split along input features; its input must already be
  sharded along its last dim. The partial outputs are summed by g
  (`parc.allreduce_identity`) or reduce-scattered along the sequence
  (`parc.reducescatter_allgather`); the bias is added once, after.
- `vocab` embedding: rows split; ids outside this rank's rows read row 0 and are
  zeroed, then the outputs are summed (or reduce-scattered along the sequence).
- `vocab` linear (the lm head): split like `column`; its logits must reach
  `cross_entropy`, which becomes `parc.vocab_parallel_cross_entropy` (max and
  sum-exp all-reduced): the full logits are never gathered.
- `replicate`: the module stays whole on every rank (the default for any module
  no rule names).

Linears written as matmuls (`x @ w.t() + b`, `addmm(b, x, w.t())`) and HF's
transposed `Conv1D` (`addmm(b, x, w)` with w (in, out)) are first rewritten to
`aten.linear` in the modules a rule names (passes/tp_linears.py); a Conv1D weight is
sharded along its other dim.

Assumes: the graph is `parc.trace`'s (state placeholders, then inputs; output
`(loss,)`) and `meta["val"]` holds the traced (full) shapes.
Guarantees: `ctx.shards` gives each sharded placeholder's slice (`blocks` > 1
for fused projections); view/expand/split constants are local; `meta["val"]`
is re-propagated with local shapes, so a wrong rewrite fails at compile time;
every gradient is complete on every rank that holds it (passes/tp_grads.py: a
replicated value meeting a sharded one gets a Partial gradient, summed per step
for a parameter, `ctx.notes["tp_partial_grads"]`, or by an f before the op).
"""

from __future__ import annotations

import copy
import operator
from fnmatch import fnmatchcase

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import parc.runtime.parallel.ops  # noqa: F401 — registers torch.ops.parc.*
from parc.errors import Diagnostic, ParcError
from parc.passes import tp_gqa, tp_grads
from parc.passes.tp_layouts import SAME_LAYOUT, SDPA, Layouts, Shard, is_param, shape
from parc.passes.tp_shard import reads_only_meta, slice_bounds
from parc.passes.tp_linears import as_linears
from parc.passes.tp_shared import call_site as _call_site, shared_rules
from parc.trace_sizes import refuse_resharding
from parc.traced import module_path

aten = torch.ops.aten
parc_ops = torch.ops.parc
NAME = "tensor_parallel"
SPLIT_OPS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    tp, rules = plan.mesh.tp, plan.tensor_parallel.rules
    if tp == 1 or not rules:
        return gm
    refuse_resharding(gm, "tensor parallelism", plan.tensor_parallel.span or rules[0].span)  # `_local_shapes`
    if not tp_gqa.subset_candidates(gm, plan, tp):
        return _run(gm, plan, ctx, kv_subset=False)
    # fewer kv heads than tp, dividing it: Megatron's kv-subset form (passes/tp_subset.py) first; where the kv
    # head meets an op that form cannot follow (OLMo 2's norm over the whole k width), the layers stay whole
    # (passes/tp_gqa.py), as before that form existed, and the warning says why
    saved = copy.deepcopy(gm), dict(ctx.shards), dict(ctx.rewrites), \
        {k: v if k == "tp_shape_cache" else copy.deepcopy(v) for k, v in ctx.notes.items()}
    try:
        return _run(gm, plan, ctx, kv_subset=True)
    except ParcError as e:
        why = e.diagnostics[0].message
    gm, shards, rewrites, notes = saved
    ctx.shards.clear(), ctx.shards.update(shards), ctx.rewrites.clear(), ctx.rewrites.update(rewrites)
    ctx.notes.clear(), ctx.notes.update(notes)
    ctx.notes["tp_kv_whole_because"] = why
    return _run(gm, plan, ctx, kv_subset=False)


def _run(gm: fx.GraphModule, plan, ctx, kv_subset: bool) -> fx.GraphModule:
    rw = _Rewriter(gm, plan, ctx, kv_subset)
    node = None
    try:
        as_linears(gm, rw)
        rw.start()
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and not node._erased:  # a rule may erase nodes it rewrote (tp_pieces)
                rw.visit(node)
        node = None
        if rw.errors:
            raise ParcError(diagnostics=rw.errors)
        rw.finish()
        gm.graph.eliminate_dead_code()
        ctx.notes["tp_grad_gathers"] = tp_grads.gathers(gm)
        gm.recompile()
        _local_shapes(gm, ctx)
    except ParcError as e:
        if rw.errors and e.diagnostics[0] is not rw.errors[0]:  # a later error: report the widths found before it
            raise ParcError(diagnostics=rw.errors + e.diagnostics) from None
        raise
    except Exception as e:  # noqa: BLE001 — parc's gap, not the user's mistake: still told at the rule
        if rw.errors:  # the walk went on past widths tp does not divide: those explain it
            raise ParcError(diagnostics=rw.errors) from None
        raise rw.internal(getattr(e, "parc_node", node), e) from e
    return gm


class _Rewriter:
    def __init__(self, gm, plan, ctx, kv_subset: bool):
        self.gm, self.plan, self.ctx = gm, plan, ctx
        self.tp, self.rank = plan.mesh.tp, ctx.tp_rank
        self.sp = plan.tensor_parallel.sequence_parallel
        self.lay = Layouts(gm, self.tp, self.rank, self.sp)
        self.lay.indivisible = self.collect
        self.entry: dict[tuple, fx.Node] = {}  # (source, op) → the f / all-gather already made for it
        self.sharded: dict[fx.Node, tuple] = {}  # sharded param placeholder → (its shard spec, the rule, a user)
        self.conv1d: dict[fx.Node, fx.Node] = {}  # `t(w)` made by as_linears for an (in, out) weight → w
        self.implied: dict[fx.Node, object] = {}  # each use of a tied vocab weight → the rule it runs under
        self.kv_subset_ok = kv_subset  # Megatron's kv-subset form for fewer kv heads than tp (`run` decides)
        self.errors: list[Diagnostic] = []  # sizes tp does not divide, one per rule, raised after the walk
        self.seen: set[tuple] = set()  # what those errors are about (see `collect`)

    def start(self) -> None:
        """Before the walk: check parameters with several uses (passes/tp_shared.py), and mark the nodes
        whose values still reach a sharded layer (a replicated head after sequence parallelism is not one)."""
        params = [n for n in self.gm.graph.nodes if is_param(n)]
        self.implied = shared_rules(params, self.rule_for, self.conv1d)
        feeds: set[fx.Node] = set()
        for n in reversed(list(self.gm.graph.nodes)):
            if n.op == "call_function" and (self.shards(n) or any(u in feeds for u in n.users)):
                feeds.add(n)
        self.lay.feeds_tp = feeds

    def shards(self, node: fx.Node) -> bool:
        """Does a column/row/vocab rule apply to this node?"""
        rule = self.rule_at(node)
        return rule is not None and rule.style != "replicate" and any(self.is_weight(a) for a in node.all_input_nodes)

    # --- dispatch -----------------------------------------------------------------

    def rule_for(self, node: fx.Node):
        path = module_path(node)
        return next((r for r in self.plan.tensor_parallel.rules if fnmatchcase(path, r.pattern)), None)

    def rule_at(self, node: fx.Node):
        """The rule a node runs under: its module's, or for a use of a tied vocab weight, the tie's."""
        return self.implied.get(node) or self.rule_for(node)

    def visit(self, node: fx.Node) -> None:
        t = node.target
        if node in self.conv1d:  # the transposed view of a Conv1D weight: sharded with the linear it feeds
            self.lay.of[node] = None
            return
        rule = self.rule_at(node) if any(self.is_weight(a) and not reads_only_meta(node, a)
                                         for a in node.all_input_nodes) else None
        if rule is not None and rule.style != "replicate" and not _handled(node, self.is_weight):
            p = next(a for a in node.all_input_nodes if is_param(a))
            raise ParcError(f"`{rule.style}` on module `{module_path(node)}`: its parameter `{p.name}` is used by "
                            f"`{node.name}` ({getattr(t, '__name__', t)}), which parc cannot shard; parc shards "
                            "`aten.linear` weights/biases and `aten.embedding` tables",
                            rule.span, "write the layer as nn.Linear / F.linear, or mark the module `replicate`")
        at = 0 if t is aten.embedding.default else 1  # where a layer's weight sits (a guard has one argument)
        if rule is not None and len(node.args) > at and self.is_weight(node.args[at]):
            style = rule.style
            if t is aten.embedding.default:
                if style not in ("vocab", "replicate"):
                    raise ParcError(f"`{style}` does not apply to embedding `{module_path(node)}`",
                                    rule.span, "use `vocab` for an embedding")
                if style == "vocab":
                    return self.vocab_embedding(node, rule)
            elif style in ("column", "vocab"):
                return self.column(node, rule)
            elif style == "row":
                return self.row(node, rule)
        logits = self.lay.get(node.args[0]) if node.args else None
        if t is aten.cross_entropy_loss.default and isinstance(logits, Shard) and not logits.seq:
            return self.cross_entropy(node)  # (a sequence slice is gathered by `propagate` instead)
        self.lay.of[node] = self.lay.propagate(node)
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags \
                and any(self.lay.get(a) is not None for a in node.all_input_nodes):
            self.own_stream(node)

    def own_stream(self, node: fx.Node) -> None:
        """A dropout on a sharded value: passes/dropout.py keys its mask by global coordinates, from this shard."""
        t = node.target
        if t is not aten.dropout.default and t not in SDPA:
            return self.lay.fail(node, "a random op on a sharded value: parc keys only dropout and attention "
                                 "dropout by the global position of each element", self.lay.get(node.args[0]))
        s = self.lay.get(node.args[0])
        if isinstance(s, Shard) and s.parts:
            return self.lay.fail(node, "dropout on a kv subset (fewer kv heads than tp): parc keys dropout masks "
                                 "by tp chunks", s, "mark the k and v projections `replicate`")
        if isinstance(s, Shard) and isinstance(s.blocks, tuple):
            return self.lay.fail(node, f"dropout on a fused output of unequal blocks {list(s.blocks)}, before it is "
                                 "split", s)
        node.meta["parc_shard"] = s

    # --- helpers ------------------------------------------------------------------

    def is_weight(self, a) -> bool:
        return is_param(a) or a in self.conv1d

    def shard_weight(self, node: fx.Node, w: fx.Node, dim: int, rule, blocks: int | tuple = 1) -> None:
        """Shard a linear's (out, in) weight along `dim`; a Conv1D weight w (in, out), seen as `t(w)`, along 1 - dim."""
        if w in self.conv1d:
            return self.shard_param(self.conv1d[w], w, 1 - dim, rule, blocks)
        self.shard_param(w, node, dim, rule, blocks)

    def call(self, before: fx.Node, op, args, like: fx.Node, layout=None) -> fx.Node:
        with self.gm.graph.inserting_before(before):
            n = self.gm.graph.call_function(op, tuple(args))
        n.meta["val"] = like.meta["val"]
        n.meta["nn_module_stack"] = before.meta.get("nn_module_stack")
        self.lay.of[n] = layout
        self.ctx.count(NAME)
        return n

    def indivisible(self, rule, message: str, hint: str) -> None:
        """A size tp does not divide: collected, not raised, so that the walk goes on and one compile names
        every rule with such a size (once per rule and kind: each layer repeats its blocks' sizes)."""
        self.collect(Diagnostic(message, rule.span, hint, "error", self.plan.source or None))

    def collect(self, d) -> None:
        """Keep `d` (a Diagnostic or the ParcError carrying one) unless an error says the same already."""
        d = d.diagnostics[0] if isinstance(d, ParcError) else d
        # a rule's first size error, and the sequence length once (every layer's tokens are the same tokens)
        key = ("tokens",) if d.message.startswith("sequence_parallel") else ("size", d.span)
        if key not in self.seen:
            self.seen.add(key)
            self.errors.append(d)

    def shard_param(self, p: fx.Node, user: fx.Node, dim: int, rule, blocks: int | tuple = 1) -> None:
        full = shape(p)[dim]
        if isinstance(blocks, tuple):  # a fused output split into unequal widths: each split by tp
            if any(b % self.tp for b in blocks):
                self.indivisible(rule, f"`{rule.style}` on `{module_path(user)}`: {p.meta.get('parc_fqn', p.name)} "
                                 f"dim {dim} is fused from blocks {list(blocks)}, not each divisible by tp {self.tp}",
                                 "use a tp that divides every block (grouped-query attention: the kv heads), or "
                                 f"mark `{module_path(user)}` `replicate`")
        elif full % (self.tp * blocks):
            what = f"{blocks} blocks × tp {self.tp}" if blocks > 1 else f"tp {self.tp}"
            self.indivisible(rule, f"`{rule.style}` on `{module_path(user)}`: {p.meta.get('parc_fqn', p.name)} dim "
                             f"{dim} has size {full}, not divisible by {what} = {self.tp * blocks}",
                             f"use a tp that divides {full // blocks}")
        spec = {"dim": dim, "parts": self.tp, "index": self.rank}
        if blocks != 1:
            spec["blocks"] = list(blocks) if isinstance(blocks, tuple) else blocks
        if p in self.sharded and self.sharded[p][0] != spec:  # two uses of a tied weight that disagree
            _, first, other = self.sharded[p]
            raise ParcError(f"`{rule.style}` on `{module_path(user)}` shards {p.meta.get('parc_fqn', p.name)} as "
                            f"{spec}, but `{module_path(other)}` (rule `{first.style}`) shards it as "
                            f"{self.sharded[p][0]}", rule.span, "give the two uses the same rule, or untie them")
        self.ctx.shards[p.name] = spec
        self.sharded.setdefault(p, (spec, rule, user))  # the first use: the one a later use is compared with

    def replicated_input(self, node: fx.Node, x: fx.Node, rule) -> fx.Node:
        """The column layer's input made replicated: f, or an all-gather of a sequence slice."""
        s = self.lay.get(x)
        if s is None:
            key, op, args = (x, "f"), parc_ops.identity_allreduce.default, (x, "tp")
        elif s.seq:
            key, op, args = (x, "gather"), parc_ops.allgather_reducescatter.default, (x, "tp", s.dim, self.tp)
        else:
            origin = f' (by rule "{s.rule.pattern}")' if s.rule is not None else ""
            hint = "a column layer needs a replicated input: mark the layer before it `row`"
            first = next((use for q in node.all_input_nodes for _, r, use in [self.sharded.get(q, (None,) * 3)]
                          if r is not None and r.pattern == rule.pattern and use is not node), None)
            if first is not None:  # its own output, from an earlier call: name the two calls, not the module twice
                origin = (f" by its own earlier call: `{module_path(node)}` is called at {_call_site(first)} and "
                          f"again at {_call_site(node)}")
                hint = "a module called more than once cannot be `column`: mark it `replicate`, or give each call " \
                       "its own module"
            raise ParcError(f"`{rule.style}` layer `{module_path(node)}` gets an input already sharded on dim "
                            f"{s.dim}{origin}", rule.span, hint)
        if key not in self.entry:
            full = x.meta["val"]
            self.entry[key] = self.call(node, op, args, x)
            if s is not None:  # the gathered value has the full shape
                self.entry[key].meta["val"] = full
        return self.entry[key]

    def reduce_output(self, node: fx.Node, after: fx.Node, rule) -> tuple[fx.Node, object]:
        """Sum partial outputs over tp: g, or a reduce-scatter along the sequence (dim -2, the tokens)."""
        users = list(after.users)
        if self.sp:
            dim = len(shape(after)) - 2
            if dim < 0:
                raise ParcError(f"sequence_parallel: `{module_path(node)}` output {shape(after)} has no token dim",
                                rule.span, "drop sequence_parallel")
            if shape(after)[dim] % self.tp:
                self.indivisible(rule, f"sequence_parallel: `{module_path(node)}` output {shape(after)} has "
                                 f"{shape(after)[dim]} tokens on dim {dim}, not divisible by tp {self.tp}",
                                 "use a sequence length that divides by tp")
            op, args, layout = parc_ops.reducescatter_allgather.default, (after, "tp", dim, self.tp), \
                Shard(dim, 1, True, rule)
        else:
            op, args, layout = parc_ops.allreduce_identity.default, (after, "tp"), None
        nxt = after.next
        red = self.call(nxt, op, args, after, layout)
        red.meta["nn_module_stack"] = node.meta.get("nn_module_stack")  # node's, not the next one's (ep regions)
        for u in users:
            u.replace_input_with(after, red)
        return red, layout

    # --- rules --------------------------------------------------------------------

    def column(self, node: fx.Node, rule) -> None:
        x, w, *rest = node.args
        b = rest[0] if rest else None
        blocks = _fused_blocks(node)
        heads = tp_gqa.heads_below_tp(node, self.tp) if rule.style == "column" and blocks == 1 else None
        if heads is not None and self.tp % heads == 0 and w not in self.conv1d and self.kv_subset_ok:
            return self.kv_subset(node, rule, x, w, b, heads)
        if heads is not None:
            return self.auto_replicate(node, rule, w, heads)
        self.shard_weight(node, w, 0, rule, blocks)
        if isinstance(b, fx.Node):
            self.shard_param(b, node, 0, rule, blocks)
        node.replace_input_with(x, self.replicated_input(node, x, rule))
        self.lay.of[node] = Shard(len(shape(node)) - 1, blocks, False, rule)
        self.ctx.count(NAME)

    def kv_subset(self, node: fx.Node, rule, x: fx.Node, w: fx.Node, b, heads: int) -> None:
        """k/v with `heads` kv heads, fewer than tp and dividing it (Megatron's form, passes/tp_subset.py):
        the weight (and bias) stays whole, and rank r computes only the rows of kv head r // (tp / heads),
        the one its q heads use. The output is a kv subset; the weight's gradient, this rank's q heads'
        share, is summed over tp once a step (passes/tp_grads.py), the input's by the column f."""
        c, rows = self.rank // (self.tp // heads), shape(w)[0] // heads
        for p in (w, b):
            if isinstance(p, fx.Node):
                part = self.call(node, aten.slice.Tensor, (p, 0, c * rows, (c + 1) * rows), p,
                                 Shard(0, 1, False, rule, parts=heads))
                node.replace_input_with(p, part)
        node.replace_input_with(x, self.replicated_input(node, x, rule))
        self.lay.of[node] = Shard(len(shape(node)) - 1, 1, False, rule, parts=heads)
        self.note_kv(node, rule, w, heads, "kv_subset", 1)

    def note_kv(self, node: fx.Node, rule, w: fx.Node, heads: int, form: str, per_rank: int) -> None:
        """plan.json `tp_auto_replicated` (each k/v layer with fewer heads than tp, the kv heads each rank
        computes) and one `parc check` warning per rule."""
        path, w = module_path(node), self.conv1d.get(w, w)
        notes = self.ctx.notes.setdefault("tp_auto_replicated", [])
        notes.append({"module": path, "param": w.name, "rule": rule.pattern, "heads": heads, "tp": self.tp,
                      "form": form, "heads_per_rank": per_rank, "numel": int(w.meta["val"].numel()),
                      # the whole layer's forward and backward (data and weight gradients) matmuls per
                      # micro-batch, 3 × 2·tokens·in·out; a rank runs heads_per_rank / heads of it
                      "flops": 6 * int(node.meta["val"].numel()) * shape(node.args[0])[-1]})
        if sum(r["rule"] == rule.pattern for r in notes) == 1:  # one warning per rule: plan.json lists every layer
            self.ctx.notes.setdefault("tp_warnings", []).append(
                tp_gqa.warning(path, rule, heads, self.tp, self.plan.source or None, form,
                               self.ctx.notes.get("tp_kv_whole_because")))

    def auto_replicate(self, node: fx.Node, rule, w: fx.Node, heads: int) -> None:
        """k/v with fewer heads than tp: the layer runs whole, as under `replicate` (passes/tp_gqa.py), and
        the plan says so (a warning for `parc check`, `tp_auto_replicated` in plan.json for the report)."""
        self.lay.of[node] = self.lay.propagate(node)
        self.note_kv(node, rule, w, heads, "whole", heads)

    def row(self, node: fx.Node, rule) -> None:
        x, w, *rest = node.args
        b = rest[0] if rest else None
        s, last = self.lay.get(x), len(shape(x)) - 1
        if s is None or s.dim != last or s.blocks != 1:
            got = "replicated" if s is None else f"sharded on dim {s.dim}" + (f" in {s.blocks} blocks" if s.blocks > 1 else "")
            raise ParcError(f"`row` layer `{module_path(node)}` needs its input sharded along its last dim "
                            f"(features), but `{x.name}` is {got}", rule.span,
                            "make the layer that feeds it `column` (Megatron pairs column → row), "
                            "or mark this one `column`/`replicate`")
        self.shard_weight(node, w, 1, rule)
        node.args = (x, w)  # the bias is added once, after the reduction
        self.lay.of[node] = "partial"
        red, layout = self.reduce_output(node, node, rule)
        if isinstance(b, fx.Node):
            users = list(red.users)
            add = self.call(red.next, aten.add.Tensor, (red, b), red, layout)
            add.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
            for u in users:
                u.replace_input_with(red, add)
        self.ctx.count(NAME)

    def vocab_embedding(self, node: fx.Node, rule) -> None:
        w, ids = node.args[0], node.args[1]
        if self.lay.get(ids) is not None:
            raise ParcError(f"`vocab` embedding `{module_path(node)}` gets sharded ids", rule.span)
        if len(node.args) > 3 and node.args[3]:  # the counts would see every other rank's id as row 0
            raise ParcError(f"`vocab` embedding `{module_path(node)}` has scale_grad_by_freq=True; parc does not "
                            "shard those", rule.span, f"mark `{module_path(node)}` `replicate`")
        self.shard_param(w, node, 0, rule)
        rows = shape(w)[0] // self.tp  # this rank owns ids [start, start + rows)
        start = self.rank * rows
        pad = node.args[2] if len(node.args) > 2 else -1
        if pad not in (-1, None):  # padding_idx only zeroes that row's gradient: the row's owner keeps it, locally
            pad %= shape(w)[0]
            pad = pad - start if start <= pad < start + rows else -1
            node.args = (*node.args[:2], pad, *node.args[3:])
        local = self.call(node, aten.sub.Tensor, (ids, start), ids)
        below = self.call(node, aten.lt.Scalar, (local, 0), ids)
        above = self.call(node, aten.ge.Scalar, (local, rows), ids)
        outside = self.call(node, aten.bitwise_or.Tensor, (below, above), ids)
        safe = self.call(node, aten.masked_fill.Scalar, (local, outside, 0), ids)
        node.args = (w, safe, *node.args[2:])
        users = list(node.users)
        mask = self.call(node.next, aten.unsqueeze.default, (outside, -1), ids)
        zeroed = self.call(mask.next, aten.masked_fill.Scalar, (node, mask, 0.0), node, "partial")
        # the embedding's own, not the next node's module (a recomputed layer that reads the embedding next
        # would otherwise own the mask, and the all-reduce between them would cut its region in two)
        for n in (mask, zeroed):
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack")
        for u in users:
            u.replace_input_with(node, zeroed)
        self.lay.of[node] = "partial"
        self.reduce_output(node, zeroed, rule)

    def cross_entropy(self, node: fx.Node) -> None:
        logits, target = node.args[:2]
        s = self.lay.get(logits)
        rest = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), node.args[2:]), **node.kwargs)
        n = len(shape(logits))
        reduction = rest.get("reduction", 1)  # 2 (sum): the cp pass's per-rank share of a mean
        if s.dim != n - 1 or s.blocks != 1 or n != 2 or rest.get("weight") is not None \
                or reduction not in (1, 2) or rest.get("label_smoothing", 0.0):
            self.lay.fail(node, "vocab-parallel cross-entropy needs (N, V) logits sharded along V, mean (or "
                          "sum) reduction, no class weights and no label smoothing", s)
        rows = shape(logits)[1] // self.tp
        loss = self.call(node, parc_ops.vocab_parallel_cross_entropy.default,
                         (logits, target, "tp", self.rank * rows, rest.get("ignore_index", -100), reduction), node)
        loss.meta["val"] = (node.meta["val"], logits.meta["val"])
        first = self.call(node, operator.getitem, (loss, 0), node)
        node.replace_all_uses_with(first)
        self.gm.graph.erase_node(node)

    # --- the end --------------------------------------------------------------------

    def finish(self) -> None:
        """Complete every gradient: a replicated value meeting a sharded one has a Partial (summed over tp)
        gradient, summed per step for a parameter or by an f before the op (passes/tp_grads.py)."""
        tp_grads.complete(self.gm, self.lay, self.ctx.shards, self.ctx, lambda: self.ctx.count(NAME))

    def internal(self, node: fx.Node | None, e: Exception) -> ParcError:
        """An unexpected failure while rewriting `node`, as a diagnostic at the rule most likely behind it."""
        rule = self.blame(node) if node is not None else None
        rules = self.plan.tensor_parallel.rules
        span = rule.span if rule is not None else (self.plan.tensor_parallel.span or rules[0].span)
        where = f" `{node.name}` ({getattr(node.target, '__name__', node.target)}) in module " \
                f"`{module_path(node) or '<top level>'}`" if node is not None else ""
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return ParcError(f"tensor parallelism: parc could not shard{where}: {type(e).__name__}: {first}", span,
                         "a case parc's tensor parallelism does not handle yet: mark the modules around it "
                         "`replicate` (or shard fewer modules), and please report it")

    def blame(self, node: fx.Node):
        """The rule behind `node`'s sharded inputs: the nearest sharded value or sharded layer upstream."""
        seen, todo = set(), [node]
        while todo:
            n = todo.pop(0)
            if n in seen or not isinstance(n, fx.Node):
                continue
            seen.add(n)
            s = self.lay.get(n)
            for one in s if isinstance(s, list) else [s]:
                if isinstance(one, Shard) and one.rule is not None:
                    return one.rule
            if n in self.sharded:
                return self.sharded[n][1]
            if n.op == "call_function" and self.shards(n):
                return self.rule_at(n)
            todo.extend(n.all_input_nodes)
        return None


def _handled(node: fx.Node, is_weight) -> bool:
    """A node whose parameter inputs sit where a rule can shard them: a linear's weight (and bias), an embedding table."""
    params = [i for i, a in enumerate(node.args) if is_weight(a)]
    if node.target is aten.linear.default:
        return bool(params) and params[0] == 1 and not any(is_param(v) for v in node.kwargs.values())
    return node.target is aten.embedding.default and params == [0]


def _fused_blocks(node: fx.Node) -> int | tuple[int, ...]:
    """How a fused linear's output (q, k, v or gate, up side by side) is cut along its features: k when
    it is only split into k equal pieces, the pieces' widths when they differ (grouped-query attention's
    q, k, v), as a split or as slices that tile the features (Phi-3's `qkv_proj`); else 1."""
    users, last = list(node.users), len(shape(node)) - 1
    later = _split_later(node, last)
    if later is not None:
        u, features = later
        dim = (u.args[2] if len(u.args) > 2 else 0) % len(shape(u.args[0]))
        pieces = [tuple(v.shape)[dim] for v in u.meta["val"]]
        if dim != features:
            return 1
        dim = last
    elif len(users) > 1 and all(u.target is aten.slice.Tensor for u in users):
        runs = sorted(_slice_range(u, last) for u in users)
        if any(lo < 0 for lo, _ in runs) or runs[0][0] != 0 or runs[-1][1] != shape(node)[last] \
                or any(a[1] != b[0] for a, b in zip(runs, runs[1:])):
            return 1
        dim, pieces = last, [hi - lo for lo, hi in runs]
    else:
        return 1
    if dim != last or len(pieces) < 2:
        return 1
    return len(pieces) if len(set(pieces)) == 1 else tuple(pieces)


def _split_later(node: fx.Node, dim: int) -> tuple[fx.Node, int] | None:
    """The split a fused output reaches through a chain of single-user ops that keep each feature in place
    (Qwen3.5's `in_proj_qkv(x).transpose(1, 2)`, a depthwise causal `conv1d`, its `[:, :, :T]` slice, an
    activation, the transpose back, then `split([kd, kd, vd])`), with the features' dim there; else None."""
    n = node
    for _ in range(16):
        users = [u for u in n.users if u.target is not aten._assert_tensor_metadata.default]  # `.to(dtype)`'s check
        if len(users) != 1:
            return None
        u = users[0]
        if u.target in SPLIT_OPS:
            return u, dim
        if u.args[0] is not n or len([a for a in u.all_input_nodes if a is n]) != 1:
            return None
        rank = len(shape(n))
        if u.target is aten.transpose.int:
            d0, d1 = u.args[1] % rank, u.args[2] % rank
            dim = d1 if dim == d0 else d0 if dim == d1 else dim
        elif u.target is aten.conv1d.default:
            if dim != 1 or (u.args[6] if len(u.args) > 6 else 1) != shape(n)[1]:
                return None  # only a depthwise conv keeps each channel in place
        elif u.target is aten.slice.Tensor:
            if slice_bounds(u)[0] == dim:
                return None
        elif not (u.target in SAME_LAYOUT or (isinstance(u.target, torch._ops.OpOverload)
                                               and torch.Tag.pointwise in u.target.tags
                                               and len(u.all_input_nodes) == 1)):
            return None
        n = u
    return None


def _slice_range(u: fx.Node, last: int) -> tuple[int, int]:
    """[lo, hi) of a step-1 `slice` along the last dim; (-1, -1) for any other slice."""
    dim, lo, hi, step = slice_bounds(u)
    if dim != last or step != 1 or not (isinstance(lo, int) and isinstance(hi, int)):
        return -1, -1
    return lo, hi


def _local_shapes(gm: fx.GraphModule, ctx) -> None:
    """Give every node its local shape. The tp ranks' rewritten graphs differ only in shard indices and
    vocab offsets, which change no shape, so when the compiler shares `ctx.notes["tp_shape_cache"]`
    across the ranks of one compile, the first rank's propagated shapes are reused by the others
    (checked: same nodes, same ops, same shard dims), saving one fake-tensor run of the whole graph per rank."""
    cache = ctx.notes.get("tp_shape_cache")
    nodes = list(gm.graph.nodes)
    key = (tuple((n.name, str(n.target)) for n in nodes),
           tuple(sorted((k, v["dim"], v["parts"], v.get("blocks", 1)) for k, v in ctx.shards.items() if v)))
    if cache is not None and cache.get("key") == key:
        for n, val in zip(nodes, cache["vals"]):
            if val is not None:
                n.meta["val"] = val
        return
    _propagate_local_shapes(gm, ctx)
    if cache is not None:
        cache.update(key=key, vals=[n.meta.get("val") for n in nodes])


def _propagate_local_shapes(gm: fx.GraphModule, ctx) -> None:
    """Re-run shapes with this rank's local placeholders; a wrong rewrite raises here, at compile time,
    with the node it failed at (`run` turns that into a diagnostic at the rule behind the node)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    with mode:
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            v = n.meta["val"]
            local = list(v.shape)
            spec = ctx.shards.get(n.name)
            if spec is not None:
                local[spec["dim"]] //= spec["parts"]
            args.append(torch.empty(local, dtype=v.dtype, device="cpu", requires_grad=v.requires_grad))
    prop = _NodeProp(gm, mode)
    try:
        prop.propagate_dont_convert_inputs(*args)
    except Exception as e:  # noqa: BLE001 — a shape the rewrite got wrong: parc's bug, reported at its node
        e.parc_node = prop.current
        raise


class _NodeProp(FakeTensorProp):
    """FakeTensorProp that remembers the node it is running, to say where a local shape went wrong."""

    current: fx.Node | None = None

    def run_node(self, n: fx.Node):
        self.current = n
        return super().run_node(n)
