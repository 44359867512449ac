"""Portable ops: a program traced on the meta device runs on every device a rank may have.

Start at `run`. parc traces on meta, so model code that branches on `x.device.type` takes the
branch written for accelerators (`"cpu"` and `"mps"` are the usual tests; meta is neither). Those
branches pick op forms that CPU kernels lack: transformers' MoE routing counts tokens per expert
with `torch.histc` on int32 ids on CUDA and on float ids on CPU, so an HF MoE model compiled by parc
trained on GPUs and died at step 0 on CPU ranks (`"histogram_cpu" not implemented for 'Int'`).

Changes: each `aten.histc` of an integer tensor gets its input cast to float32 first (`aten._to_copy`),
the form both CPU and CUDA kernels take, and its counts cast back to the traced integer dtype after,
so every op downstream sees what it was traced with. Exact: histc counts values into bins by comparisons, and
every integer of magnitude below 2**24 is a float32 (expert ids, token ids, positions are far below;
a traced input whose dtype can hold more is still cast: its values are ids, not arbitrary 32-bit data).

Assumes: the traced whole graph, before tensor_parallel (whose shape propagation runs CPU kernels).
Guarantees: no `aten.histc` of an integer tensor remains; values are unchanged.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
NAME = "portable"


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not aten.histc.default:
            continue
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if val is None or val.dtype.is_floating_point:
            continue
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        users, out = list(node.users), node.meta["val"]
        with gm.graph.inserting_after(node):
            back = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": out.dtype})
        for made, v in ((cast, val.to(torch.float32)), (back, out)):
            made.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            made.meta["val"] = v
        node.replace_input_with(x, cast)
        node.meta["val"] = out.to(torch.float32)
        for u in users:
            u.replace_input_with(node, back)
        ctx.count(NAME)
        changed = True
    if changed:
        gm.recompile()
    return gm
