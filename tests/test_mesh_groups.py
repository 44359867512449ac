"""parc/mesh.py's arithmetic (groups as a first rank and its stride, HSDP shard sizes from residues modulo the
node) against the definitions it replaced: decode every rank's coordinates, walk every shard group. Every
mesh of small degrees in every order, with and without cp."""

from __future__ import annotations

import itertools

from parc import mesh as meshlib
from parc.grammar.plan import Mesh


def _groups(mesh, axis):
    seen = {}
    for r in range(mesh.world_size):
        c = meshlib.coords(mesh, r).as_dict()
        seen.setdefault(tuple(v for a, v in sorted(c.items()) if a != axis), []).append(r)
    return sorted(seen.values(), key=lambda g: g[0])


def _dp_cp(mesh):
    seen = {}
    for r in range(mesh.world_size):
        c = meshlib.coords(mesh, r)
        seen.setdefault((c.pp, c.tp), []).append(r)
    return sorted(seen.values(), key=lambda g: g[0])


def _shard_sizes(mesh, gpn):
    return [k for k in range(1, mesh.dp + 1) if mesh.dp % k == 0 and
            all(len({r // gpn for r in g}) == 1 for g in meshlib.zero_groups(mesh, k)["zero_shard"])]


def test_arithmetic_matches_the_definitions():
    for dp, pp, tp, cp in itertools.product((1, 2, 3, 4, 6), (1, 2, 3), (1, 2, 4), (1, 2)):
        axes = ("tp", "pp", "dp") + (("cp",) if cp > 1 else ())
        for order in itertools.permutations(axes):
            m = Mesh(dp, pp, tp, order=order, cp=cp)
            for a in axes:
                assert meshlib.groups(m, a) == _groups(m, a), (m, a)
            if cp > 1:
                assert meshlib.dp_cp_groups(m) == _dp_cp(m), m
            for gpn in (1, 2, 3, 4, 6, 8):
                assert meshlib.shard_sizes_in_node(m, gpn) == _shard_sizes(m, gpn), (m, gpn)
