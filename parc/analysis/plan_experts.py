"""`parc plan`'s expert parallelism: find the model's expert ModuleLists, add ep candidates, price them.

Start at `find`. A model has experts when a ModuleList below the pipelined layers (its numbered paths
generalised to a glob, `blocks.1.moe.experts` → `blocks.*.moe.experts`) is accepted by the
expert_parallel pass's own matcher (`passes.expert_parallel.layers`: the form docs/moe.md states,
nothing rewritten), so the planner proposes exactly what `parc compile` can spread. `variants` adds,
for every candidate with dp > 1, one per ep > 1 that divides dp and every layer's expert count, with
`expert_parallel { glob }`; what parc refuses with ep (parc/analysis/support.py) is dropped by the
planner's usual check, not here. `params_per_rank` and `price` give such a candidate its memory
(1/ep of the experts) and its all-to-all time on the step (parc/analysis/experts.py).

Assumes the trace is of micro-batch 1: each layer's capacity slots are scaled linearly to the
candidate's micro-batch (cap = ⌈cf·k·tokens/E⌉ scaled from one sample's, an upper bound by at most one
slot per expert and sample: the rounding), so the volume of a larger micro-batch may be slightly high.
"""

from __future__ import annotations

import re
from dataclasses import replace

from parc.analysis import experts
from parc.errors import ParcError
from parc.grammar.plan import ExpertParallel, Plan


def find(traced, layer_prefix: str | None) -> dict | None:
    """{"globs", "counts", "info"} for the model's expert ModuleLists, or None if it has none."""
    paths = traced.module_paths
    lists = [p for p in paths if f"{p}.0" in paths and f"{p}.1" in paths and p != layer_prefix]
    globs = list(dict.fromkeys(re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", p) for p in lists))
    found = []
    for glob in globs:
        try:
            info = experts.layers_of(traced, Plan(expert_parallel=ExpertParallel((glob,))))
        except ParcError:  # a ModuleList, but not of experts in the form the pass spreads
            continue
        if info["layers"]:
            found.append(glob)
    if not found:
        return None
    info = experts.layers_of(traced, Plan(expert_parallel=ExpertParallel(tuple(found))))
    return {"globs": tuple(found), "counts": sorted({lay["experts"] for lay in info["layers"]}), "info": info}


def variants(plans: list[Plan], moe: dict | None) -> list[Plan]:
    """Each plan with dp > 1 and pp 1 once more per ep > 1 dividing dp and every expert count. Pipelined
    ep plans run (tests/test_moe_pp.py) but are not priced here yet: the expert parameters each pp rank
    holds are counted for the whole model (`experts.params_per_rank`), so they are not candidates."""
    if moe is None:
        return []
    out = []
    for plan in plans:
        if plan.mesh.pp > 1:
            continue
        for ep in range(2, plan.mesh.dp + 1):
            if plan.mesh.dp % ep == 0 and all(n % ep == 0 for n in moe["counts"]):
                out.append(replace(plan, mesh=replace(plan.mesh, ep=ep),
                                   expert_parallel=ExpertParallel(moe["globs"])))
    return out


def _scaled(moe: dict, micro: int) -> dict:
    layers = [dict(lay, slots=[lay["slots"][0], lay["slots"][1] * micro, *lay["slots"][2:]])
              for lay in moe["info"]["layers"]]
    return dict(moe["info"], layers=layers)


def params_per_rank(plan: Plan, moe: dict | None) -> list[int] | None:
    """What one rank holds under `plan` (pp = 1: `variants` makes no pipelined ep plan), or None to let the cost model count."""
    if moe is None or plan.mesh.ep == 1:
        return None
    return experts.params_per_rank(moe["info"], plan.mesh.ep)


def price(est, plan: Plan, moe: dict | None, hw):
    """`est` with the ep all-to-all's time on the step; unchanged without ep."""
    if moe is None or plan.mesh.ep == 1:
        return est
    return experts.charge(est, experts.section(_scaled(moe, plan.micro_batch), plan, hw)["row"])
