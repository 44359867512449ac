"""The layout of a tensor-parallel value, and two small facts about graph nodes (passes/tp_layouts.py
and passes/tp_contract.py use them; passes/tensor_parallel.py starts the walk)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


@dataclass(frozen=True)
class Shard:
    """Chunk `tp_rank` of each of `blocks` equal blocks along `dim` (dims counted from 0)."""

    dim: int
    blocks: int = 1
    seq: bool = False  # a sequence-parallel slice (of the token dim), not a slice of features/heads
    rule: object = field(default=None, compare=False)  # the plan rule it came from, for error spans


# ops that read the argument at this index only for its dtype or shape: no value, no gradient flows
SHAPE_ONLY = {"type_as.default": 1, "view_as.default": 1, "_assert_tensor_metadata.default": 0}


def reads_only_meta(u: fx.Node, a: fx.Node) -> bool:
    """Does op `u` read `a` only for its dtype or shape (`x.type_as(a)`), not for its values?"""
    name = getattr(u.target, "_overloadname", None)
    i = SHAPE_ONLY.get(f"{getattr(u.target, '_opname', '')}.{name}") if name is not None else None
    return i is not None and len(u.args) > i and u.args[i] is a and a not in u.args[:i]


def shape(n) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def is_param(n) -> bool:
    """A parameter placeholder of the traced graph (torch.export names them `p_<fqn>`)."""
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name.startswith("p_")
