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


def shape(n) -> tuple[int, ...]:
    return tuple(n.meta["val"].shape)


def is_param(n) -> bool:
    """A parameter placeholder of the traced graph (torch.export names them `p_<fqn>`)."""
    return isinstance(n, fx.Node) and n.op == "placeholder" and n.name.startswith("p_")
