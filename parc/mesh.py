"""The device mesh: global rank ↔ (dp, pp, tp) coordinates, and the groups per axis.

Pure arithmetic, no torch.distributed: the runtime turns `Mesh.groups(axis)` into
process groups, the compiler writes them into plan.json, and tests check them in
one process. `order` lists axes inner → outer; the default (tp, pp, dp) puts tp
ranks next to each other (one node) and dp outermost.
"""

from __future__ import annotations

from dataclasses import dataclass

from parc.grammar.plan import AXES, Mesh


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "pp": self.pp, "tp": self.tp}


def coords(mesh: Mesh, rank: int) -> Coord:
    """Mixed-radix decoding of `rank`, innermost axis first."""
    if not 0 <= rank < mesh.world_size:
        raise ValueError(f"rank {rank} outside world of {mesh.world_size}")
    out = {}
    for axis in mesh.order:
        size = mesh.degree(axis)
        out[axis] = rank % size
        rank //= size
    return Coord(**out)


def rank_of(mesh: Mesh, coord: Coord) -> int:
    rank, stride = 0, 1
    for axis in mesh.order:
        rank += getattr(coord, axis) * stride
        stride *= mesh.degree(axis)
    return rank


def groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """All groups along `axis`: ranks that differ only in their `axis` coordinate.

    Sorted by their first rank; every rank is in exactly one group per axis.
    """
    if axis not in AXES:
        raise ValueError(f"unknown mesh axis {axis!r}")
    seen: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        c = coords(mesh, r).as_dict()
        key = tuple(v for a, v in sorted(c.items()) if a != axis)
        seen.setdefault(key, []).append(r)
    return sorted(seen.values(), key=lambda g: g[0])


def group_of(mesh: Mesh, axis: str, rank: int) -> list[int]:
    return next(g for g in groups(mesh, axis) if rank in g)
