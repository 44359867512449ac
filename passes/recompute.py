"""Activation recompute: each module the plan's `recompute` globs match becomes a checkpointed region.

Start at `run`. Changes: the nodes of each recomputed module instance — the
outermost module on a node's path that a glob matches, e.g. `blocks.3` for
`recompute "blocks.*"` — are cut out of the program into a function of their
own, and the program calls it through `torch.utils.checkpoint.checkpoint`
(non-reentrant). Forward then keeps only the region's inputs; backward re-runs
the region to rebuild what it needs. The generated program shows this plainly:

    def recompute_blocks_0(*args):   # wraps _blocks_0 in torch.utils.checkpoint
    def _blocks_0(x, w, ...):        # the region's aten code, as it was
    def forward(...):
        recompute_blocks_0 = recompute_blocks_0(add_3, p_blocks_0_ln1_weight, ...)

What runs inside a region is unchanged, collectives included, so a
tensor-parallel block re-runs its forward all-reduces in backward, as
Megatron's full recompute does. Dropout draws the same masks the second time:
checkpoint restores the default generators' state, and parc's tensor-parallel
dropout streams are a function of that state (runtime/parallel/ops.py).

Under `compile inductor | aot_eager` a region that holds a forward collective is
recomputed selectively instead: its checkpoint call passes
`context_fn=parc.runtime.recompute_policy.save_collectives`, which keeps the
collectives' outputs and recomputes the rest, because torch's inductor cannot
compile an ordered op recomputed in backward (runtime/recompute_policy.py says
why). `compile none` keeps full recompute.

Assumes: runs last, on one program's graph (after tensor_parallel,
pipeline_split and zero); nodes carry `nn_module_stack` (parc.traced.module_path).
Guarantees: the program computes the same values; each region's nodes are
contiguous in the output. A region that cannot be cut out — a node outside it
both consumes a region value and feeds back into it — is a compile error naming
both nodes, never a silently different program.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from parc.errors import TraceError
from parc.traced import module_path

NAME = "recompute"
REGIONS = "parc_recompute"  # gm.meta key: {function name: (instance, body fx.Graph)}
POLICY = "parc.runtime.recompute_policy.save_collectives"  # the context_fn of a selective region


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    if not plan.recompute.patterns:
        return gm
    regions: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            inst = plan.recompute.instance(module_path(n))
            if inst is not None:
                regions.setdefault(inst, []).append(n)
    gm.meta[REGIONS] = {}
    compiled = getattr(plan, "compile", "none") != "none"
    for inst, nodes in regions.items():
        _cut_out(gm, inst, nodes, selective=compiled and any(_communicates(n) for n in nodes))
        ctx.count(NAME)
    ctx.notes["recompute"] = list(regions)  # graph order
    return gm  # run_passes lints it


def region_function(inst: str, body: fx.Graph, selective: bool = False):
    """The callable a region's call node targets: checkpoint(body). FX prints it as `recompute_<inst>`.
    The runtime runs the generated program's text; in-process, the body's module is built on first call
    (building one per region eagerly costs a recompile each, seconds for a GPT-3-sized plan).
    `selective`: keep the outputs of the region's collectives (runtime/recompute_policy.py)."""
    module = []
    extra = {}
    if selective:
        from parc.runtime.recompute_policy import save_collectives
        extra["context_fn"] = save_collectives

    def fn(*args):
        if not module:
            module.append(fx.GraphModule(torch.nn.Module(), body))
        return checkpoint(module[0], *args, use_reentrant=False, **extra)
    fn.__name__ = fn.__qualname__ = inst.replace(".", "_")
    fn.__module__ = "recompute"
    fn.parc_region = (inst, body, selective)  # parc/codegen.py writes the same call
    return fn


def _communicates(n: fx.Node) -> bool:
    """Does node `n` call one of parc's collectives (an ordered effect, runtime/parallel/ops.py)?"""
    from parc.runtime.recompute_policy import communicates
    return n.op == "call_function" and communicates(n.target)


def _cut_out(gm: fx.GraphModule, inst: str, nodes: list[fx.Node], selective: bool) -> None:
    graph, inside = gm.graph, set(nodes)
    # Nodes between the region's first and last that are not in it: those independent of the
    # region move before it; those that consume it go after it, and must not feed it.
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = nodes[0], nodes[-1]
    tainted: set[fx.Node] = set(inside)
    between = [n for n in graph.nodes if order[first] < order[n] < order[last] and n not in inside]
    for n in between:
        if any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
        else:
            first.prepend(n)
    for n in nodes:
        bad = next((a for a in n.all_input_nodes if a in tainted and a not in inside), None)
        if bad is not None:
            raise TraceError(f"cannot recompute {inst}: `{bad.name}` ({module_path(bad) or 'model'}) uses a value "
                             f"of {inst} and feeds `{n.name}` inside it again, so {inst} is not one region",
                             hint=f"recompute a module that contains both, or not {inst}")

    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env = {a: body.placeholder(a.name) for a in inputs}
    for a, p in env.items():
        p.meta = dict(a.meta)
    for n in nodes:
        env[n] = body.node_copy(n, lambda x: env[x])
    body.output(tuple(env[o] for o in outputs))
    fn = region_function(inst, body, selective)

    with graph.inserting_before(first):
        call = graph.call_function(fn, tuple(inputs))
        call.meta["nn_module_stack"] = first.meta.get("nn_module_stack")
    with graph.inserting_after(call):
        for i, o in reversed(list(enumerate(outputs))):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta = {"val": o.meta.get("val"), "nn_module_stack": o.meta.get("nn_module_stack")}
            o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        graph.erase_node(n)
    gm.meta[REGIONS][fn.__name__] = (inst, body)
