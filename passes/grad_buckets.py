"""Assign every trainable parameter of a program to a gradient bucket.

Assumes: the program's parameter placeholders are known (`state` specs with
kind "param"), and the graph uses each parameter in forward.
Guarantees: buckets hold whole parameters, at most `cap_bytes` each (one
parameter larger than the cap gets a bucket of its own); their order is the
order gradients become ready in backward (reverse of first use in forward), so
the runtime can launch each bucket's all-reduce as soon as its last gradient
lands and overlap it with the rest of backward — DDP's algorithm, decided here
at compile time and written to plan.json instead of rediscovered every run.

This pass reads the graph and writes no rewrites: it returns a table.
"""

from __future__ import annotations

import torch
import torch.fx as fx

DEFAULT_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def _nbytes(spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype.removeprefix("torch."))).element_size()


def assign(gm: fx.GraphModule, state_specs: list, cap_bytes: int = DEFAULT_CAP_BYTES) -> list[list[str]]:
    """Return buckets as lists of placeholder names, in backward-ready order."""
    params = {s.name: s for s in state_specs if s.kind == "param" and s.requires_grad}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    first_use: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in params:
            users = [order[u.name] for u in node.users]
            first_use[node.name] = min(users) if users else len(order)
    ready = sorted(params, key=lambda name: (-first_use.get(name, len(order)), name))
    buckets: list[list[str]] = []
    size = 0
    for name in ready:
        nb = _nbytes(params[name])
        if buckets and size + nb <= cap_bytes:
            buckets[-1].append(name)
            size += nb
        else:
            buckets.append([name])
            size = nb
    return buckets
