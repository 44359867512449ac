"""Sizes that depend on the data, bounded: what parc's passes and estimates read of a traced graph.

torch.export traces an op whose output size depends on the values (`nonzero`, a boolean mask's rows, the tokens
a router sends to one expert) with an unbacked symbol, u0, and a range for it: [0, 32] when at most every one of
32 token slots can land there. parc's passes and its memory and FLOPs estimates need numbers, and the first
`int()` or `if` on u0 raised torch's GuardOnDataDependentSymNode from deep inside `parc compile`: a traceback
for a model plain data parallelism trains.

`bound_sizes(gm)` gives each such value's recorded tensor (`meta["val"]`) the largest sizes the ranges allow
(u0 → 32), same dtype and device, and marks the node `meta["parc_bounded"]` (`bounded_nodes` lists them); the graph's ops, and so the
program a rank runs, are unchanged: only what parc reads of the sizes is bounded. Upper bounds price memory at
its worst case and the FLOPs of such ops high (an expert's rows as if every token came to it). A size with no
finite bound is refused, located at the op that makes it. Start at `bound_sizes`; passes that re-derive
each rank's shapes (tensor and context parallelism) refuse such a graph with `refuse_resharding`.
"""

from __future__ import annotations

from pathlib import Path

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.numbers import int_oo

from parc.errors import ParcError, Span, TraceError
from parc.trace_constants import creation_span
from parc.traced import module_path


def _bound(size, node: fx.Node, user_path: Path | None) -> int:
    """The largest value `size` (an int, or a SymInt of unbacked symbols) can take: torch's interval bound of its
    expression over its symbols' ranges."""
    if isinstance(size, int):
        return size
    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    if upper in (int_oo, sympy.oo) or not upper.is_finite:   # torch's int_oo says it is finite
        raise TraceError(f"`{node.target}` in module `{module_path(node) or '(the root)'}` makes a tensor whose size, "
                         f"{size.node.expr}, depends on the data and has no upper bound: parc sizes every tensor it "
                         "plans for", creation_span([node], user_path) if user_path else None,
                         hint="make the size static (pad to a fixed capacity, as Megatron's and torchtitan's MoE "
                              "layers do), or bound it with torch._check(size <= N)")
    return int(upper)


def bound_sizes(gm: fx.GraphModule, user_path: Path | None = None) -> list[str]:
    """Replace every data-dependent size in `gm`'s recorded tensors by its upper bound (module docstring); return
    the names of the nodes changed (empty for a graph with static shapes, which this leaves as it was).
    `user_path`: the model file, whose lines an unbounded size's error prefers."""
    changed = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or all(isinstance(s, int) for s in (*val.shape, *val.stride())):
            continue
        shape = [_bound(s, n, user_path) for s in val.shape]
        stride = [_bound(s, n, user_path) for s in val.stride()]
        with val.fake_mode:   # a symbolic size exists only on a fake tensor
            n.meta["val"] = torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
        n.meta["parc_bounded"] = True
        changed.append(n.name)
    return changed


def bounded_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes `bound_sizes` gave upper bounds (copies of them, which the passes make with their meta, too)."""
    return [n for n in gm.graph.nodes if n.meta.get("parc_bounded")]


def refuse_resharding(gm: fx.GraphModule, what: str, span: Span | None) -> None:
    """Raise, at `span` (the plan's block for `what`), when `gm` has a data-dependent size: `what` re-derives each
    rank's local shapes by running the graph's ops on fake tensors, and such a size has no value to run them with."""
    bounded = bounded_nodes(gm)
    if bounded:
        n = bounded[0]
        raise ParcError(f"{what} needs every size known at compile time, and `{n.target}` in module "
                        f"`{module_path(n) or '(the root)'}` makes a tensor whose size depends on the data "
                        f"({len(bounded)} such tensor{'s' * (len(bounded) > 1)} in the graph)", span,
                        hint="train this model with dp, ZeRO or pp, which do not change its shapes, or make the "
                             "size static (pad to a fixed capacity, as Megatron's and torchtitan's MoE layers do)")
