"""Pipeline split: cut the traced loss graph into pp × virtual stages.

Start at `assign_stages` (run once per compile on the traced graph) and `run`
(the pass, once per program). `assign_stages` decides where the cuts go and
writes `meta["parc_stage"]` on every node of the traced graph; `run` then cuts
the graph it is given (possibly rewritten by earlier passes, which keep node
meta) down to stage `ctx.stage`.

Where the cuts go. A plan's `cut before/after "<module path>"` names a position
in the graph's node order: before the first node of that module, or after its
last. With `stages=auto` (no cuts), cuts go only at the starts of the repeated
layers (`blocks.i`), chosen by a small dynamic program that minimises the most
loaded stage, where a stage's load is the mean of its share of the estimated
FLOPs (from the traced shapes) and its share of the parameter memory. Stage
numbers never decrease along the node order, so every value flows forward.

Assumes: the graph is the traced aten graph (placeholders are state, then user
inputs; output `(loss,)`); nodes added by earlier passes may lack
`parc_stage` and inherit the stage of the node before them.

Guarantees, for the program of stage s:
- placeholders are: the state stage s uses (a tied parameter, e.g. an embedding
  shared with the lm head, is a placeholder of every stage that uses it) and the
  state no stage reads whose module is in stage s (`unused_owners`: every
  parameter of the model is held by some stage), then
  `recv_<value>` for every value crossing the cut s−1 | s, then every user
  input (each pp rank calls `get_batch` itself, so inputs are never sent);
- the output is `(loss,)` on the last stage, otherwise the tuple of values
  crossing the cut s | s+1, in `ctx.notes["pipeline"]["send"]` order;
- a value used several stages later (a skip connection) is FORWARDED through
  every stage in between: it is received and sent again unchanged, so every
  message goes between adjacent stages, as the schedule's SEND_F(s)/RECV_F(s+1)
  pairs require, and its gradient comes back the same way;
- a value computed from no input at all (`arange(T)`: shape-derived) is
  recomputed in each stage that uses it; a non-tensor value (an int from a
  shape) crossing a cut is passed as the constant the trace recorded;
- `ctx.notes["pipeline"]` lists recv/send values with shape, dtype and whether
  a gradient travels back for them.
"""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx as fx

from parc.errors import Diagnostic, ParcError
from parc.replicate import _graph_module
from parc.traced import module_path

STAGE = "parc_stage"


# ---------------------------------------------------------------- cost estimates

def node_flops(node: fx.Node) -> int:
    """Forward FLOPs of one aten node from its traced shapes (matmul-like exactly, the rest ~numel)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    out = val.numel()
    name = str(node.target)
    args = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)]
    if any(k in name for k in ("linear", "addmm", ".mm.", "bmm", "matmul")) and args:
        k = args[0].shape[-1] if isinstance(args[0], torch.Tensor) and args[0].dim() else 1
        return 2 * out * k
    if "scaled_dot_product" in name and args:
        q = args[0]  # (B, nh, T, hs): QKᵀ and PV, 2 FLOPs per multiply-add each
        return 4 * q.numel() * q.shape[-2]
    return out


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _param_bytes(traced) -> dict[str, int]:
    """Bytes of each parameter placeholder, from the trace's static state specs."""
    return {s.name: math.prod(s.shape) * getattr(torch, s.dtype).itemsize for s in traced.state if s.kind == "param"}


def _layer_prefix(paths: list[str], num_layers: int) -> str | None:
    """The module path of the repeated layers, e.g. `blocks` (children `blocks.0` … `blocks.{L−1}`)."""
    counts: dict[str, set] = {}
    for p in paths:
        m = re.fullmatch(r"(.*)\.(\d+)", p)
        if m:
            counts.setdefault(m.group(1), set()).add(int(m.group(2)))
    best = [k for k, v in counts.items() if len(v) == num_layers]
    return min(best, key=len) if best and num_layers else None  # outermost: `blocks`, not `blocks.0.fcs`


def _in(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


# ---------------------------------------------------------------- deciding the cuts

def _explicit_positions(nodes: list[fx.Node], cuts) -> list[int]:
    positions = []
    paths = [module_path(n) for n in nodes]
    for cut in cuts:
        hits = [i for i, p in enumerate(paths) if _in(p, cut.path)]
        if not hits:
            raise ParcError(f"cut {cut.where} \"{cut.path}\": no operation of the traced graph runs in it",
                            cut.span, hint="cut at a module that computes something, e.g. a layer")
        positions.append(hits[0] if cut.where == "before" else hits[-1] + 1)
    for (a, b), cut in zip(zip([0] + positions, positions + [len(nodes)]), list(cuts) + [None]):
        if not a < b:
            where = f"cut {cut.where} \"{cut.path}\"" if cut else "the last cut"
            raise ParcError(f"{where} leaves an empty stage: cuts must follow the model's order "
                            f"(position {a} ≥ {b} of {len(nodes)} operations)", getattr(cut, "span", None),
                            hint="list cuts in forward order, each after the previous")
    return positions


def _auto_positions(nodes: list[fx.Node], gm: fx.GraphModule, traced, stages: int,
                    warnings: list[Diagnostic]) -> list[int]:
    prefix = _layer_prefix(traced.module_paths, traced.num_layers)
    if prefix is None:
        raise ParcError("stages=auto needs repeated layers (an nn.ModuleList of one block class) to cut between",
                        hint='write the cuts: pipeline stages=2 { cut after "..." }')
    L = traced.num_layers
    if stages > L:
        raise ParcError(f"{stages} stages but the model has {L} layers: each stage needs at least one layer")
    if L % stages:
        warnings.append(Diagnostic(
            f"{L} layers do not divide into {stages} stages ({L} = {L // stages} × {stages} + {L % stages}): "
            f"stages get unequal layer counts; the cut balances estimated FLOPs and parameter memory instead",
            hint=f"use a pp × virtual that divides {L}", severity="warning"))
    starts = _layer_starts([module_path(n) for n in nodes], prefix, L)
    flops = [node_flops(n) for n in nodes]
    params = [0] * len(nodes)
    index = {n: k for k, n in enumerate(nodes)}
    nbytes = _param_bytes(traced)
    for p in gm.graph.nodes:
        if p.op == "placeholder" and p.users and p.name in nbytes:
            params[min(index[u] for u in p.users)] += nbytes[p.name]
    bounds = [0] + starts + [len(nodes)]
    # load of the piece between candidate bounds a < b
    cf, cp = _prefix_sums(flops), _prefix_sums(params)
    tf, tp = max(cf[-1], 1), max(cp[-1], 1)

    def load(a: int, b: int) -> float:
        return 0.5 * (cf[b] - cf[a]) / tf + 0.5 * (cp[b] - cp[a]) / tp

    n = len(bounds) - 1  # pieces are [bounds[i], bounds[j]) for i < j; layers are units
    best = {(0, 0): (0.0, [])}
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            cands = [(max(best[(k - 1, i)][0], load(bounds[i], bounds[j])), best[(k - 1, i)][1] + [j])
                     for i in range(k - 1, j) if (k - 1, i) in best]
            if cands:
                best[(k, j)] = min(cands, key=lambda c: c[0])
    return [bounds[j] for j in best[(stages, n)][1][:-1]]


def _layer_starts(paths: list[str], prefix: str, layers: int) -> list[int]:
    """The index of the first node in each layer `prefix`.1 … `prefix`.(layers − 1), in one pass over the nodes'
    module paths (a 96-layer model has tens of thousands of nodes; the planner splits it for every candidate)."""
    first: dict[int, int] = {}
    head = prefix + "."
    for k, path in enumerate(paths):
        if path.startswith(head):
            part = path[len(head):].split(".", 1)[0]
            if part.isdigit() and str(int(part)) == part:
                first.setdefault(int(part), k)
    missing = [i for i in range(1, layers) if i not in first]
    if missing:
        raise ParcError(f"stages=auto: layer {prefix}.{missing[0]} runs no operation of the traced graph",
                        hint='write the cuts: pipeline stages=2 { cut after "..." }')
    return [first[i] for i in range(1, layers)]


def _prefix_sums(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def assign_stages(traced, plan, stages: int) -> tuple[list[dict], list[Diagnostic]]:
    """Mark every node of `traced.gm` with its stage; return per-stage summaries and warnings."""
    gm, warnings = traced.gm, []
    nodes = _compute_nodes(gm)
    cuts = plan.pipeline.cuts if plan.pipeline is not None else None
    if stages == 1:
        positions = []
    elif cuts:
        positions = _explicit_positions(nodes, cuts)
    else:
        positions = _auto_positions(nodes, gm, traced, stages, warnings)
    if len(positions) != stages - 1:
        raise ParcError(f"{len(positions)} cuts make {len(positions) + 1} stages ≠ {stages}")
    s = 0
    for k, n in enumerate(nodes):
        while s < len(positions) and k >= positions[s]:
            s += 1
        n.meta[STAGE] = s
    for n in nodes:  # a getitem stays with the multi-output node it unpacks: tuples are never sent
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            n.meta[STAGE] = n.args[0].meta[STAGE]
    if cuts and stages > 1:
        _check_parameters(gm, traced, cuts, stages)
    return _summaries(gm, traced, stages), warnings


def _check_parameters(gm: fx.GraphModule, traced, cuts, stages: int) -> None:
    """Refuse a stage that uses no trainable parameter, at the cut that opens it.

    Such a stage (`cut after "lm_head"`: the last stage computes only the loss) has nothing for its pp
    rank's optimizer, buckets or ZeRO partition to hold, and would fail at step 0. Only explicit cuts can
    make one: `stages=auto` gives every stage a layer.
    """
    trainable = {s.name for s in traced.state if s.kind == "param" and s.requires_grad}
    users: list[list[str]] = [[] for _ in range(stages)]  # per stage: the modules that read a parameter, in order
    for n in _compute_nodes(gm):
        if any(a.op == "placeholder" and a.name in trainable for a in n.all_input_nodes):
            users[n.meta[STAGE]].append(module_path(n))
    for s in range(stages):
        if users[s]:
            continue
        cut = cuts[max(s - 1, 0)]
        where = f'cut {cut.where} "{cut.path}"'
        ops = sorted({module_path(n) or "top-level operations" for n in _compute_nodes(gm) if n.meta[STAGE] == s})
        if ops == ["top-level operations"]:
            ops = ["only top-level operations, such as the loss" if s == stages - 1 else "only top-level operations"]
        what = f"stage {s} of {stages} ({', '.join(ops[:4])}{', …' if len(ops) > 4 else ''})"
        if s == stages - 1:
            last = _last_user(users, s)
            hint = (f'move the cut before "{last}" (or earlier), so that the last stage holds it'
                    if last else "move the cut earlier")
        elif s == 0:
            first = next((m for u in users[1:] for m in u if m), None)
            hint = (f'move the cut after "{first}" (or later), so that the first stage holds it'
                    if first else "move the cut later")
        else:
            hint = f"move the cuts around stage {s} so that it holds a module with parameters, e.g. a layer"
        raise ParcError(f"{where} leaves {what} without parameters: each stage's pp rank trains the parameters "
                        f"its stage uses, and this one uses none", cut.span, hint=hint)


def _last_user(users: list[list[str]], s: int) -> str | None:
    """The last module before stage `s` that reads a trainable parameter."""
    for earlier in reversed(users[:s]):
        named = [u for u in earlier if u]
        if named:
            return named[-1]
    return None


def _summaries(gm: fx.GraphModule, traced, stages: int) -> list[dict]:
    nodes = _compute_nodes(gm)
    flops = [0] * stages
    params = [0] * stages
    modules: list[list[str]] = [[] for _ in range(stages)]
    for n in nodes:
        s = n.meta[STAGE]
        flops[s] += node_flops(n)
        p = module_path(n)
        if p and (not modules[s] or modules[s][-1] != p):
            modules[s].append(p)
    nbytes = _param_bytes(traced)
    unused = unused_owners(gm, traced, {n: n.meta[STAGE] for n in nodes})
    for p in gm.graph.nodes:
        if p.op == "placeholder" and p.name in nbytes:
            for s in sorted({u.meta[STAGE] for u in p.users} or {unused[p.name]}):
                params[s] += nbytes[p.name]
    tf, tp = max(sum(flops), 1), max(sum(params), 1)
    return [{"index": s, "first": modules[s][0] if modules[s] else "", "last": modules[s][-1] if modules[s] else "",
             "flops": flops[s], "flops_share": round(flops[s] / tf, 4),
             "param_bytes": params[s], "param_share": round(params[s] / tp, 4)} for s in range(stages)]


# ---------------------------------------------------------------- the pass

def _stage_of(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Stage of every compute node; nodes added by earlier passes inherit from the node before them."""
    out, last = {}, 0
    for n in _compute_nodes(gm):
        last = n.meta.get(STAGE, last)
        out[n] = last
    return out


def _constant_only(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes computed from no placeholder at all (e.g. `arange(T)`), cheap to recompute anywhere."""
    out = set()
    for n in _compute_nodes(gm):
        deps = n.all_input_nodes
        if all(d in out for d in deps) and "rand" not in str(n.target) and "dropout" not in str(n.target):
            out.add(n)
    return out


def _needs_grad(gm: fx.GraphModule, traced) -> set[fx.Node]:
    """Values a gradient flows back through: float results depending on a trainable parameter."""
    trainable = {s.name for s in traced.state if s.kind == "param" and s.requires_grad}
    out = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n.name in trainable:
                out.add(n)
            continue
        val = n.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else [val]
        floating = any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in vals)
        if floating and any(d in out for d in n.all_input_nodes):
            out.add(n)
    return out


def unused_owners(gm: fx.GraphModule, traced, stage_of: dict[fx.Node, int]) -> dict[str, int]:
    """The stage that holds each state entry no node reads, by placeholder name.

    A model may own parameters its traced forward never reads: a submodule it does not call, a branch not taken
    at the traced sequence length (deepseek_v4's compressor below its window), a layer's output an earlier pass
    found dead. A stage takes the state its nodes read, so no stage took these, and the pipeline run trained,
    saved and gathered a model without them. Each goes to the stage of the nearest module on its path that
    computes something (its own module, else the closest enclosing one), stage 0 if none does: one owner, so
    it is trained (its gradient None, as in the serial model), saved and resumed once, like any other."""
    first: dict[str, int] = {}  # module path → the first stage computing in it (or in a submodule)
    for n, st in stage_of.items():
        path = module_path(n)
        while path and path not in first:
            first[path] = st
            path = path.rpartition(".")[0]
    state = {x.name: x for x in traced.state}
    out = {}
    for p in gm.graph.nodes:
        if p.op != "placeholder" or p.users:
            continue
        spec = state.get(p.name)
        if spec is None:
            continue  # a user input
        path = spec.fqn.rpartition(".")[0]
        while path not in first and path:
            path = path.rpartition(".")[0]
        out[p.name] = first.get(path, 0)
    return out


def crossing(gm: fx.GraphModule, stages: int) -> list[list[fx.Node]]:
    """crossing[b]: values computed at stage ≤ b and used at a stage > b, in graph order (skips included)."""
    stage_of, const = _stage_of(gm), _constant_only(gm)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    cuts: list[list[fx.Node]] = [[] for _ in range(max(stages - 1, 0))]
    for n, s in stage_of.items():
        if n in const:
            continue
        users = [stages - 1 if u is out_node else stage_of[u] for u in n.users]
        for b in range(s, max(users, default=s)):
            cuts[b].append(n)
    return cuts


def _spec(n: fx.Node, grad: bool) -> dict:
    """A value crossing a cut; `module` is the path of the module that made it (`blocks.1`; '' for the
    root), the name a reader knows it by: parc viz labels the arrow between stages with it."""
    val = n.meta.get("val")
    return {"name": n.name, "module": module_path(n), "shape": [int(d) for d in val.shape],
            "dtype": str(val.dtype).removeprefix("torch."), "grad": grad}


def _cut_span(plan, b: int):
    """The plan's line for cut `b`: its `cut` entry, else its `pipeline` line (stages=auto), else none."""
    pipe = plan.pipeline
    if pipe is None:
        return None
    return pipe.cuts[b].span if pipe.cuts and b < len(pipe.cuts) else pipe.span


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    """Return the program of stage `ctx.stage` of `ctx.notes["stages"]`; the whole graph when there is one."""
    stages = ctx.notes.get("stages", 1)
    if stages == 1:
        return gm
    s = ctx.stage
    # the same whole graph serves every stage of a tp rank (parc/compiler.py), and this pass only reads
    # it: its analysis is made once per graph, not once per stage
    if gm.meta.get("parc_split", (None,))[0] != stages:
        stage_of = _stage_of(gm)
        gm.meta["parc_split"] = (stages, stage_of, _constant_only(gm), _needs_grad(gm, ctx.traced),
                                 crossing(gm, stages), unused_owners(gm, ctx.traced, stage_of))
    _, stage_of, const, grad, cuts, unused = gm.meta["parc_split"]
    recv = cuts[s - 1] if s > 0 else []
    send = cuts[s] if s < stages - 1 else []
    for n in recv + send:
        b = stage_of[n]  # the first cut it crosses
        span = _cut_span(plan, b)
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise ParcError(f"value `{n.name}` ({type(n.meta.get('val')).__name__}) from module "
                            f"`{module_path(n)}` crosses the cut after stage {b}, and only tensors "
                            f"can be sent", span, hint="move the cut so that it does not split this computation")
        if n.meta.get("parc_bounded"):  # the receiver posts a buffer of the recorded shape (parc/trace_sizes.py)
            raise ParcError(f"value `{n.name}` from module `{module_path(n)}` crosses the cut after stage {b}, and "
                            "its size depends on the data: a pipeline sends tensors of a size known at compile time",
                            span, hint="move the cut so that it does not split this computation")
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state_names = {st.name for st in ctx.traced.state}
    mine = [n for n in _compute_nodes(gm) if stage_of[n] == s]
    used = {d for n in mine for d in n.all_input_nodes}
    for p in placeholders:
        if p.name in state_names and (p in used or unused.get(p.name) == s):
            env[p] = graph.node_copy(p)
    for n in recv:
        ph = graph.placeholder(f"recv_{n.name}")
        ph.meta = dict(n.meta)
        env[n] = ph
    for p in placeholders:
        if p.name not in state_names:
            env[p] = graph.node_copy(p)

    def copy(n: fx.Node) -> fx.Node:
        if n not in env:
            if n in const or stage_of.get(n) == s:
                for d in n.all_input_nodes:
                    copy(d)
                env[n] = graph.node_copy(n, lambda a: env[a])
            else:
                val = n.meta.get("val")
                if isinstance(val, (int, float, bool)):
                    return val  # shape-derived scalar: the trace's value is the run's value (static shapes)
                raise ParcError(f"stage {s} needs `{n.name}` from stage {stage_of.get(n)}, which is not sent")
        return env[n]

    for n in mine:
        copy(n)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    if s == stages - 1:
        graph.output(fx.node.map_arg(out_node.args[0], lambda a: copy(a)))
    else:
        graph.output(tuple(copy(n) for n in send))
    graph.eliminate_dead_code()
    graph.lint()
    ctx.notes["pipeline"] = {"recv": [_spec(n, n in grad) for n in recv], "send": [_spec(n, n in grad) for n in send],
                             "last": s == stages - 1}
    ctx.count("pipeline_split", len(recv) + len(send))
    return _graph_module(torch.nn.Module(), graph)  # lazy: codegen prints the graph, nothing runs its code


def stage_lines(summaries: list[dict], pp: int) -> list[str]:
    """One line per stage for the compile output: where it runs, its modules, its shares."""
    return [f"stage {d['index']} (pp rank {d['index'] % pp}): {d['first']} … {d['last']}  "
            f"FLOPs {d['flops_share']:.0%}  params {d['param_share']:.0%}" for d in summaries]


def balance(summaries: list[dict]) -> float:
    """Most loaded stage's FLOPs over the mean: 1.0 is perfect balance."""
    f = [d["flops"] for d in summaries]
    return max(f) / (sum(f) / len(f)) if f and sum(f) else math.nan
