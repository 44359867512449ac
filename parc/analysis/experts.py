"""Expert parallelism in the cost model: the all-to-all volume and time per rank (intra / inter node)
and the expert state each rank holds, for `parc report` and `parc plan`.

Start at `layers_of` (what the plan's MoE layers are) and `section` (what they cost). The layers come
from a compiled artifact's plan.json (`expert_parallel.layers`, written by passes/expert_parallel.py) or,
without one, from the traced graph by the pass's own matcher (`passes.expert_parallel.layers`: the same
form, nothing rewritten), so the analytic and the compiled report read the same (E, cap, C) slots.

The volume is docs/moe.md's: per MoE layer and micro-batch, two all-to-alls forward and two backward,
each sending (ep − 1) / ep of the layer's (E, cap, C) slots to the other ranks of the ep group; a peer on
another node (topology gpus_per_node, ep groups as `parc.mesh.expert_groups` places them) is reached at
the inter-node bandwidth. Its time is added to the step (`charge`): the experts wait for the tokens and
the combine for the experts, so nothing overlaps it. Assumes mesh ep > 1 (tp = pp = 1, which
parc/analysis/support.py requires with ep); `section` returns None otherwise.
"""

from __future__ import annotations

import math

from parc.mesh import expert_groups

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_STATE_BYTES = 4 + 4 + 8  # fp32 parameter, gradient, Adam's two moments (parc/analysis/cost.py's table)


def layers_of(traced, plan) -> dict:
    """The MoE layers of a traced model under `plan`, from the graph (no pass runs, nothing rewritten):
    {"layers": [{path, experts, slots, dtype}], "expert_params": trainable parameters inside them,
    "params": every trainable parameter}. Raises the pass's located ParcError on a form it refuses."""
    from parc.passes.expert_parallel import describe, layers

    found = [describe(layer) for layer in layers(traced.gm, plan, traced.module_paths)]
    params = [s for s in traced.state if s.kind == "param" and s.requires_grad]
    inside = [s for s in params if any(s.fqn.startswith(lay["path"] + ".") for lay in found)]
    return {"layers": found, "expert_params": sum(math.prod(s.shape) for s in inside),
            "params": sum(math.prod(s.shape) for s in params)}


def params_per_rank(info: dict, ep: int) -> list[int]:
    """Parameters one rank holds (pp = 1): the rest of the model and 1/ep of the experts."""
    return [info["params"] - info["expert_params"] + info["expert_params"] // ep]


def _crossing(groups: list[list[int]], per_node: int) -> float:
    """The largest share, over ep groups, of a rank's peers that sit on another node."""
    worst = 0.0
    for g in groups:
        for a in g:
            peers = [b for b in g if b != a]
            if peers:
                worst = max(worst, sum(a // per_node != b // per_node for b in peers) / len(peers))
    return worst


def section(info: dict | None, plan, hw) -> dict | None:
    """The ep all-to-all row (per rank per step) and the expert state per rank, or None without ep."""
    if info is None or plan.mesh.ep == 1:
        return None
    ep, layers = plan.mesh.ep, info["layers"]
    calls = 4 * plan.accumulation  # per layer and step: 2 forward, 2 backward, per micro-batch
    per_call = sum(math.prod(lay["slots"]) * _BYTES.get(lay["dtype"], 4) for lay in layers) * (ep - 1) / ep
    volume = calls * per_call
    crossing = _crossing(expert_groups(plan.mesh)["ep"], hw.gpus_per_node)
    seconds = volume * (1 - crossing) / hw.intra_bw + volume * crossing / hw.inter_bw + \
        calls * len(layers) * (ep - 1) * (hw.latency_inter if crossing else hw.latency_intra)
    row = {"axis": "ep", "collective": "all-to-all", "group": ep, "bytes_per_rank": round(volume),
           "intra_bytes": round(volume * (1 - crossing)), "inter_bytes": round(volume * crossing),
           "seconds": seconds}
    local = info["expert_params"] // ep
    experts = {"layers": len(layers), "per_layer": [lay["experts"] for lay in layers], "ep": ep,
               "params_per_rank": local, "params_total": info["expert_params"],
               "state_bytes_per_rank": local * _STATE_BYTES}
    return {"row": row, "experts": experts}


def from_artifact(pj: dict) -> dict:
    """`layers_of`'s dict from a compiled plan.json: the pass's layers and the programs' expert state."""
    program = next(iter(pj["programs"].values()))
    local = sum(math.prod(e["shape"]) for e in program["state"] if "ep_fqns" in e)
    ep = pj.get("expert_parallel", {}).get("ep", 1)
    return {"layers": pj.get("expert_parallel", {}).get("layers", []), "expert_params": local * ep}


def charge(est, row: dict):
    """`est` with the all-to-all's time on the step (not overlapped: the experts wait on it) and its row."""
    from parc.analysis.cost import Comm, on_step

    comm = Comm(row["axis"], row["collective"], row["group"], row["bytes_per_rank"], row["intra_bytes"],
                row["inter_bytes"], row["seconds"])
    return on_step(est, [comm], "ep_seconds")


def line(experts: dict) -> str:
    """One line for the rendered report."""
    counts = ", ".join(str(n) for n in experts["per_layer"])
    return (f"experts: {experts['layers']} MoE layer(s) of {counts} experts, each rank holds 1/{experts['ep']}: "
            f"{experts['params_per_rank']:,} of {experts['params_total']:,} expert parameters, "
            f"{experts['state_bytes_per_rank'] / 2**20:.2f} MiB with gradients and Adam's moments (fp32)")
