"""Keyed dropout: every dropout draws the serial model's mask, on every rank of every plan.

Start at `run`. Changes: each `aten.dropout(x, p, train=True)` with p > 0 becomes
`parc.keyed_dropout` (and a `getitem` of its output), and each `aten.scaled_dot_product_attention` with
`dropout_p` > 0 becomes `parc.keyed_attention` (the same attention, written out,
with keyed dropout on its probabilities; runtime/dropout.py). Their masks are a
pure function of (seed, step, call site, the element's index in the serial
run's tensor over the global batch), so data, tensor and sequence parallelism,
micro-batching, pipeline stages and recompute all draw exactly the masks the
serial model draws under `--verify` (runtime/serial_reference.py keys it the same way).

Context parallelism's ring and all-to-all attentions (passes/context_parallel.py) carry SDPA's `dropout_p`
as their argument 7; they get the same key after it (site, the serial (B, H, L, S), elements per sample, tp's
record of the heads) and cut the serial mask themselves, block by block (runtime/parallel/ring_attention.py).

The call site is (module path, occurrence): the k-th dropout the module runs,
counted in graph order, which is the eager model's call order. The op's
constant arguments give the element's global coordinates: the traced (full)
shape, elements per sample (full numel / micro-batch), and the records of how the
local value was cut (`_shard`): context parallelism's sequence dim, from
`meta["parc_cp"]` (passes/context_parallel.py; the cp rank is read at run time),
then, for a value sharded over tp, `[dim, parts, tp rank, blocks]` from the
layout the tensor_parallel pass left in `meta["parc_shard"]`.

Other random ops (bernoulli, rand, `native_dropout`, feature/alpha dropout) keep
the default generators and are listed, with their modules, in
`ctx.notes["dropout"]["unkeyed"]`: `--verify` refuses them before training.
Dim 0 of a keyed value must carry the samples (batch-major layout); a traced
dim 0 that is not a multiple of the micro-batch is left unkeyed and listed too.

Assumes: runs after context_parallel and tensor_parallel (local `meta["val"]`
shapes, `parc_cp` / `parc_shard` on split random ops) and before pipeline_split, on the whole graph, so each
site's occurrence is counted over the whole model.
Guarantees: no `aten.dropout` with p > 0 and no SDPA with dropout remains; the
values computed differ only in which elements are dropped; `ctx.notes["dropout"]`
= {"sites": [{module, occurrence, kind, p, shape}], "unkeyed": [{module, op, why}]}
lists the same sites on every tp rank.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

import parc.runtime.dropout  # noqa: F401 — registers torch.ops.parc.keyed_*
import parc.runtime.parallel.ring_attention  # noqa: F401 — registers context parallelism's attentions
import parc.runtime.parallel.ulysses  # noqa: F401
from parc.errors import ParcError
from parc.runtime.dropout import LOAD_BALANCED, THIS_CP_RANK, site_id
from parc.traced import module_path

aten = torch.ops.aten
NAME = "dropout"
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# context parallelism's attentions (passes/context_parallel.py): SDPA's dropout_p is their argument 7
CP_ATTENTION = {torch.ops.parc.ring_attention.default, torch.ops.parc.ulysses_attention.default}


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    full_of = {n.name: n for n in ctx.traced.gm.graph.nodes}
    seen: dict[str, int] = {}
    sites, unkeyed = [], []
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        kind, p = _kind(node)
        if kind is None:
            if node.target is aten.dropout.default or node.target is aten.scaled_dot_product_attention.default:
                continue  # p = 0 or eval: deterministic
            if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
                unkeyed.append({"module": module_path(node), "op": str(node.target),
                                "why": "a random op parc does not key"})
            continue
        path = module_path(node)
        k = seen[path] = seen.get(path, -1) + 1
        cp_attention = node.target in CP_ATTENTION
        full = node.meta["parc_attention_full"] if cp_attention else _full_shape(full_of[node.name], kind)
        if full[0] % plan.micro_batch:
            why = f"its dim 0 ({full[0]}) does not carry the micro-batch's {plan.micro_batch} samples"
            unkeyed.append({"module": path, "op": str(node.target), "why": why})
            continue
        shard = _cp_attention_shard(node, full, plan, ctx) if cp_attention else _shard(node, kind, full, plan, ctx)
        per_sample = math.prod(full) // plan.micro_batch
        _rewrite(gm, node, kind, p, [site_id(path, k), full, per_sample, shard])
        sites.append({"module": path, "occurrence": k, "kind": kind, "p": p, "shape": full})
        ctx.count(NAME)
    ctx.notes["dropout"] = {"sites": sites, "unkeyed": unkeyed}
    gm.recompile()
    return gm


def _kind(node: fx.Node) -> tuple[str | None, float]:
    if node.target is aten.dropout.default:
        p, train = node.args[1], node.args[2]
        return ("dropout", float(p)) if train and p > 0 else (None, 0.0)
    if node.target is aten.scaled_dot_product_attention.default:
        p = _sdpa_args(node).get("dropout_p", 0.0)
        return ("attention", float(p)) if p > 0 else (None, 0.0)
    if node.target in CP_ATTENTION and len(node.args) > 7 and node.args[7] > 0:
        return "attention", float(node.args[7])
    return None, 0.0


def _sdpa_args(node: fx.Node) -> dict:
    return {**dict(zip(SDPA_ARGS, node.args)), **node.kwargs}


def _full_shape(traced: fx.Node, kind: str) -> list[int]:
    """The serial (unsharded) shape the mask covers: the dropout's input, or attention's (B, nh, L, S)."""
    if kind == "dropout":
        return list(traced.args[0].meta["val"].shape)
    q, k = traced.args[0].meta["val"].shape, traced.args[1].meta["val"].shape
    return [*q[:-1], k[-2]]


def _shard(node: fx.Node, kind: str, full: list[int], plan, ctx) -> list[int]:
    """The (dim, parts, index, blocks) records of the local value within `full`, outermost first, flat; []
    where it is whole. Context parallelism's cut of the sequence (`meta["parc_cp"]`, its dim, left by
    passes/context_parallel.py; the cp rank is read at run time) comes before tensor parallelism's
    (`meta["parc_shard"]`), which under sequence parallelism cuts the cp rank's tokens again."""
    x = node.args[0]
    local = list(x.meta["val"].shape)
    if kind == "attention":
        local = [*local[:-1], node.args[1].meta["val"].shape[-2]]
    records, expect = [], list(full)
    if node.meta.get("parc_cp") is not None:
        records.append([node.meta["parc_cp"], plan.mesh.cp, THIS_CP_RANK, LOAD_BALANCED])
    s = node.meta.get("parc_shard")
    if s is not None:
        records.append([s.dim, plan.mesh.tp, ctx.tp_rank, s.blocks])
    for dim, parts, _, _ in records:
        expect[dim] //= parts
    if local != expect:
        cuts = ", ".join(f"{'cp' if blocks == LOAD_BALANCED else 'tp'} {parts} along dim {dim}"
                         for dim, parts, _, blocks in records) or "nothing (no pass left a shard for it)"
        raise ParcError(f"dropout: `{node.name}` in module `{module_path(node)}`: local shape {local} ≠ traced "
                        f"{full} cut by {cuts} = {expect}")
    return [v for r in records for v in r]


def _cp_attention_shard(node: fx.Node, full: list[int], plan, ctx) -> list[int]:
    """tp's record of a context-parallel attention's heads (`meta["parc_shard"]`, dim 1 of q and of the
    (B, H, L, S) probabilities), or []. The op cuts the rest itself when it runs: ring attention each block's
    (query, key) chunks, all-to-all its cp rank's group of heads (runtime/parallel/ring_attention.py
    `_block_keep`, ulysses.py `_head_keep`)."""
    q = list(node.args[0].meta["val"].shape)
    records = []
    s = node.meta.get("parc_shard")
    if s is not None:
        records = [s.dim, plan.mesh.tp, ctx.tp_rank, s.blocks]
    heads = full[-3] // (plan.mesh.tp if s is not None else 1)
    if len(q) != len(full) or q[:-3] != full[:-3] or q[-3] != heads or full[-2] % (2 * plan.mesh.cp):
        raise ParcError(f"dropout: `{node.name}` in module `{module_path(node)}`: local q {q} is not the traced "
                        f"attention {full} with {heads} heads and 2 × cp {plan.mesh.cp} chunks of the sequence")
    return records


def _rewrite(gm: fx.GraphModule, node: fx.Node, kind: str, p: float, key: list) -> None:
    if node.target in CP_ATTENTION:  # the op keys its own blocks: its site, full shape, per-sample size, tp's cut
        node.args = (*node.args[:7], p, *key)
        node.meta.pop("parc_shard", None)
        return
    with gm.graph.inserting_before(node):
        if kind == "dropout":  # (output, mask), as aten.native_dropout: backward reads the saved mask
            pair = gm.graph.call_function(torch.ops.parc.keyed_dropout.default, (node.args[0], p, *key))
            val = node.meta["val"]
            pair.meta = {**node.meta, "val": (val, val.new_empty(val.shape, dtype=torch.bool))}
            pair.meta.pop("parc_shard", None)
            new = gm.graph.call_function(operator.getitem, (pair, 0))
        else:
            a = _sdpa_args(node)
            new = gm.graph.call_function(torch.ops.parc.keyed_attention.default, (
                a["query"], a["key"], a["value"], a.get("attn_mask"), p, bool(a.get("is_causal", False)),
                a.get("scale"), bool(a.get("enable_gqa", False)), *key))
    new.meta = dict(node.meta)
    new.meta.pop("parc_shard", None)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
