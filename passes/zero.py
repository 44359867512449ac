"""ZeRO partitioning: give every parameter a place in a flat bucket and every dp rank its range.

Assumes: runs last, after the passes that shard or move parameters (tensor
parallel, pipeline split), so the graph's parameter placeholders and
`ctx.shards` describe this program's local parameters. `plan.zero.stage` is
0–3 and `plan.mesh.dp` is the size of the dp group the table is cut for.

Guarantees: with stage ≥ 1, `ctx.notes["zero"]` holds the partition table the
runtime (`parc.runtime.parallel.zero`) executes, which the compiler writes into the
program's plan.json entry. A bucket is one *unit* — a layer (`blocks.3`) or a
top-level module (`wte`, `ln_f`) — so ZeRO-3 gathers a whole layer at once.
Buckets are in the order their gradients become ready in backward (the order
of `parc.passes.grad_buckets`), parameters inside a bucket too, packed whole
and back to back. The bucket's numel is padded so that it splits into dp equal
ranges of a multiple of `ALIGN` elements each: dp rank r owns
[r·shard, (r+1)·shard). Equal ranges are what reduce-scatter and all-gather
into one flat tensor need; ranges may cut through a parameter (as FSDP's flat
parameter does). With expert parallelism the expert slots are left out of that
table and cut into their own, `ctx.notes["zero_experts"]`, over the edp group
(dp / ep ranks: those holding the same experts; runtime/parallel/expert_parallel.py
`ExpertZero`). The graph is returned unchanged.

HSDP (`zero stage=N shard=K`, K < dp): the table is cut for K ranks, the shard
group (`parc.mesh.zero_groups`): shard = padded / K, and the ranks of a shard
group own [r·shard, (r+1)·shard) by their index r in it; the dp / K shard groups
hold the same ranges (replicas). `table["dp"]` stays the whole dp (the mean's
divisor); `table["shard_size"]` is K.

Context parallelism (mesh cp > 1): the table is cut for the dp × cp ranks of the `dp_cp` group (they hold the
same parameters); `table["dp"]` stays dp, the mean's divisor (`shard_size` dp·cp; with HSDP K·cp, the shard
group of K dp coordinates × every cp coordinate, replicated over dp / K); `table["cp"]` is cp.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from parc.passes import PassCtx, grad_buckets
from parc.runtime.parallel import zero as zero_runtime  # registers torch.ops.parc.zero_unshard

# what places a node: its module path (the recompute pass's regions) and its pipeline stage
_PLACE_META = ("nn_module_stack", "parc_stage", "stack_trace")
ALIGN = 16  # elements per rank range: 64 bytes in fp32, a cache line; keeps every shard vector-aligned


def _local_shape(spec, shard: dict | None) -> tuple[int, ...]:
    shape = list(spec.shape)
    if shard is not None:
        shape[shard["dim"]] //= shard["parts"]
    return tuple(shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def unit_of(fqn: str) -> str:
    """The gather unit of a parameter: up to its layer index (`blocks.3`), else its owning module."""
    parts = fqn.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return ".".join(parts[:-1]) or parts[0]


def shard_size(plan) -> int:
    """The ranks one copy of ZeRO's state is cut over: `zero shard=K` dp ranks, else all of dp, times cp under
    context parallelism (the dp × cp ranks hold the same parameters and reduce their gradients together, so ZeRO
    shards over all of them, as Megatron-Core's distributed optimizer does; HSDP's K dp ranks × cp, as torchtitan
    shards FSDP over dp_shard × cp: parc/mesh.py `zero_groups`)."""
    return (plan.zero.shard or plan.mesh.dp) * plan.mesh.cp


def hsdp(plan) -> bool:
    """Whether the plan shards ZeRO's state over groups smaller than dp (and so replicates it across them)."""
    return plan.zero.stage >= 1 and shard_size(plan) < plan.mesh.dp * plan.mesh.cp


def partition(gm: fx.GraphModule, state_specs: list, shards: dict, stage: int, dp: int, align: int = ALIGN,
              shard: int | None = None) -> dict:
    """The partition table (see the module docstring) for the program `gm`; `shard` (HSDP): the ranks the
    ranges are cut over, default all of `dp`."""
    k = shard or dp
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    specs = [s for s in state_specs if s.name in placeholders]
    by_name = {s.name: s for s in specs}
    # cap 0: one parameter per bucket, so the flattened list is the backward-ready order itself
    ready = [b[0] for b in grad_buckets.assign(gm, specs, cap_bytes=0)]
    units: dict[str, list[str]] = {}
    for name in ready:
        units.setdefault(unit_of(by_name[name].fqn), []).append(name)
    buckets, padding = [], 0
    quantum = k * align
    for unit, names in units.items():
        params, offset = [], 0
        for name in names:
            shape = _local_shape(by_name[name], shards.get(name))
            params.append({"name": name, "fqn": by_name[name].fqn, "shape": list(shape),
                           "offset": offset, "numel": _numel(shape)})
            offset += _numel(shape)
        padded = -(-offset // quantum) * quantum
        padding += padded - offset
        buckets.append({"unit": unit, "params": params, "numel": offset, "padded": padded,
                        "shard": padded // k, "dtype": by_name[names[0]].dtype})
    return {"stage": stage, "dp": dp, "shard_size": k, "align": align, "buckets": buckets,
            "numel": sum(b["numel"] for b in buckets), "padding": padding}


def run(gm: fx.GraphModule, plan, ctx: PassCtx) -> fx.GraphModule:
    if plan.zero.stage == 0:
        return gm
    experts = ctx.notes.get("expert_parallel") or {}  # ep slots: partitioned over edp (runtime/parallel/expert_parallel.py)
    dense = [s for s in ctx.traced.state if s.name not in experts]
    ctx.notes["zero"] = partition(gm, dense, ctx.shards, plan.zero.stage, plan.mesh.dp, shard=shard_size(plan))
    if plan.mesh.cp > 1:  # the ranks holding one copy's ranges are dp · cp / shard_size apart (replicas)
        ctx.notes["zero"]["cp"] = plan.mesh.cp
    if plan.zero.offload:  # ZeRO-Offload: the runtime keeps masters and optimizer state on the host
        ctx.notes["zero"]["offload"] = plan.zero.offload
    if experts:
        ctx.notes["zero_experts"] = partition(gm, [s for s in ctx.traced.state if s.name in experts], ctx.shards,
                                              plan.zero.stage, plan.mesh.dp // plan.mesh.ep)
    ctx.count("zero", len(ctx.notes["zero"]["buckets"]))
    if plan.zero.stage == 3:
        _insert_unshard(gm, ctx.notes["zero"])
    else:
        _insert_waits(gm, ctx.notes["zero"], compiled=getattr(plan, "compile", "none") != "none")
    gm.recompile()
    return gm


def _first_uses(gm: fx.GraphModule, table: dict):
    """(bucket index, bucket, its parameters' placeholder nodes, the graph's first node using any of them), for
    each bucket the graph uses: where a bucket's weights must be whole (gathered) at the latest."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for b, bucket in enumerate(table["buckets"]):
        params = [nodes[p["name"]] for p in bucket["params"]]
        users = [u for p in params for u in p.users]
        if users:
            yield b, bucket, params, min(users, key=order.__getitem__)


def _insert_waits(gm: fx.GraphModule, table: dict, compiled: bool = False) -> None:
    """Stages 1–2: a `zero_wait_gather` before each bucket's first use, so the next forward waits for
    each layer's post-step all-gather just before that layer (runtime/parallel/zero.py, "Overlap").
    `compiled` (the plan's `compile` is not none): `zero_wait_gather_into`, the form that declares it writes
    the weights, so a compiled graph cannot read them before it.

    The wait takes the first user's module path and stage, so the recompute pass keeps it inside that
    user's region, still before it (a region is cut out whole and moved as one)."""
    op = (torch.ops.parc.zero_wait_gather_into if compiled else torch.ops.parc.zero_wait_gather).default
    for b, bucket, params, first in _first_uses(gm, table):
        with gm.graph.inserting_before(first):
            wait = gm.graph.call_function(op, (params, b))
        wait.meta.update({k: v for k, v in first.meta.items() if k in _PLACE_META})
    # the runtime may leave the gathers to these ops (runtime/train.py): "declared" says a compiled program's
    # waits order its reads (a program compiled before they did says True, and its runtime waits in `step`)
    table["gather_waits"] = "declared" if compiled else True


def _insert_unshard(gm: fx.GraphModule, table: dict) -> None:
    op = torch.ops.parc.zero_unshard.default
    for b, bucket, params, first in _first_uses(gm, table):
        sizes = [p["numel"] for p in bucket["params"]] + [bucket["padded"] - bucket["numel"]]
        with gm.graph.inserting_before(first):
            flat = gm.graph.call_function(op, (params, b))
            parts = gm.graph.call_function(torch.ops.aten.split_with_sizes.default, (flat, sizes))
            for i, (node, spec) in enumerate(zip(params, bucket["params"])):
                piece = gm.graph.call_function(operator.getitem, (parts, i))
                full = gm.graph.call_function(torch.ops.aten.view.default, (piece, spec["shape"]))
                node.replace_all_uses_with(full, delete_user_cb=lambda u: u is not flat)
