"""Expert parallelism: spread each MoE layer's experts over the ep group, tokens moving by all-to-all.

Start at `run`. With `mesh ep=N` (N > 1) and `expert_parallel { "glob" }`, for every ModuleList
of E experts the glob matches, the pass finds in the traced graph the form examples/moe.py
writes (GShard's static-shape dispatch, docs/moe.md):

    X = <dispatch>                     (E, cap, C)   every expert's capacity slots, this rank's tokens
    y_e = experts.e( select(X, 0, e) ) (cap, C)      for e = 0 … E-1, each expert a region of nodes
    Y = stack([y_0 … y_{E-1}])         (E, cap, C)   read by the combine

and rewrites it so that ep rank r computes only its experts r·L … r·L+L-1 (L = E/ep):

    A = parc.alltoall_alltoall(X, "ep")   chunk s: source rank s's slots of this rank's L experts
    slot j, source s: expert j's region on select(A, 0, s·L + j)   (a copy of the region per source)
    Y = parc.alltoall_alltoall(stack([... s·L + j ...]), "ep")     every expert's outputs, back home

Experts L … E-1 and their parameters leave the program. Slot j keeps expert j's parameter
placeholders; `ctx.notes["expert_parallel"]` maps each to the FQNs it stands for on ep ranks
0 … ep-1 (experts r·L + j), which the runtime loads (runtime/expert_parallel.py).

Exactness. The router, the capacity rule and the combine stay on the rank, as in the serial
model run on that rank's micro-batch: the same tokens compete for the same slots, so the same
ones are dropped. Each expert runs once per source on that source's (cap, C) slots, the shape
the serial model gives it, so its arithmetic is the serial model's.

Assumes: tensor_parallel ran (its f/g of an expert's linears belong to the expert's region), dropout has not
(no expert may draw random numbers: refused). Guarantees: the program's loss is unchanged on
each rank; a form other than the one above is a located ParcError at the rule saying what
was expected and what was found. With ep 1 or no rules the graph is returned unchanged.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.fx as fx

import parc.runtime.expert_parallel  # noqa: F401 — registers torch.ops.parc.alltoall_alltoall
from parc.errors import ParcError
from parc.traced import module_path

A2A = torch.ops.parc.alltoall_alltoall.default
RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial")  # ops whose draws a copy would repeat


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    ep = plan.mesh.ep
    rules = plan.expert_parallel.patterns
    if ep == 1 or not rules:
        return gm
    fqn_of = {s.name: s.fqn for s in ctx.traced.state}
    notes: dict[str, list[str]] = ctx.notes.setdefault("expert_parallel", {})
    for layer in layers(gm, plan, ctx.traced.module_paths):
        ctx.notes.setdefault("expert_layers", []).append(describe(layer))  # for `parc report` (analysis/experts.py)
        notes.update(layer.rewrite(ep, fqn_of))
        ctx.count("expert_parallel")
    gm.recompile()
    return gm


def layers(gm: fx.GraphModule, plan, paths: list[str]) -> list[_Layer]:
    """Every ModuleList of experts the plan's globs match, checked against the form (nothing rewritten)."""
    out = []
    for i, pattern in enumerate(plan.expert_parallel.patterns):
        span = plan.spans.get(f"expert_parallel.patterns[{i}]") or plan.expert_parallel.span
        for path in [p for p in paths if fnmatchcase(p, pattern)]:
            n = len([p for p in paths if p.startswith(path + ".") and p[len(path) + 1:].isdigit()])
            out.append(_Layer(gm, path, n, span))
    return out


def describe(layer: _Layer) -> dict:
    """What `parc report` needs of a layer: its path, expert count, (E, cap, C) slots and their dtype."""
    dtype = str(layer.x.meta["val"].dtype).removeprefix("torch.")
    return {"path": layer.path, "experts": layer.n, "slots": list(_shape(layer.x)), "dtype": dtype}


def _state(node: fx.Node) -> bool:
    """A parameter or buffer placeholder (parc.trace marks them with their FQN), not a batch input."""
    return node.op == "placeholder" and node.meta.get("parc_fqn") is not None


def _shape(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


class _Layer:
    """One ModuleList of experts: its regions, checked against the expected form."""

    def __init__(self, gm: fx.GraphModule, path: str, n: int, span):
        self.gm, self.path, self.n, self.span = gm, path, n, span
        self.regions: list[list[fx.Node]] = [[] for _ in range(n)]
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            rest = module_path(node).removeprefix(path + ".")
            if rest != module_path(node) and rest.split(".")[0].isdigit():
                self.regions[int(rest.split(".")[0])].append(node)
        self.inputs, self.outputs = zip(*(self._boundary(e) for e in range(n)))
        self._check()

    def refuse(self, found: str) -> ParcError:
        return ParcError(
            f"expert_parallel: `{self.path}` is not in the form parc spreads over ep: {found}", self.span,
            f"parc expects X (E, cap, C) = the dispatched tokens; y_e = {self.path}[e](X[e]) for each of the E "
            "experts; torch.stack([y_0, …]) read by the combine (examples/moe.py, docs/moe.md)")

    def _boundary(self, e: int) -> tuple[fx.Node, fx.Node]:
        """Expert e's one input from outside (not a parameter) and its one output read outside."""
        region = set(self.regions[e])
        if not region:
            raise self.refuse(f"expert {e} (`{self.path}.{e}`) computes nothing in the traced graph")
        ins = {a for node in self.regions[e] for a in node.all_input_nodes if a not in region and not _state(a)}
        outs = [node for node in self.regions[e] if any(u not in region for u in node.users)]
        if len(ins) != 1 or len(outs) != 1:
            raise self.refuse(f"expert {e} takes {len(ins)} tensor input(s) and gives {len(outs)} output(s); "
                              "each expert must map one tensor of its tokens to one")
        for node in self.regions[e]:
            if any(word in str(node.target) for word in RANDOM):
                raise self.refuse(f"expert {e} draws random numbers ({node.target}); an expert run once per "
                                  "source rank cannot repeat the serial model's draws")
        return ins.pop(), outs[0]

    def _check(self) -> None:
        xs = set()
        for e, sel in enumerate(self.inputs):
            if sel.target is not torch.ops.aten.select.int or tuple(sel.args[1:]) != (0, e):
                raise self.refuse(f"expert {e}'s input is `{sel.format_node()}`, not X[{e}] (select dim 0 "
                                  f"index {e}) of the dispatched tokens")
            xs.add(sel.args[0])
        if len(xs) != 1 or _shape(next(iter(xs)))[:1] != (self.n,):
            raise self.refuse(f"the experts' inputs come from {len(xs)} tensor(s), not one (E={self.n}, cap, C)")
        stacks = {u for y in self.outputs for u in y.users}
        stack = next(iter(stacks))
        if len(stacks) != 1 or stack.target is not torch.ops.aten.stack.default or \
                list(stack.args[0]) != list(self.outputs) or (stack.args[1:] or (0,))[0] != 0:
            raise self.refuse("the experts' outputs are not stacked in order along dim 0 by one torch.stack")
        if any(len(y.users) != 1 for y in self.outputs):
            raise self.refuse("an expert's output is read besides the stack")
        ops = [[node.target for node in r] for r in self.regions]
        shapes = [[_shape(a) for node in r for a in node.all_input_nodes if _state(a)]
                  for r in self.regions]
        if any(o != ops[0] for o in ops) or any(s != shapes[0] for s in shapes):
            raise self.refuse("the experts differ in their ops or parameter shapes; each ep rank runs slot j "
                              "with the code of expert j, so every expert must be alike")
        self.x, self.stack = xs.pop(), stack

    def rewrite(self, ep: int, fqn_of: dict[str, str]) -> dict[str, list[str]]:
        """Rewrite for ep ranks; return {slot placeholder: [its FQN on ep rank 0 … ep-1]}."""
        g, n = self.gm.graph, self.n
        local = n // ep
        with g.inserting_after(self.x):
            a = g.call_function(A2A, (self.x, "ep"))
        a.meta["val"] = self.x.meta.get("val")
        outs: dict[int, fx.Node] = {}
        for j in range(local):  # source 0's slots of expert j are row j of A: reuse the region
            self.inputs[j].args = (a, 0, j)
            outs[j] = self.outputs[j]
        with g.inserting_before(self.stack):
            for s in range(1, ep):
                for j in range(local):
                    outs[s * local + j] = self._copy(j, g.call_function(torch.ops.aten.select.int, (a, 0, s * local + j)))
            y = g.call_function(torch.ops.aten.stack.default, ([outs[k] for k in range(n)], 0))
            back = g.call_function(A2A, (y, "ep"))
        y.meta["val"] = back.meta["val"] = self.stack.meta.get("val")
        for node in (y, back):
            node.meta["nn_module_stack"] = self.stack.meta.get("nn_module_stack", {})
        a.meta["nn_module_stack"] = self.x.meta.get("nn_module_stack", {})
        self.stack.replace_all_uses_with(back)
        g.erase_node(self.stack)
        params: dict[int, list[fx.Node]] = {}
        for e in range(n):
            params[e] = [p for node in self.regions[e] for p in node.all_input_nodes if _state(p)]
        for e in range(local, n):  # other ranks' experts: gone, with their parameters
            for node in reversed(self.regions[e]):
                g.erase_node(node)
            g.erase_node(self.inputs[e])
            for p in dict.fromkeys(params[e]):
                if not p.users:
                    g.erase_node(p)
        slots = {}
        for j in range(local):
            for k, p in enumerate(params[j]):
                slots[p.name] = [fqn_of[params[r * local + j][k].name] for r in range(ep)]
        return slots

    def _copy(self, j: int, inp: fx.Node) -> fx.Node:
        """A copy of expert j's region reading `inp`; returns the copy of its output."""
        env = {self.inputs[j]: inp}
        for node in self.regions[j]:
            env[node] = self.gm.graph.node_copy(node, lambda a: env.get(a, a))
        return env[self.outputs[j]]


def slot_note(name: str, ctx) -> str:
    """For a program's header: which expert a slot placeholder holds on each ep rank ("" for the rest)."""
    fqns = (ctx.notes.get("expert_parallel") or {}).get(name)
    return "  ep slot: " + ", ".join(f"ep {r}: {f}" for r, f in enumerate(fqns)) if fqns else ""


def program_fields(gm: fx.GraphModule, state: list, ctx, assign) -> dict:
    """plan.json fields of a program with experts: dense and expert gradient buckets apart (the
    runtime reduces them over different groups), `experts`: the slot placeholders, and under ZeRO
    `expert_zero`: their partition table over edp (passes/zero.py).
    `assign` is passes/grad_buckets.assign."""
    names = {s.name for s in state}  # with pp: only this stage's slots (the notes hold every stage's)
    slots = {k for k in ctx.notes.get("expert_parallel") or {} if k in names}
    if not slots:
        return {}
    return {"buckets": assign(gm, [s for s in state if s.name not in slots]),
            "expert_buckets": assign(gm, [s for s in state if s.name in slots]),
            "experts": sorted(slots),
            "expert_zero": ctx.notes.get("zero_experts")}  # ZeRO: the experts' table, cut over edp (passes/zero.py)

