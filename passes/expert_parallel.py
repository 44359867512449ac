"""Expert parallelism: spread each MoE layer's experts over the ep group, tokens moving by all-to-all.

Start at `run`. With `mesh ep=N` (N > 1) and `expert_parallel { "glob" }`, for every ModuleList
of E experts the glob matches, the pass finds in the traced graph the form examples/moe.py
writes (GShard's static-shape dispatch, docs/moe.md):

    X = <dispatch>                     (E, cap, C)   every expert's capacity slots, this rank's tokens
    y_e = experts.e( select(X, 0, e) ) (cap, C)      for e = 0 … E-1, each expert a region of nodes
    Y = stack([y_0 … y_{E-1}])         (E, cap, C)   read by the combine

and rewrites it so that ep rank r computes only its experts r·L … r·L+L-1 (L = E/ep):

    A = parc.alltoall_alltoall(X, "ep")   chunk s: source rank s's slots of this rank's L experts
    slot j: expert j's region once on A.view(ep, L, cap, C)[:, j] as (ep·cap, C) rows, every source's
            slots together (batched: a row-wise expert, below), or else once per source on
            select(A, 0, s·L + j)
    Y = parc.alltoall_alltoall(<outputs in s·L + j order>, "ep")   every expert's outputs, back home

Experts L … E-1 and their parameters leave the program. Slot j keeps expert j's parameter
placeholders; `ctx.notes["expert_parallel"]` maps each to the FQNs it stands for on ep ranks
0 … ep-1 (experts r·L + j), which the runtime loads (runtime/parallel/expert_parallel.py).

Exactness. The router, the capacity rule and the combine stay on the rank, as in the serial
model run on that rank's micro-batch: the same tokens compete for the same slots, so the same
ones are dropped. An expert whose every op maps row i of its input to row i of its output
(linears, activations, row norms, elementwise ops with parameters that broadcast over rows, tp's
all-reduces: `_row_wise`) runs once on the ep·cap rows of all sources, as hand-written
expert-parallel layers do: each output row is the serial model's row, and its weight gradient
sums the same rows in one matmul instead of one per source, a reordering of an fp32 sum. Any
other expert runs once per source on that source's (cap, C) slots, the shape the serial model
gives it.

Assumes: tensor_parallel ran (its f/g of an expert's linears belong to the expert's region), dropout has not
(no expert may draw random numbers: refused). Guarantees: the program's loss is unchanged on
each rank; a form other than the one above is a located ParcError at the rule saying what
was expected and what was found. With ep 1 or no rules the graph is returned unchanged.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.fx as fx

import parc.runtime.parallel.expert_parallel  # noqa: F401 — registers torch.ops.parc.alltoall_alltoall
import parc.runtime.parallel.ops  # noqa: F401 — registers tp's torch.ops.parc ops, which an expert may hold
from parc.errors import ParcError
from parc.traced import module_path

A2A = torch.ops.parc.alltoall_alltoall.default
RANDOM = ("dropout", "bernoulli", "rand", "normal", "multinomial")  # ops whose draws a copy would repeat
aten = torch.ops.aten
NORMS = {aten.layer_norm.default, aten.rms_norm.default}  # args[1]: the normalised trailing shape
# ops that map row i of their first operand to row i of their result (the region's other tensor
# operands, parameters, must broadcast over rows: `_Layer._row_wise`); tp's all-reduces sum each
# element over ranks
ROW_WISE = {aten.linear.default, aten.gelu.default, aten.relu.default, aten.silu.default, aten.sigmoid.default,
            aten.tanh.default, aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar,
            aten.add.Scalar, aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default, *NORMS,
            torch.ops.parc.identity_allreduce.default, torch.ops.parc.allreduce_identity.default}
WEIGHTED = {aten.linear.default, *NORMS}  # operands after the first are weights (and shapes), not rows


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
        a.meta["nn_module_stack"] = self.x.meta.get("nn_module_stack", {})
        with g.inserting_before(self.stack):
            y = self._batched(a, ep, local) if self._row_wise() else self._per_source(a, ep, local)
            back = g.call_function(A2A, (y, "ep"))
        back.meta["val"] = self.stack.meta.get("val")
        back.meta["nn_module_stack"] = self.stack.meta.get("nn_module_stack", {})
        self.stack.replace_all_uses_with(back)
        g.erase_node(self.stack)
        params = {e: [p for node in self.regions[e] for p in node.all_input_nodes if _state(p)] for e in range(n)}
        for e in range(n):  # the traced regions: replaced by the copies above, their parameters kept for slots
            for node in reversed(self.regions[e]):
                g.erase_node(node)
            g.erase_node(self.inputs[e])
        for e in range(local, n):  # other ranks' experts: gone, with their parameters
            for p in dict.fromkeys(params[e]):
                if not p.users:
                    g.erase_node(p)
        slots = {}
        for j in range(local):
            for k, p in enumerate(params[j]):
                slots[p.name] = [fqn_of[params[r * local + j][k].name] for r in range(ep)]
        return slots

    def _per_source(self, a: fx.Node, ep: int, local: int) -> fx.Node:
        """Expert j once per source s on its (cap, C) slots, row s·L + j of A; the outputs stacked."""
        outs = [self._copy(j, self._node(torch.ops.aten.select.int, (a, 0, s * local + j), self.inputs[j]))
                for s in range(ep) for j in range(local)]
        return self._node(torch.ops.aten.stack.default, (outs, 0), self.stack)

    def _batched(self, a: fx.Node, ep: int, local: int) -> fx.Node:
        """Expert j once on every source's slots: A (ep·L, cap, C) → (ep, L, cap, C)[:, j] → (ep·cap, C)
        rows; its (ep·cap, C') output back to (ep, cap, C'); stacked at dim 1 → (ep·L, cap, C')."""
        n, cap, c = _shape(self.x)
        (_, c_out) = _shape(self.outputs[0])
        grid = self._node(torch.ops.aten.view.default, (a, [ep, local, cap, c]), None, (ep, local, cap, c))
        outs = []
        for j in range(local):
            rows = self._node(torch.ops.aten.select.int, (grid, 1, j), None, (ep, cap, c))
            rows = self._node(torch.ops.aten.reshape.default, (rows, [ep * cap, c]), None, (ep * cap, c))
            y = self._copy(j, rows, rows=ep * cap)
            outs.append(self._node(torch.ops.aten.view.default, (y, [ep, cap, c_out]), None, (ep, cap, c_out)))
        y = self._node(torch.ops.aten.stack.default, (outs, 1), None, (ep, local, cap, c_out))
        return self._node(torch.ops.aten.view.default, (y, [n, cap, c_out]), self.stack)

    def _row_wise(self) -> bool:
        """Does every expert map row i of its (cap, C) input to row i of its output, so that one run on
        rows from several sources computes each source's rows as a run on its own would?"""
        cap = _shape(self.x)[1]
        if len(_shape(self.x)) != 3 or len(_shape(self.outputs[0])) != 2:
            return False
        inside = {self.inputs[0], *self.regions[0]}
        for node in self.regions[0]:
            if node.target not in ROW_WISE or node.kwargs.keys() - {"dtype", "device", "layout"} or \
                    len(_shape(node)) < 2 or _shape(node)[0] != cap:
                return False
            operands = node.args[:1] if node.target in WEIGHTED else node.args  # a linear's weight is no row
            for arg in operands:  # an operand from outside the expert must broadcast over the rows
                if isinstance(arg, fx.Node) and arg not in inside and len(_shape(arg)) >= len(_shape(node)):
                    return False
            if node.target in NORMS and len(node.args[1]) >= len(_shape(node)):
                return False  # normalised over the rows too
        return True

    def _node(self, target, args, like: fx.Node | None, shape: tuple | None = None) -> fx.Node:
        """A new node; meta from `like`, or a value of `shape` in the dispatched tokens' dtype."""
        node = self.gm.graph.call_function(target, args)
        node.meta["nn_module_stack"] = (like or self.stack).meta.get("nn_module_stack", {})
        val = (like or self.x).meta.get("val")
        if shape is not None and isinstance(val, torch.Tensor):
            val = val.new_empty(shape)
        node.meta["val"] = val
        return node

    def _copy(self, j: int, inp: fx.Node, rows: int | None = None) -> fx.Node:
        """A copy of expert j's region reading `inp`; returns the copy of its output. `rows`: the
        copy's row count where it differs from the traced region's (a row-wise expert, batched)."""
        env = {self.inputs[j]: inp}
        for node in self.regions[j]:
            env[node] = copy = self.gm.graph.node_copy(node, lambda a: env.get(a, a))
            val = node.meta.get("val")
            if rows is not None and isinstance(val, torch.Tensor):
                copy.meta["val"] = val.new_empty((rows, *val.shape[1:]))
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

