"""Gradient placements under tensor parallelism (used by passes/tensor_parallel.py, after its walk).

Start at `complete`. The forward walk gives every value a layout: replicated (None) or sharded
(a `Shard`, a list of them for a split, or "partial" before a row layer's sum). This module proves
that every gradient the backward computes is *complete* on every rank that holds the value, and
inserts the reductions that make it so. The rule it rests on is DTensor's and Megatron's:

    An op whose output is sharded computes, on each tp rank, only its slice of the output. A
    replicated input x of that op, which carries a gradient, therefore receives on each rank only
    the slice's share of dL/dx: the full gradient is the **sum over tp** (a Partial(sum) placement).

Every other edge keeps gradients complete: an op with replicated inputs and a replicated output
runs the same full computation on every rank; an op with sharded inputs gives each input the
gradient of its own slice; parc's collectives (runtime/parallel/ops.py) are written with their backward
(Megatron's f all-reduces, an all-gather's backward reduce-scatters, …). So the Partial edges are
exactly the (replicated value → op with sharded output) edges that are not a parc collective,
and completing each one makes every gradient complete, by induction over the backward.

Each Partial edge is completed in one of two ways:

- a **parameter** all of whose uses are Partial edges (a q/k norm's weight on head-sharded
  values; a LayerNorm weight on a sequence slice) is listed in `ctx.notes["tp_partial_grads"]`: the
  runtime sums its accumulated gradient over tp once per step (runtime/parallel/tensor_parallel.py);
- any other value (an activation; a parameter used both on sharded and on replicated values) gets
  Megatron's f (`parc.identity_allreduce`: identity forward, all-reduce of the gradient backward)
  between it and the op, so that edge's share is summed before it meets the complete shares.

`ctx.notes["tp_grad_reductions"]` lists what was inserted (plan.json; `parc report` prices it).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.passes.tp_layouts import Shard, is_param
from parc.passes.tp_rows import Rows
from parc.passes.tp_shard import reads_only_meta
from parc.traced import module_path

aten = torch.ops.aten
parc_ops = torch.ops.parc

# a view or cast of a parameter is still that parameter: its uses are the parameter's uses
PARAM_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default, aten.mT.default,
               aten._to_copy.default, aten.to.dtype,
               aten.view.default, aten.reshape.default, aten.alias.default, aten.expand.default,
               aten.unsqueeze.default}
# ops through which no gradient flows (their output does not depend differentiably on the input)
NO_GRAD = {aten.detach.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
           aten.full_like.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
           aten.new_full.default, aten._assert_tensor_metadata.default, aten.sym_size.int}
# parc ops whose backward sums the gradient over tp: Megatron's f, and the all-gather of a sequence slice
# before a column layer (its backward reduce-scatters)
SUMMING = {parc_ops.identity_allreduce.default, parc_ops.allgather_reducescatter.default}


def sharded(layout) -> bool:
    """Does a value with this layout hold, on each tp rank, only a part of the full value?"""
    if isinstance(layout, (list, tuple)):
        return any(sharded(x) for x in layout)
    return isinstance(layout, (Shard, Rows)) or layout == "partial"


def _floating(val) -> bool:
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    return isinstance(val, (list, tuple)) and any(_floating(v) for v in val)


def carries_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value the loss is differentiated through: the parameters and everything
    computed from them in floating point, except through ops that pass no gradient."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if is_param(n) and isinstance(val, torch.Tensor) and val.requires_grad:
                out.add(n)
        elif n.op == "call_function" and n.target not in NO_GRAD and _floating(n.meta.get("val")) \
                and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _root_param(a: fx.Node) -> fx.Node | None:
    """The parameter `a` is a view or cast of (or `a` itself), else None."""
    while not is_param(a):
        if a.op != "call_function" or a.target not in PARAM_VIEWS or len(a.all_input_nodes) != 1:
            return None
        a = a.all_input_nodes[0]
    return a


def _uses(p: fx.Node) -> list[tuple[fx.Node, fx.Node]]:
    """Each (value, op) edge computing with parameter `p`, looking through its views and casts."""
    out, todo = [], [p]
    while todo:
        v = todo.pop()
        for u in v.users:
            if u.op == "call_function" and u.target in PARAM_VIEWS and len(u.all_input_nodes) == 1:
                todo.append(u)
            else:
                out.append((v, u))
    return out


def complete(gm: fx.GraphModule, lay, shards: dict, ctx, count=lambda: None) -> None:
    """Find every Partial gradient edge of the rewritten graph and complete it (module docstring)."""
    grad = carries_grad(gm)
    for n in gm.graph.nodes:  # the tp pass's own f's: their backward sums, so every user must be a Partial one
        if n.target in SUMMING and not all(sharded(lay.get(u)) for u in n.users):
            raise AssertionError(f"`{n.name}` sums its gradient over tp but feeds a replicated op: "
                                 f"{[u.name for u in n.users if not sharded(lay.get(u))]}")

    def partial_edge(a: fx.Node, u: fx.Node) -> bool:
        if a not in grad or lay.get(a) is not None:
            return False  # no gradient, or a sharded value (its slice's gradient is its own)
        p = _root_param(a)
        if p is not None and shards.get(p.name):
            return False  # a weight shard, or a view of one (a Conv1D weight's `t`): sharded storage
        if a.target in SUMMING:
            return False  # already summed over tp by its own backward (checked above)
        if u.op != "call_function" or getattr(u.target, "namespace", None) == "parc":
            return False  # parc's collectives carry their own backward (runtime/parallel/ops.py)
        if reads_only_meta(u, a):
            return False  # only its dtype or shape is read: no gradient
        return sharded(lay.get(u))

    edges = [(a, u) for u in gm.graph.nodes if u.op == "call_function"
             for a in dict.fromkeys(u.all_input_nodes) if partial_edge(a, u)]
    by_param: dict[fx.Node, list] = {}
    for a, u in edges:
        p = _root_param(a)
        if p is not None:
            by_param.setdefault(p, []).append((a, u))
    step_sums = [p for p, es in by_param.items() if set(es) == set(_uses(p))]
    summed = {e for p in step_sums for e in by_param[p]}
    reductions = [{"param": p.meta.get("parc_fqn", p.name), "how": "per step", "numel": _numel(p),
                   "module": module_path(by_param[p][0][1])} for p in step_sums]
    made: dict[fx.Node, fx.Node] = {}  # value → its f, shared by the value's Partial edges
    for a, u in edges:
        if (a, u) in summed:
            continue
        if a not in made:  # before its first Partial use (edges are in graph order)
            with gm.graph.inserting_before(u):
                f = gm.graph.call_function(parc_ops.identity_allreduce.default, (a, "tp"))
            f.meta["val"] = a.meta["val"]
            f.meta["nn_module_stack"] = u.meta.get("nn_module_stack")
            lay.of[f] = None
            made[a] = f
            p = _root_param(a)
            reductions.append({"value": a.name if p is None else p.meta.get("parc_fqn", p.name),
                               "how": "per micro-batch", "numel": _numel(a), "module": module_path(u)})
            count()
        u.replace_input_with(a, made[a])
    ctx.notes["tp_partial_grads"] = [p.name for p in step_sums]
    ctx.notes["tp_grad_reductions"] = reductions


def gathers(gm: fx.GraphModule) -> list[dict]:
    """Each replicated value that keeps this rank's chunk (`parc.split_allgather`) and carries a gradient:
    its backward all-gathers that gradient over tp, once per micro-batch (plan.json `tp_grad_gathers`,
    priced by `parc report`)."""
    grad = carries_grad(gm)
    return [{"value": _label(n.args[0]), "numel": _numel(n.args[0]), "module": module_path(n), "node": n.name}
            for n in gm.graph.nodes if n.target is parc_ops.split_allgather.default and n.args[0] in grad]


def _label(a: fx.Node) -> str:
    p = _root_param(a)
    return a.name if p is None else p.meta.get("parc_fqn", p.name)


def _numel(n: fx.Node) -> int:
    val = n.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0
