"""Grad-mode regions of a traced model, made flat (used by parc/trace.py after torch.export).

Start at `inline_regions`. A `with torch.no_grad():` (or `torch.set_grad_enabled(...)`) block inside
a model's forward is exported as a higher-order op, `wrap_with_set_grad_enabled(enabled, submod, *args)`,
whose body is a submodule of the graph: HF's PhiMoE computes its router's jitter mask that way. parc's
passes and programs are flat aten code, so such a graph crashed the code generator. Here each region is
inlined where it ran; under `enabled=False` each value leaving it goes through `aten.detach` (what the
block meant: nothing computed in it carries a gradient out), under `enabled=True` the values leave as
they are (a training step runs with grad mode on). Nested regions are inlined from the outside in.

An autocast region (`with torch.autocast(...)`, `wrap_with_autocast`) has no flat form that keeps its
casts, and any other higher-order op with a body (`torch.cond`, `map`, …) has none parc's passes can
rewrite: both are refused, located at the `with` or the call in the user's file.
"""

from __future__ import annotations

import operator
import re
from pathlib import Path

import torch
import torch.fx as fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from parc.errors import Span, TraceError

aten = torch.ops.aten


def inline_regions(gm: fx.GraphModule, user_path: Path) -> int:
    """Inline every grad-mode region of `gm` in place; refuse other bodies. Returns how many were inlined."""
    count = 0
    while True:
        node = next((n for n in gm.graph.nodes if n.op == "call_function" and _has_body(gm, n)), None)
        if node is None:
            break
        if node.target is not wrap_with_set_grad_enabled:
            name = getattr(node.target, "__name__", str(node.target))
            what = "an autocast region (`with torch.autocast(...)`)" if "autocast" in name else f"`{name}`"
            raise TraceError(f"the model's forward uses {what}, a traced region with a body of its own, which "
                             "parc cannot shard or schedule", _span(node, user_path),
                             "compute it outside forward, or write it without the region (for autocast: set "
                             "`precision bf16` in the plan instead)")
        _inline(gm, node)
        count += 1
    if count:
        for name, mod in list(gm.named_children()):
            if isinstance(mod, fx.GraphModule) and not any(n.op == "get_attr" and n.target == name
                                                          for n in gm.graph.nodes):
                delattr(gm, name)
        gm.graph.lint()
        gm.recompile()
    return count


def _has_body(gm: fx.GraphModule, node: fx.Node) -> bool:
    return any(a.op == "get_attr" and isinstance(getattr(gm, a.target, None), fx.GraphModule)
               for a in node.all_input_nodes)


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    enabled, body_node, *args = node.args
    body: fx.GraphModule = getattr(gm, body_node.target)
    env: dict[fx.Node, object] = {}
    placeholders = iter(args)
    outs = None
    with gm.graph.inserting_before(node):
        for b in body.graph.nodes:
            if b.op == "placeholder":
                env[b] = next(placeholders)
            elif b.op == "output":
                outs = b.args[0]
            elif b.op == "get_attr":  # a nested region's body: moved onto the outer module under a fresh name
                sub = getattr(body, b.target)
                name = _free_name(gm, b.target)
                gm.add_submodule(name, sub) if isinstance(sub, torch.nn.Module) else setattr(gm, name, sub)
                env[b] = gm.graph.get_attr(name)
            else:
                env[b] = gm.graph.node_copy(b, lambda x: env[x])
        leaving = fx.map_arg(outs, lambda x: env[x])
        if not enabled:
            leaving = [_detached(gm, v) for v in leaving] if isinstance(leaving, (list, tuple)) else _detached(gm, leaving)
    for u in list(node.users):
        if u.op == "call_function" and u.target is operator.getitem and isinstance(leaving, (list, tuple)):
            u.replace_all_uses_with(leaving[u.args[1]])
            gm.graph.erase_node(u)
        else:
            u.replace_input_with(node, leaving)
    gm.graph.erase_node(node)
    if not body_node.users:
        gm.graph.erase_node(body_node)


def _detached(gm: fx.GraphModule, v):
    if not isinstance(v, fx.Node) or not isinstance(v.meta.get("val"), torch.Tensor):
        return v
    d = gm.graph.call_function(aten.detach.default, (v,))
    d.meta.update({k: v.meta[k] for k in ("val", "nn_module_stack", "stack_trace") if k in v.meta})
    return d


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


def _span(node: fx.Node, user_path: Path) -> Span:
    """The innermost line of the user's file in the node's stack trace, else the file's first line."""
    trace = node.meta.get("stack_trace") or ""
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', trace)[::-1]:
        if Path(file).resolve() == Path(user_path).resolve():
            return Span(str(user_path), int(line), 1)
    return Span(str(user_path), 1, 1)
