"""Fast tracing of deep models: export two blocks, then replicate the second for the rest.

Start here: `trace_replicated(export, model)`. torch.export spends its time per
traced op, so a 96-layer model costs 48× a 2-layer one. A transformer's blocks
run the same code on different weights, so parc exports the model with its
repeated block list (`repeated_blocks`) cut to its first two blocks, and copies
block 1's subgraph for blocks 2..N-1. The result is the graph the full export
would give: the same state placeholders (names, FQNs, shapes, order), the same
op sequence, node names and module paths.

Why two blocks and not one: block 0 shows which values enter a block from
outside (shared by every block: rotary cos/sin, masks) and which come from the
previous block (the residual stream). In the cut graph, block 1 takes the latter
from block 0's nodes; copy k takes them from the same nodes of copy k-1.

What is checked, each failure falling back to the full export (logged at debug):
block 0's and block 1's nodes are two adjacent contiguous runs with the same ops,
arguments, constants and module paths (modulo the index); block 1 reads block 0
only where block 0 read a value of the same shape from outside; nothing after
the blocks reads block 0; no tensor made inside forward lives in a block; and
the replicated state is the full model's `named_parameters()` then
`named_buffers()`; and every block's submodules carry the same plain
attributes as block 1's (`_config_differs`), apart from one equal to the block's
own index (HF's `layer_idx`) — so config-driven per-layer variants such as
sliding-window layers fall back. What is still assumed: the code around the
blocks does not branch on the block index (`for i, b in enumerate(blocks): if i
== 5: ...`). `parc compile --exact-trace` exports in full for such models.
"""

from __future__ import annotations

import copy
import functools
import logging
import re
from collections.abc import Callable

import torch
import torch.fx as fx

from parc.traced import WRAPPER_ATTR, StateInput, Traced, get, module_path, normalize_path, repeated_blocks

log = logging.getLogger("parc.trace")
MIN_BLOCKS = 3  # with 2 blocks the cut model is the model: nothing to gain
_SUFFIX = re.compile(r"_\d+$")  # `linear_4` → base `linear`; fx renumbers the copies in graph order


class _Mismatch(Exception):
    """The cut graph does not have the structure replication needs; use the full export."""


def trace_replicated(export: Callable[[torch.nn.Module], Traced], model: torch.nn.Module) -> Traced | None:
    """`export(model)`'s result, computed from a 2-block export; None when that is not possible."""
    path, n = repeated_blocks(model)
    if n < MIN_BLOCKS:
        log.debug("replicate: %d repeated blocks at %r, exporting in full", n, path)
        return None
    owner_path, _, attr = path.rpartition(".")
    owner = get(model, owner_path) if owner_path else model
    blocks = getattr(owner, attr)
    if type(blocks) not in (torch.nn.ModuleList, torch.nn.Sequential):
        log.debug("replicate: %s is a %s subclass, exporting in full", path, type(blocks).__name__)
        return None
    differs = _config_differs(blocks)
    if differs:
        log.debug("replicate: %s, exporting in full", differs)
        return None
    first_two = list(blocks)[:2]
    cut = torch.nn.ModuleList(first_two) if type(blocks) is torch.nn.ModuleList else torch.nn.Sequential(*first_two)
    setattr(owner, attr, cut)
    try:
        small = export(model)
    except Exception as exc:  # the full export reports the user's error, if there is one
        log.debug("replicate: exporting 2 of %d blocks failed (%s), exporting in full", n, exc)
        return None
    finally:
        setattr(owner, attr, blocks)
    try:
        return _replicate(small, model, path, n)
    except _Mismatch as exc:
        log.debug("replicate: %s, exporting in full", exc)
        return None


def _replicate(small: Traced, model: torch.nn.Module, path: str, n: int) -> Traced:
    regions = _Regions(small, path)
    state = _full_state(small, model, regions, n)
    gm = _build_graph(small, regions, state, n)
    return Traced(gm=gm, state=state, inputs=small.inputs,
                  module_paths=[name for name, _ in model.named_modules() if name], num_layers=n,
                  param_count=sum(p.numel() for p in model.parameters()),
                  constants=small.constants, program=None)


class _Regions:
    """Block 0's and block 1's nodes in the cut graph, and how block 1's inputs map to block 0's."""

    def __init__(self, small: Traced, path: str):
        self.path = path
        nodes = list(small.gm.graph.nodes)
        self.placeholders = [x for x in nodes if x.op == "placeholder"]
        self.body = [x for x in nodes if x.op not in ("placeholder", "output")]
        index = {x: i for i, x in enumerate(self.body)}
        runs = [[x for x in self.body if self.block_of(x) == b] for b in (0, 1)]
        if not runs[0] or len(runs[0]) != len(runs[1]):
            raise _Mismatch(f"blocks 0 and 1 have {len(runs[0])} and {len(runs[1])} nodes")
        start, mid = index[runs[0][0]], index[runs[1][0]]
        end = mid + len(runs[1])
        if self.body[start:mid] != runs[0] or self.body[mid:end] != runs[1]:
            raise _Mismatch("blocks 0 and 1 are not two adjacent runs of nodes")
        self.block0, self.block1 = runs
        self.before, self.after = self.body[:start], self.body[end:]
        self.pos0 = {x: i for i, x in enumerate(self.block0)}
        self.pos1 = {x: i for i, x in enumerate(self.block1)}
        fqn = {s.name: s.fqn for s in small.state}
        self.param0 = {self.rest(fqn[x.name], 0): x for x in self.placeholders if self.block_of(x) == 0}
        self.param1 = {x: self.rest(fqn[x.name], 1) for x in self.placeholders if self.block_of(x) == 1}
        if set(self.param0) != set(self.param1.values()):
            raise _Mismatch("blocks 0 and 1 have different state")
        lifted = {s.name for s in small.state if s.fqn in small.constants}
        self.feeds: dict[int, fx.Node] = {}  # block-1 input from block-0 node j ↔ what block 0 read instead
        for x0, x1 in zip(self.block0, self.block1):
            self._match_node(x0, x1, lifted)
        for x in self.after:
            if any(a in self.pos0 or self.block_of(a) == 0 for a in x.all_input_nodes):
                raise _Mismatch(f"{x.name} after the blocks reads block 0, not only the last block")

    def block_of(self, x: fx.Node) -> int | None:
        """0 or 1 for nodes and state under `path.0` / `path.1`; None outside; raises for other blocks."""
        where = module_path(x)  # a state placeholder's is its FQN's owner; a user input's is ''
        if where != self.path and not where.startswith(self.path + "."):
            return None
        index = where[len(self.path) + 1:].split(".")[0]
        if index not in ("0", "1"):
            raise _Mismatch(f"{x.name} runs in {where}, outside the 2 kept blocks")
        return int(index)

    def rest(self, fqn: str, block: int) -> str:
        return fqn[len(f"{self.path}.{block}"):]

    def _match_node(self, x0: fx.Node, x1: fx.Node, lifted: set[str]) -> None:
        if (x0.op, x0.target) != (x1.op, x1.target):
            raise _Mismatch(f"block 0 runs {x0.target} where block 1 runs {x1.target}")
        if self.rest(module_path(x0), 0) != self.rest(module_path(x1), 1):
            raise _Mismatch(f"{x0.name} and {x1.name} run in different submodules")
        self._match_arg(x0.args, x1.args, x1, lifted)
        self._match_arg(x0.kwargs, x1.kwargs, x1, lifted)

    def _match_arg(self, a0, a1, user: fx.Node, lifted: set[str]) -> None:
        if isinstance(a1, fx.Node) and isinstance(a0, fx.Node):
            if a1.name in lifted or a0.name in lifted:
                raise _Mismatch(f"{user.name} reads a tensor made inside forward; its name depends on the depth")
            if a1 in self.pos1:
                ok = self.pos0.get(a0) == self.pos1[a1]
            elif a1 in self.param1:
                ok = self.param0.get(self.param1[a1]) is a0
            elif a1 in self.pos0:  # block 1 reads block 0: block 0 read its own input here
                j = self.pos0[a1]
                ok = (self.block_of(a0) is None and self.feeds.setdefault(j, a0) is a0
                      and _same_type(a0, a1))
            else:  # shared by every block (masks, rotary tables, position ids)
                ok = a0 is a1 and self.block_of(a1) is None
            if not ok:
                raise _Mismatch(f"{user.name} reads {a1.name}, which does not line up with block 0")
        elif isinstance(a1, (tuple, list)) and type(a0) is type(a1) and len(a0) == len(a1):
            for b0, b1 in zip(a0, a1):
                self._match_arg(b0, b1, user, lifted)
        elif isinstance(a1, dict) and isinstance(a0, dict) and a0.keys() == a1.keys():
            for key in a1:
                self._match_arg(a0[key], a1[key], user, lifted)
        elif isinstance(a0, fx.Node) or isinstance(a1, fx.Node) or type(a0) is not type(a1) or a0 != a1:
            raise _Mismatch(f"{user.name} has argument {a1!r} where block 0 has {a0!r}")


def _plain_attrs(module: torch.nn.Module) -> dict:
    """A module's configuration: attributes that are not tensors, submodules or hooks."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, tuple, type(None)))}


def _config_differs(blocks) -> str | None:
    """Why block k ≥ 2 may run other code than block 1, or None when all look alike."""
    template = [(name, type(m), _plain_attrs(m)) for name, m in blocks[1].named_modules()]
    for k in range(2, len(blocks)):
        mine = [(name, type(m), _plain_attrs(m)) for name, m in blocks[k].named_modules()]
        if [(n, t) for n, t, _ in mine] != [(n, t) for n, t, _ in template]:
            return f"block {k} has other submodules than block 1"
        for (name, _, a1), (_, _, ak) in zip(template, mine):
            for key in a1.keys() | ak.keys():
                v1, vk = a1.get(key), ak.get(key)
                if v1 != vk and not (v1 == 1 and vk == k):  # an attribute holding the block's own index
                    return f"block {k}{'.' + name if name else ''}.{key} = {vk!r} but block 1 has {v1!r}"
    return None


def _same_type(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return va.shape == vb.shape and va.dtype == vb.dtype


def _full_state(small: Traced, model: torch.nn.Module, regions: _Regions, n: int) -> list[StateInput]:
    """The cut graph's state with block 1's run of each kind followed by its copies for blocks 2..N-1."""
    state, run = [], []
    for s, nxt in zip(small.state, small.state[1:] + [None]):
        state.append(s)
        if s.fqn.startswith(f"{regions.path}.1."):
            run.append(s)
        if run and (nxt is None or nxt.kind != run[0].kind or not nxt.fqn.startswith(f"{regions.path}.1.")):
            state += [_copy_state(t, model, regions, k) for k in range(2, n) for t in run]
            run = []
    want = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    got = [s.fqn for s in state if s.kind in ("param", "buffer")]
    if got != want:
        raise _Mismatch("the replicated state is not the model's named_parameters() + named_buffers()")
    return state


def _copy_state(s: StateInput, model: torch.nn.Module, regions: _Regions, k: int) -> StateInput:
    fqn = f"{regions.path}.{k}{regions.rest(s.fqn, 1)}"
    # torch.export names state `p_`/`b_`/`c_` + the wrapper's FQN with dots as underscores.
    old = "_" + f"{WRAPPER_ATTR}.{regions.path}.1.".replace(".", "_")
    if s.name.count(old) != 1:
        raise _Mismatch(f"placeholder {s.name} is not named after {s.fqn}")
    try:
        value = get(model, fqn)
    except AttributeError:
        raise _Mismatch(f"the full model has no {fqn}") from None
    if not isinstance(value, torch.Tensor) or (tuple(value.shape), str(value.dtype)) != \
            (s.shape, f"torch.{s.dtype}"):
        raise _Mismatch(f"{fqn} is not shaped like {s.fqn} {s.shape} {s.dtype}")  # e.g. blocks that widen
    return StateInput(s.name.replace(old, old[:-3] + f"_{k}_"), fqn, s.kind, s.shape, s.dtype,
                      s.kind == "param" and bool(value.requires_grad))


def _build_graph(small: Traced, regions: _Regions, state: list[StateInput], n: int) -> fx.GraphModule:
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(small.gm.graph._codegen)
    old = {x.name: x for x in regions.placeholders}
    env: dict[fx.Node, fx.Node] = {}
    copies: dict[int, dict[fx.Node, fx.Node]] = {k: {} for k in range(2, n)}  # copy k: block-1 node → new
    by_rest = {rest: x for x, rest in regions.param1.items()}
    for s in state:
        if s.name in old:
            env[old[s.name]] = _placeholder(graph, old[s.name], s.name)
            continue
        k = int(s.fqn[len(regions.path) + 1:].split(".")[0])
        template = by_rest[regions.rest(s.fqn, k)]
        copies[k][template] = _placeholder(graph, template, s.name, fqn=s.fqn)
    for x in regions.placeholders[len(small.state):]:  # user inputs
        env[x] = _placeholder(graph, x, x.name)

    for x in regions.before + regions.block0 + regions.block1:
        env[x] = _copy_node(graph, x, env.__getitem__)
    prev = {x: env[x] for x in regions.block1}  # block k-1's nodes, by block-1 node
    for k in range(2, n):
        mine = copies[k]

        def arg(a: fx.Node, mine=mine, prev=prev) -> fx.Node:
            if a in mine:
                return mine[a]
            if a in regions.pos0:  # block 1 read block 0 here: copy k reads copy k-1
                return prev[regions.block1[regions.pos0[a]]]
            return env[a]

        for x in regions.block1:
            mine[x] = _copy_node(graph, x, arg, block=(regions.path, k))
        prev = {x: mine[x] for x in regions.block1}
    for x in regions.after + [next(iter(reversed(small.gm.graph.nodes)))]:
        env[x] = _copy_node(graph, x, lambda a: prev[a] if a in regions.pos1 else env[a])
    graph.lint()
    gm = _graph_module(small.gm, graph)
    gm.meta.update(getattr(small.gm, "meta", {}))
    return gm


def _graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule that generates its Python code on first use, not now.

    Compiling the code of a GPT-3-sized graph costs ~0.25 s, and parc's compile never
    runs it: codegen prints `gm.graph`. Deep copies stay lazy too (compiler.compile_program).
    """
    try:
        from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
    except ImportError:  # a torch without lazy graph modules: compile now
        return fx.GraphModule(root, graph)
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph)


def _placeholder(graph: fx.Graph, template: fx.Node, name: str, fqn: str | None = None) -> fx.Node:
    node = graph.placeholder(name)
    if node.name != name:
        raise _Mismatch(f"placeholder name {name} is taken")
    node.meta = copy.copy(template.meta)
    if fqn is not None:
        # `val` stays block 1's fake tensor, of the same shape/stride/dtype: a fresh one per
        # parameter costs ~1 ms each (0.9 s on GPT-3) and only identity would differ.
        node.meta["parc_fqn"] = fqn
    return node


def _copy_node(graph: fx.Graph, x: fx.Node, arg: Callable[[fx.Node], fx.Node],
               block: tuple[str, int] | None = None) -> fx.Node:
    # Named by base (`linear`), so fx numbers the nodes in graph order as the full export does.
    node = graph.create_node(x.op, x.target, fx.node.map_arg(x.args, arg), fx.node.map_arg(x.kwargs, arg),
                             x.name if x.op == "output" else _SUFFIX.sub("", x.name), x.type)
    node.meta = copy.copy(x.meta)
    if block is not None:
        node.meta["nn_module_stack"] = _moved_stack(x.meta.get("nn_module_stack", {}), *block)
    return node


@functools.lru_cache(maxsize=None)
def _moved_entries(entries: tuple, path: str, k: int) -> tuple:
    old, new = f"{WRAPPER_ATTR}.{path}.1", f"{WRAPPER_ATTR}.{path}.{k}"
    out = []
    for key, (raw, typ) in entries:
        if raw == old or raw.startswith(old + "."):
            moved = new + raw[len(old):]
            if not key.endswith(raw) or normalize_path(moved) != f"{path}.{k}{raw[len(old):]}":
                raise _Mismatch(f"unexpected nn_module_stack entry {key!r}: {raw!r}")
            key, raw = key[:-len(raw)] + moved, moved
        out.append((key, (raw, typ)))
    inner = normalize_path(out[-1][1][0]) if out else ""
    if inner != f"{path}.{k}" and not inner.startswith(f"{path}.{k}."):
        raise _Mismatch(f"could not move module path {inner} to block {k}")
    return tuple(out)


def _moved_stack(stack: dict, path: str, k: int) -> dict:
    """`nn_module_stack` with block 1's entries moved to block k (torch 2.13 keys: 'L__self__model.blocks.1')."""
    return dict(_moved_entries(tuple(stack.items()), path, k))
