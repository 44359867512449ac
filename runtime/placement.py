"""The launch against the plan's topology: how torchrun placed the ranks on nodes.

Start at `check(plan_json, env)`, called by parc.run on every rank before any process group
starts. torchrun numbers ranks contiguously per node (agent): node k holds the ranks
k × LOCAL_WORLD_SIZE … (k + 1) × LOCAL_WORLD_SIZE - 1, and GROUP_WORLD_SIZE agents (nodes)
take part, so WORLD_SIZE = nodes × LOCAL_WORLD_SIZE. The plan's `topology` is the cluster
the plan was costed and reviewed for (parc/analysis/review.py: a launch may use fewer of
its devices, never more), so:

- a topology *stated* in the plan (its `nodes=` / `gpus_per_node=` written out) is an
  error when the launch uses more nodes, or more ranks on a node, than it states; the
  message quotes the plan's topology line and what torchrun reported;
- a topology left at its defaults (nodes 1, gpus_per_node 8, docs/plan-language.md)
  refuses nothing: a plan without one runs on any launch of the right world size;
  a multi-node launch of such a plan gets a warning that the costs assumed one node;
- a tp group whose ranks fall on two nodes of this launch gets a warning (correct, but
  its per-layer all-reduces cross the network; review.py warns the same at compile).

Without LOCAL_WORLD_SIZE (one process, or a launcher other than torchrun) the placement is
unknown and nothing is checked. Every rank computes the same verdict from the same environment (a launch with the same
--nproc-per-node on every node), so every rank exits at once and none waits in a
rendezvous for a peer that has left. Only the environment is read; nothing is imported
from torch.
"""

from __future__ import annotations

from parc.errors import LaunchError


def check(plan_json: dict, env: dict[str, str], oversubscribe: bool = False) -> list[str]:
    """Raise LaunchError on a launch the stated topology cannot hold; return warnings (one line each).
    `oversubscribe`: more ranks than GPUs on purpose (parc.run --oversubscribe), so ranks per node
    may exceed gpus_per_node."""
    if "LOCAL_WORLD_SIZE" not in env:  # not torchrun (one process, or a launcher that does not say): unknown
        return []
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env["LOCAL_WORLD_SIZE"])
    nodes = int(env.get("GROUP_WORLD_SIZE", max(world // max(local, 1), 1)))
    reported = f"torchrun started {_count(nodes, 'node')} × {_count(local, 'rank')} (WORLD_SIZE {world}, " \
               f"LOCAL_WORLD_SIZE {local}" + (f", GROUP_WORLD_SIZE {nodes})" if "GROUP_WORLD_SIZE" in env else ")")
    if nodes * local != world:
        raise LaunchError(f"{reported}: {nodes} × {local} ≠ {world}; parc needs the same --nproc-per-node on "
                          "every node")
    stated, where, line = stated_topology(plan_json["plan"])
    warnings = []
    if stated:
        want_nodes = stated.get("nodes")
        want_local = stated.get("gpus_per_node")
        if want_nodes is not None and nodes > want_nodes:
            raise LaunchError(f"{reported}, but {where} says `{line}`: {nodes} nodes > nodes {want_nodes}; "
                              f"launch it on at most {_count(want_nodes, 'node')}, or change the topology line")
        if want_local is not None and local > want_local and not oversubscribe:
            fix = f"--nnodes {world // want_local} --nproc-per-node {want_local}" if world % want_local == 0 \
                else f"--nproc-per-node ≤ {want_local}"
            raise LaunchError(f"{reported}, but {where} says `{line}`: {local} ranks on a node > gpus_per_node "
                              f"{want_local}; launch with {fix} (two agents may share one host), or change the "
                              "topology line")
    elif nodes > 1:
        warnings.append(f"launched on {_count(nodes, 'node')} × {_count(local, 'rank')}, but the plan states no topology: "
                        f"parc report costed it as one node of 8 GPUs; state `topology nodes={nodes} "
                        f"gpus_per_node={local}`")
    if nodes > 1:
        for group in plan_json["groups"]["tp"]:
            on = sorted({r // local for r in group})
            if len(on) > 1:
                warnings.append(f"tp group {group} spans nodes {on} of this launch ({local} ranks per node): its "
                                "all-reduces cross the network; put tp innermost (mesh order=tp,pp,dp) and keep "
                                f"tp ≤ {local}")
                break
    return warnings


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def stated_topology(plan: dict) -> tuple[dict[str, int], str, str]:
    """({"nodes": n, "gpus_per_node": g} for the keys the plan writes out, "file:line", the topology
    statement as written); ({}, "", "") when the plan has no topology line or leaves both at defaults."""
    from parc.errors import source_lines
    from parc.grammar.parser import parse

    source = plan.get("source", "")
    parsed = parse(source, file=plan.get("file", "<plan>"))  # compiled: it parsed once already
    keys = {k: getattr(parsed.topology, k) for k in ("nodes", "gpus_per_node") if f"topology.{k}" in parsed.spans}
    if not keys:
        return {}, "", ""
    span = parsed.spans["topology"]
    text = source_lines(source)[span.line - 1]
    return keys, f"{span.file}:{span.line}", text.split("#")[0].strip()
