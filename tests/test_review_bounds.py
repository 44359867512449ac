"""`parc check`'s review (parc/analysis/review.py) on big meshes and bad presets (issue 10).

Start at `test_split_tp_groups_match_the_rank_lists`: the review counts tp groups that
cross nodes by arithmetic (one division per group) instead of listing every rank of
the mesh; it must agree with `parc.mesh.groups` on every small mesh and order, and
stay cheap at the largest mesh a plan may state.
"""

from __future__ import annotations

import itertools
import time

from parc import mesh as meshlib
from parc.grammar.parser import parse
from parc.grammar.plan import Mesh
from parc.grammar.validate import MAX_WORLD
from parc.analysis.review import _split_tp_groups, review


def test_split_tp_groups_match_the_rank_lists():
    for dp, pp, tp in itertools.product((1, 2, 3), (1, 2, 3), (2, 3, 4)):
        for order in itertools.permutations(("dp", "pp", "tp")):
            m = Mesh(dp=dp, pp=pp, tp=tp, order=order)
            for gpus_per_node in range(tp, 9):
                split = [g for g in meshlib.groups(m, "tp") if len({r // gpus_per_node for r in g}) > 1]
                assert _split_tp_groups(m, gpus_per_node) == (len(split), split[0] if split else None)


def test_review_of_the_largest_mesh_is_cheap():
    plan = parse(f"mesh dp={MAX_WORLD // 4} pp=2 tp=2 order=pp,tp,dp\ntopology nodes={MAX_WORLD // 3} "
                 "gpus_per_node=3\n", "t.par")
    t0 = time.perf_counter()
    (d,) = [d for d in review(plan) if "cross nodes" in d.message]
    # 32768 divisions: ~20 ms idle; listing the 65536 ranks took seconds, 10^12 ranks forever
    assert time.perf_counter() - t0 < 5
    assert d.message == "21845 tp groups cross nodes: ranks [1, 3] sit on nodes [0, 1] with gpus_per_node 3"


def test_an_unknown_preset_is_located_with_or_without_the_model():
    from test_cost import _stats

    from parc.analysis.cost import PRESETS

    plan = parse("mesh dp=2\ntopology preset=h\n", "t.par")
    for stats in (None, _stats()):  # without --model, and with the model's statistics
        errors = [d for d in review(plan, stats=stats) if d.severity == "error"]
        assert [(d.message, d.span.line, d.span.col) for d in errors] == [
            ("topology preset `h` is not a known hardware preset", 2, 17)]
        assert errors[0].hint == "valid: " + ", ".join(sorted(PRESETS))  # every shipped preset, named once
