"""Grouped- and multi-query attention with fewer kv heads than tp (used by passes/tensor_parallel.py).

Start at `heads_below_tp`. A `column` rule on k_proj / v_proj splits their output features by tp; with
kv heads < tp a rank would hold a fraction of one head, which no later op can use exactly (RoPE
rotates pairs across the head, the repeat to q's heads needs whole heads). Two exact answers:

- when tp is a multiple of the kv heads, Megatron's: each rank computes only the kv head its q heads use
  (passes/tp_subset.py), the weight stored whole and its gradient summed over tp once a step;
- otherwise (or where the kv-subset form cannot follow the kv head: a norm over all kv heads' width), the
  one a `replicate` rule on the k/v projections gives: the layer stays whole on every rank, its heads are
  repeated to q's count as the model writes, and each rank keeps its own q heads' share of the repeated k
  and v at attention (passes/tp_layouts.py `_sdpa`, `parc.split_allgather`, whose backward all-gathers the
  gradient so the whole layer's gradient is complete on every rank).

The pass applies them by itself, so a plan written for many kv heads (or derived from a family's own
tp plan) also runs on a model with few. It says so: `parc check` prints a warning at the rule,
plan.json lists the layers (`programs.*.tp_auto_replicated`, with the form), and `parc report` prices
what it costs (parc/analysis/tp_grad_sums.py): the layer's matmul beyond 1/tp on every rank, and the
per-step sum of the weight's gradient (kv subset) or the all-gather of the repeated k or v's gradient
per micro-batch (whole).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.passes.tp_layouts import RESHAPES, SDPA, _groups
from parc.passes.tp_shard import shape

aten = torch.ops.aten
STOP = SDPA | {aten.linear.default, aten.matmul.default, aten.bmm.default, aten.einsum.default,
               aten.embedding.default}


def heads_below_tp(linear: fx.Node, tp: int) -> int | None:
    """The number of heads `linear`'s output is split into, when it is below tp; else None.

    Follows the output through ops that keep its last dim (casts, norms over the width, elementwise
    ops) to the first reshape that splits that dim alone into (..., heads, head_dim), as
    `k_proj(x).view(B, T, -1, head_dim)` does."""
    width = shape(linear)[-1]
    seen, todo = {linear}, [linear]
    while todo:
        n = todo.pop(0)
        for u in n.users:
            if u in seen or u.op != "call_function" or u.target in STOP:
                continue
            seen.add(u)
            val = u.meta.get("val")
            if not isinstance(val, torch.Tensor) or val.dim() == 0:
                continue
            if u.target in RESHAPES and u.args[0] is n:
                heads = _split_heads(shape(n), shape(u))
                if heads is not None:
                    return heads if heads < tp else None
                continue
            if shape(u)[-1] == width:
                todo.append(u)
    return None


def _split_heads(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The heads of a reshape that splits a's last dim alone into (heads, head_dim); None for any other."""
    last = len(a) - 1
    for gi, go in _groups(a, b):
        if gi == [last] and len(go) >= 2:
            heads = 1
            for k in go[:-1]:
                heads *= b[k]
            return heads
    return None


def subset_candidates(gm: fx.GraphModule, plan, tp: int) -> bool:
    """Does a `column` rule name a layer (an `aten.linear`, or a matmul of a parameter that passes/tp_linears.py
    will make one) whose output splits into fewer heads than tp, dividing it: the kv-subset form's layers?"""
    from fnmatch import fnmatchcase

    from parc.passes.tp_shard import is_param
    from parc.traced import module_path

    columns = [r.pattern for r in plan.tensor_parallel.rules if r.style == "column"]
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.linear.default, aten.matmul.default, aten.mm.default,
                                                       aten.addmm.default):
            continue
        if not any(is_param(a) or any(is_param(b) for b in a.all_input_nodes) for a in n.all_input_nodes):
            continue
        if any(fnmatchcase(module_path(n), c) for c in columns) and isinstance(n.meta.get("val"), torch.Tensor):
            heads = heads_below_tp(n, tp)
            if heads is not None and tp % heads == 0:
                return True
    return False


def warning(path: str, rule, heads: int, tp: int, source: str | None, form: str = "whole",
            because: str | None = None):
    """The `parc check` line for a k/v layer with fewer heads than tp: its kv-subset form (passes/tp_subset.py)
    or kept whole on every rank (`because`: why the kv-subset form did not apply, when it was tried)."""
    from parc.errors import Diagnostic

    many = f"{heads} head{'s' if heads > 1 else ''}"
    if form == "kv_subset":
        what = (f"each tp rank computes only the kv head its q heads use (Megatron's form: {tp // heads} ranks a "
                "head), with the weight stored whole and its gradient summed over tp once a step (plan.json "
                "`tp_auto_replicated`, `tp_partial_grads`; costs one head's matmul per rank and the weight's "
                "all-reduce per step)")
    else:
        what = ("parc keeps it (and each layer of this rule with as few heads: plan.json `tp_auto_replicated`) "
                "whole on every tp rank, and each rank uses its q heads' share of the repeated heads (exact; costs "
                "the layer's full matmul per rank and an all-gather of its repeated output's gradient per "
                "micro-batch)")
        if because:
            what += f"; the kv-subset form (one kv head a rank) stopped at: {because}"
    return Diagnostic(f"`{rule.style}` on `{path}`: its output has {many}, fewer than tp {tp}; {what}", rule.span,
                      "mark these layers `replicate` to say so in the plan, or use a tp that divides the kv heads",
                      "warning", source)
