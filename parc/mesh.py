"""The device mesh: global rank ↔ (dp, pp, tp[, cp]) coordinates, and the groups per axis.

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
    cp: int | None = None  # only on a mesh whose order names cp (mesh cp > 1): other plans' records keep 3 axes

    def as_dict(self) -> dict[str, int]:
        out = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        if self.cp is not None:
            out["cp"] = self.cp
        return out


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


def _stride(mesh: Mesh, axis: str) -> int:
    """How far apart two ranks are whose coordinates differ by 1 along `axis`: the product of the degrees
    of the axes inner to it in `mesh.order` (the mixed radix of `coords`)."""
    stride = 1
    for a in mesh.order:
        if a == axis:
            return stride
        stride *= mesh.degree(a)
    raise ValueError(f"unknown mesh axis {axis!r}")


def groups(mesh: Mesh, axis: str) -> list[list[int]]:
    """All groups along `axis`: ranks that differ only in their `axis` coordinate.

    Sorted by their first rank; every rank is in exactly one group per axis. Each group is the rank whose
    `axis` coordinate is 0 and its `degree - 1` successors `stride` apart (`_stride`): arithmetic, so a
    planner can ask for the groups of 16,384 ranks many times (decoding every rank's coordinates took
    0.15 s a call there).
    """
    return [list(g) for g in iter_groups(mesh, axis)]


def iter_groups(mesh: Mesh, axis: str):
    """`groups`, one `range` at a time: for a caller that needs only some of them (the planner keeps one group
    of each placement on the nodes and stops once it has seen every one)."""
    if axis not in AXES and not (axis == "cp" and "cp" in mesh.order):
        raise ValueError(f"unknown mesh axis {axis!r}")
    stride, size = _stride(mesh, axis), mesh.degree(axis)
    # the first ranks are those with `axis` coordinate 0: every block of stride × size ranks starts stride of them
    return (range(r, r + stride * size, stride)
            for block in range(0, mesh.world_size, stride * size) for r in range(block, block + stride))


def dp_cp_groups(mesh: Mesh) -> list[list[int]]:
    """Ranks that differ only in their dp and cp coordinates: they hold the same parameters (cp ranks see
    different tokens of the same samples), so their gradients are reduced together (runtime/train.py)."""
    (sp, p), (st, t) = ((_stride(mesh, a), mesh.degree(a)) for a in ("pp", "tp"))
    seen: dict[tuple, list[int]] = {}
    for r in range(mesh.world_size):
        seen.setdefault(((r // sp) % p, (r // st) % t), []).append(r)
    return sorted(seen.values(), key=lambda g: g[0])


def group_of(mesh: Mesh, axis: str, rank: int) -> list[int]:
    return next(g for g in groups(mesh, axis) if rank in g)


def expert_groups(mesh: Mesh) -> dict[str, list[list[int]]]:
    """The expert-parallel groups carved out of dp, as DeepSpeed and Megatron carve them.

    Each dp group (ranks that differ only in their dp coordinate, in dp order) is cut into
    runs of `mesh.ep` consecutive dp coordinates: an "ep" group, whose ranks hold different
    experts and exchange tokens. The ranks of a dp group with equal `dp % ep` hold the same
    experts: an "edp" (expert-data-parallel) group of dp / ep ranks, over which expert
    gradients are reduced. Assumes ep divides dp (grammar/validate.py checks it).
    """
    ep = mesh.ep
    out: dict[str, list[list[int]]] = {"ep": [], "edp": []}
    for dp_group in groups(mesh, "dp"):  # in dp-coordinate order: coords() decodes it so
        out["ep"] += [dp_group[i:i + ep] for i in range(0, len(dp_group), ep)]
        out["edp"] += [dp_group[j::ep] for j in range(ep)]
    return {k: sorted(v, key=lambda g: g[0]) for k, v in out.items()}


def ep_rank(mesh: Mesh, rank: int) -> int:
    """`rank`'s index in its ep group: which E/ep experts it holds."""
    return coords(mesh, rank).dp % mesh.ep


def zero_groups(mesh: Mesh, shard: int) -> dict[str, list[list[int]]]:
    """HSDP's groups (`zero stage=N shard=K`): where ZeRO's state is sharded and where it is replicated.

    Each dp group, in dp-coordinate order, is cut into runs of `shard` consecutive dp coordinates: a
    "zero_shard" group, whose ranks hold different ranges of the state (reduce-scatter, all-gather).
    The ranks of a dp group with equal `dp % shard` hold the same range: a "zero_replicate" group of
    dp / shard ranks (the all-reduce of the reduced ranges). Consecutive dp coordinates are the nearest
    ranks the mesh order allows, so a shard group stays inside a node when dp's stride times `shard`
    fits in one (`shard_sizes_in_node`). Assumes `shard` divides dp (grammar/validate.py checks it).

    Under context parallelism (mesh cp > 1) the dp × cp ranks of one tp and pp coordinate hold the same
    parameters (`dp_cp_groups`), so a shard group is `shard` consecutive dp coordinates × every cp coordinate
    (shard · cp ranks, dp-major: torchtitan's and Megatron-Core's FSDP over dp_shard × cp), and a replicate
    group the dp / shard ranks of equal dp % shard and equal cp.
    """
    out: dict[str, list[list[int]]] = {"zero_shard": [], "zero_replicate": []}
    if mesh.cp == 1:
        for dp_group in groups(mesh, "dp"):
            out["zero_shard"] += [dp_group[i:i + shard] for i in range(0, len(dp_group), shard)]
            out["zero_replicate"] += [dp_group[j::shard] for j in range(shard)]
    for ranks in dp_cp_groups(mesh) if mesh.cp > 1 else ():
        at = {(c.dp, c.cp): r for r, c in ((r, coords(mesh, r)) for r in ranks)}
        out["zero_shard"] += [[at[d, c] for d in range(i, i + shard) for c in range(mesh.cp)]
                              for i in range(0, mesh.dp, shard)]
        out["zero_replicate"] += [[at[d, c] for d in range(j, mesh.dp, shard)]
                                  for j in range(shard) for c in range(mesh.cp)]
    return {k: sorted(v, key=lambda g: g[0]) for k, v in out.items()}


def shard_sizes_in_node(mesh: Mesh, gpus_per_node: int) -> list[int]:
    """The divisors K of dp whose shard groups each sit on one node of `gpus_per_node` ranks (rank // gpn).

    A shard group is K ranks `stride` apart (dp's `_stride`), from a first rank r0 whose dp coordinate is a
    multiple of K; it sits on one node when r0 mod gpn + stride·(K − 1) < gpn. Only r0 mod gpn matters, so
    the residues of every such r0 are built axis by axis (each axis adds c·stride_a, c < its degree; at
    most gpn residues each) instead of walking the world's ranks for each K. Under context parallelism a
    shard group also spans every cp coordinate (`zero_groups`): r0's cp coordinate is 0, and the group
    reaches cp_stride·(cp − 1) further."""
    gpn, dp_stride = gpus_per_node, _stride(mesh, "dp")
    cp_spread = _stride(mesh, "cp") * (mesh.cp - 1) if mesh.cp > 1 else 0

    def residues(k: int) -> set[int]:
        out, stride = {0}, 1
        for a in mesh.order:
            step, count = (stride * k, mesh.dp // k) if a == "dp" else (stride, 1 if a == "cp" else mesh.degree(a))
            # c·step mod gpn repeats with period ≤ gpn: no more than gpn values of c are distinct
            out = {(x + c * step) % gpn for x in out for c in range(min(count, gpn))}
            stride *= mesh.degree(a)
        return out

    return [k for k in range(1, mesh.dp + 1) if mesh.dp % k == 0 and
            max(residues(k)) + dp_stride * (k - 1) + cp_spread < gpn]
