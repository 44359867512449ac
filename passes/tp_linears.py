"""Linears not written as nn.Linear, made `aten.linear` so the tp rules can shard them (used by
passes/tensor_parallel.py).

Start at `as_linears`. Only in the modules a column/row/vocab rule names (the other modules' programs are
unchanged): `x @ w.t() (+ b)` and `addmm(b, x, w.t())` of an (out, in) parameter, and HF's transposed
`Conv1D`, `addmm(b, x, w)` of an (in, out) parameter, whose weight is then sharded along its other dim.

Assumes: the traced graph, `meta["val"]` holding full shapes. Guarantees: each rewrite computes the same
values; `rw.conv1d` maps each `t(w)` made for a Conv1D weight to w.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.passes.tp_layouts import VIEWS, is_param, shape

aten = torch.ops.aten
NAME = "tensor_parallel"


# `w.t()`, `w.transpose(0, 1)`, `w.permute(1, 0)`, and on a 2-D weight `w.T` / `w.mT` (Falcon's `x @ w.T`)
TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default, aten.numpy_T.default, aten.mT.default}
MATMULS = {aten.matmul.default, aten.mm.default, aten.addmm.default}


def as_linears(gm: fx.GraphModule, rw) -> None:
    """Rewrite `x @ w.t() (+ b)` in a module a column/row/vocab rule names into `aten.linear(x, w, b)`, which
    the rules shard: matmul/mm/addmm of a transposed (out, in) parameter, with a following bias add folded in.
    Modules no such rule names keep their ops (their programs are unchanged)."""
    for wt in [n for n in gm.graph.nodes if n.target in TRANSPOSES and is_param(n.args[0])]:
        w, users = wt.args[0], list(wt.users)
        rule = rw.rule_for(wt)
        if rule is None or rule.style == "replicate" or len(users) != 1 or len(shape(w)) != 2 \
                or (wt.target is aten.transpose.int and sorted(a % 2 for a in wt.args[1:3]) != [0, 1]) \
                or (wt.target is aten.permute.default and [a % 2 for a in wt.args[1]] != [1, 0]):  # not (0, 1)
            continue
        mm = users[0]
        if mm.target not in MATMULS or mm.args[-1] is not wt or len(mm.args) != (3 if mm.target is aten.addmm.default else 2) \
                or mm.kwargs:
            continue
        x, b = (mm.args[1], mm.args[0]) if mm.target is aten.addmm.default else (mm.args[0], None)
        out = mm
        adds = list(mm.users)
        if b is None and len(adds) == 1 and adds[0].target is aten.add.Tensor and adds[0].args[0] is mm \
                and is_param(adds[0].args[1]) and shape(adds[0].args[1]) == (shape(w)[0],) and not adds[0].kwargs:
            b, out = adds[0].args[1], adds[0]  # the bias add of `x @ w.t() + b`
        with gm.graph.inserting_before(mm):
            lin = gm.graph.call_function(aten.linear.default, (x, w) if b is None else (x, w, b))
        lin.meta = dict(mm.meta)
        lin.meta["val"] = out.meta["val"]
        out.replace_all_uses_with(lin)
        for dead in ([out, mm] if out is not mm else [mm]) + [wt]:
            gm.graph.erase_node(dead)
        rw.ctx.count(NAME)
    _conv1d_as_linears(gm, rw)


def _conv1d_as_linears(gm: fx.GraphModule, rw) -> None:
    """Rewrite HF's transposed `Conv1D` — `addmm(b, x, w)`, `mm(x, w)`, `matmul(x, w)` of an UNtransposed
    (in, out) parameter w — in a module a column/row/vocab rule names into `aten.linear(x, t(w), b)`. `t(w)` is
    recorded in `rw.conv1d`, so the rules shard w itself along the other dim (column: dim 1, row: dim 0) and the
    runtime slices the user's (in, out) tensor. Conv1D flattens its input to 2-D and views the result back
    (`x.view(-1, in)` … `.view(*lead, out)`); those views are folded into the linear, so that a fused c_attn's
    output reaches its split directly and is sharded per block."""
    for mm in [n for n in gm.graph.nodes if n.target in MATMULS]:
        w = mm.args[-1]
        n_args = 3 if mm.target is aten.addmm.default else 2
        if not is_param(w) or len(mm.args) != n_args or mm.kwargs or len(shape(w)) != 2:
            continue
        rule = rw.rule_for(mm)
        x, b = (mm.args[1], mm.args[0]) if mm.target is aten.addmm.default else (mm.args[0], None)
        if rule is None or rule.style == "replicate" or not isinstance(x, fx.Node) or len(shape(x)) < 2 \
                or (b is not None and not (isinstance(b, fx.Node) and shape(b) == (shape(w)[1],))):
            continue
        (n_in, n_out), out = shape(w), mm
        if x.target in VIEWS and len(x.users) == 1 and shape(x0 := x.args[0])[-1:] == (n_in,) \
                and len(mm.users) == 1 and (v := next(iter(mm.users))).target in VIEWS \
                and shape(v) == shape(x0)[:-1] + (n_out,):
            x, out = x0, v  # x.view(-1, in) → addmm → .view(*lead, out): one linear on x
        with gm.graph.inserting_before(mm):
            wt = gm.graph.call_function(aten.t.default, (w,))
            lin = gm.graph.call_function(aten.linear.default, (x, wt) if b is None else (x, wt, b))
        wt.meta = {"nn_module_stack": mm.meta.get("nn_module_stack"), "val": w.meta["val"].t()}
        lin.meta = dict(mm.meta)
        lin.meta["val"] = out.meta["val"]
        old_x = mm.args[1] if mm.target is aten.addmm.default else mm.args[0]
        out.replace_all_uses_with(lin)
        for dead in [out, mm] if out is not mm else [mm]:
            gm.graph.erase_node(dead)
        if old_x is not x and not old_x.users:
            gm.graph.erase_node(old_x)
        rw.conv1d[wt] = w
        rw.ctx.count(NAME)
