"""Plan review for `parc check`: the checks that need the topology, the schedule or the cost model.

Start at `review(plan, world_size=, stats=, preset=)`. `parc.grammar.validate` checks a plan
against itself; this looks at how it lands on hardware:

- the world size against the topology (nodes × gpus_per_node): the topology is the
  cluster, so a launch may use fewer ranks than it has devices, never more;
- tp groups that cross nodes because the mesh order puts one tp group's ranks on
  two nodes (its all-reduces then run at network speed; tp > gpus_per_node is
  already a warning of parc.grammar.validate);
- a pipeline with too few micro-batches for pp (the schedule's bubble figure,
  from `parc.passes.schedule.schedule_diagnostics`);
- with the model's statistics (`stats`, from `parc.cost.graph_stats`): per-rank
  memory against the GPU's — an error when the plan names its hardware
  (`topology preset=`), a warning when the preset is assumed.
"""

from __future__ import annotations

import functools

from dataclasses import replace

from parc.analysis import cost, cp_cost
from parc.analysis.preset_file import is_file, resolve
from parc.errors import Diagnostic, ParcError, Span
from parc.grammar.plan import Plan, Topology


def preset_error(plan: Plan) -> Diagnostic | None:
    """A `topology preset=` the cost model does not know, located at the value; parc check and parc compile
    both refuse it, so a compiled plan never fails later in `parc report` without a location."""
    name = resolve(plan.topology.preset, plan.file)
    if name is None:
        return None
    try:
        cost.hardware(name)
    except ParcError as e:
        span = plan.spans.get("topology.preset") or (Span(plan.file, 1, 1) if plan.source else None)
        return Diagnostic(f"topology preset `{plan.topology.preset}` is not a known hardware preset", span,
                          e.diagnostics[0].hint, "error", plan.source or None) if not is_file(name) else \
            Diagnostic(f"topology preset `{plan.topology.preset}`: {e.diagnostics[0].message}", span,
                       e.diagnostics[0].hint or "a preset file's path is read relative to the plan's directory",
                       "error", plan.source or None)
    return None


def review(plan: Plan, *, world_size: int | None = None, stats: dict | None = None,
           preset: str | None = None) -> list[Diagnostic]:
    out: list[Diagnostic] = []

    def diag(message, key, hint=None, severity="warning"):
        span = plan.spans.get(key) or (Span(plan.file, 1, 1) if plan.source else None)
        out.append(Diagnostic(message, span, hint, severity, plan.source or None))

    topo, m = plan.topology, plan.mesh
    stated = topo != Topology()
    devices = topo.nodes * topo.gpus_per_node
    if stated and world_size is not None and world_size > devices:
        diag(f"world size {world_size} > topology nodes {topo.nodes} × gpus_per_node {topo.gpus_per_node} = "
             f"{devices} devices", "topology", "state the cluster the job runs on in `topology`", "error")
    elif stated and world_size is None and m.world_size < devices:  # a stated launch size means it on purpose
        diag(f"mesh dp {m.dp} × pp {m.pp} × tp {m.tp} = {m.world_size} ranks leave {devices - m.world_size} of "
             f"topology nodes {topo.nodes} × gpus_per_node {topo.gpus_per_node} = {devices} devices idle",
             "topology")
    # tp > gpus_per_node is parc.grammar.validate's warning; here: a tp group that would fit a node but is placed on two
    split, g = _split_tp_groups(m, topo.gpus_per_node) if 1 < m.tp <= topo.gpus_per_node else (0, None)
    if split:
        nodes = sorted({r // topo.gpus_per_node for r in g})
        diag(f"{split} tp group{'s' * (split != 1)} cross nodes: ranks {g} sit on nodes {nodes} with "
             f"gpus_per_node {topo.gpus_per_node}", "mesh.order" if "mesh.order" in plan.spans else "mesh",
             "put tp innermost (order=tp,pp,dp) so a tp group shares a node")
    if m.pp > 1:
        from parc.passes.schedule import schedule_diagnostics

        pipe = plan.pipeline
        name, virtual = (pipe.schedule, pipe.virtual) if pipe is not None else ("1f1b", 1)
        span = plan.spans.get("mesh.pp")
        out += [replace(d, span=d.span or span, source=d.source or plan.source or None)
                for d in schedule_diagnostics(name, m.pp, plan.accumulation, virtual)]
    unknown = preset_error(plan)
    if unknown is not None:
        return out + [unknown]
    if stats is not None:
        name = preset or resolve(topo.preset, plan.file)
        hw = cost.hardware(name, topo)
        # as `parc report` prices it: a cp rank keeps T/cp tokens' activations, an ep rank its own experts
        est = cp_cost.estimate_plan(plan, stats, hw)
        worst = max(est.memory, key=lambda row: row["total"])
        if worst["total"] > hw.memory:
            gib = cost.GiB
            parts = " + ".join(f"{k} {worst[k] / gib:.1f}" for k in ("params", "grads", "optimizer", "activations"))
            diag(f"pp rank {worst['pp_rank']} needs {parts} = {worst['total'] / gib:.1f} GiB > {hw.memory / gib:.1f} "
                 f"GiB of a {hw.name}" + ("" if name else " (assumed: no topology preset)"), "mesh",
                 "raise the zero stage, tp, pp or cp, or recompute layers; `parc report` has the breakdown",
                 "error" if name else "warning")
    return out


@functools.lru_cache(maxsize=1024)
def _split_tp_groups(m, gpus_per_node: int) -> tuple[int, list[int] | None]:
    """(how many tp groups span two nodes, the first such group): one division per group, no rank lists.
    A tp group is base + k × stride for k < tp, stride the product of the degrees inner to tp in
    `m.order`; its ranks rise with k, so it crosses nodes iff its first and last ranks do. Memoized per
    mesh (frozen, hashable): `parc plan` reviews each mesh once per candidate, and at 16,384 GPUs the walk
    over world / tp groups was a sixth of its search."""
    stride = 1
    for axis in m.order[:m.order.index("tp")]:
        stride *= m.degree(axis)
    span, first, count = stride * (m.tp - 1), None, 0
    for outer in range(0, m.world_size, stride * m.tp):
        for inner in range(stride):
            base = outer + inner
            if base // gpus_per_node != (base + span) // gpus_per_node:
                count += 1
                first = first if first is not None else [base + k * stride for k in range(m.tp)]
    return count, first
