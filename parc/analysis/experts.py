"""`parc report`'s expert parallelism: the all-to-all volume per rank (intra / inter node) and the
expert state each rank holds, read from a compiled artifact's plan.json.

Start at `section`. The volume is docs/moe.md's: per MoE layer and micro-batch, two all-to-alls
forward and two backward, each sending (ep − 1) / ep of the layer's (E, cap, C) slots
(`expert_parallel.layers` in plan.json, written by passes/expert_parallel.py) to the other ranks
of the ep group; a peer on another node (topology gpus_per_node) is reached at the inter-node
bandwidth. Assumes an artifact compiled with mesh ep > 1; returns None otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_STATE_BYTES = 4 + 4 + 8  # fp32 parameter, gradient, Adam's two moments (parc/analysis/cost.py's table)


def _crossing(groups: list[list[int]], per_node: int) -> float:
    """The largest share, over ep groups, of a rank's peers that sit on another node."""
    worst = 0.0
    for g in groups:
        for a in g:
            peers = [b for b in g if b != a]
            if peers:
                worst = max(worst, sum(a // per_node != b // per_node for b in peers) / len(peers))
    return worst


def section(compiled: Path | None, plan, hw) -> dict | None:
    if compiled is None or plan.mesh.ep == 1:
        return None
    from parc import artifact

    pj = artifact.load(compiled).plan
    ep, layers = plan.mesh.ep, pj.get("expert_parallel", {}).get("layers", [])
    calls = 4 * plan.accumulation  # per layer and step: 2 forward, 2 backward, per micro-batch
    per_call = sum(math.prod(lay["slots"]) * _BYTES.get(lay["dtype"], 4) for lay in layers) * (ep - 1) / ep
    volume = calls * per_call
    crossing = _crossing(pj["groups"]["ep"], hw.gpus_per_node)
    seconds = volume * (1 - crossing) / hw.intra_bw + volume * crossing / hw.inter_bw + \
        calls * len(layers) * (ep - 1) * (hw.latency_inter if crossing else hw.latency_intra)
    row = {"axis": "ep", "collective": "all-to-all", "group": ep, "bytes_per_rank": round(volume),
           "intra_bytes": round(volume * (1 - crossing)), "inter_bytes": round(volume * crossing),
           "seconds": seconds}
    program = next(iter(pj["programs"].values()))
    local = sum(math.prod(e["shape"]) for e in program["state"] if "ep_fqns" in e)
    experts = {"layers": len(layers), "per_layer": [lay["experts"] for lay in layers], "ep": ep,
               "params_per_rank": local, "params_total": local * ep, "state_bytes_per_rank": local * _STATE_BYTES}
    return {"row": row, "experts": experts}


def line(experts: dict) -> str:
    """One line for the rendered report."""
    counts = ", ".join(str(n) for n in experts["per_layer"])
    return (f"experts: {experts['layers']} MoE layer(s) of {counts} experts, each rank holds 1/{experts['ep']}: "
            f"{experts['params_per_rank']:,} of {experts['params_total']:,} expert parameters, "
            f"{experts['state_bytes_per_rank'] / 2**20:.2f} MiB with gradients and Adam's moments (fp32)")
