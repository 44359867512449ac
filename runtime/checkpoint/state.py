"""Materialize a program's state inputs on this rank from the user's model: the fallback path.

The Trainer first asks runtime/checkpoint/weights.py (pretrained weights) and runtime/checkpoint/init_shards.py
(the model's own init replayed per shard); this module is what it does when a model's
init cannot be replayed per shard (docs/weights.md), and what `--verify` builds.

One rank per host builds the full model on CPU under the seed — so every rank,
and the serial reference, starts from the same weights — and sends every other
rank of its host that rank's shard of each tensor (plan.json's `shard`: a slice
of `dim` into `parts` equal parts), on the rank's device (`load_state`). A host
holds one full model while the ranks start, not one per rank. Parameters become leaf tensors that require
grad; buffers and constants do not. A tensor the model creates inside forward
from data (`torch.tensor(2.0)`) has no FQN in the model: its value travels in
plan.json (`value`), written by the compiler from the trace.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.distributed as dist

from parc.traced import get


def build_reference(user, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = user.build_model()
    model.train()
    return model


def block_sizes(n: int, blocks: int | list[int]) -> list[int]:
    """The sizes of a sharded dim's blocks: `blocks` k, k pieces as `torch.chunk` cuts n (a fused qkv of
    equal parts); a list, the sizes themselves (a fused q, k, v of unequal widths: grouped-query attention)."""
    if isinstance(blocks, int):
        c = -(-n // blocks)
        return [min(c, n - i * c) for i in range(blocks) if i * c < n]
    if sum(blocks) != n:
        raise ValueError(f"blocks {list(blocks)} do not add up to the dim's size {n}")
    return list(blocks)


def shard(tensor: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """This rank's slice. With `blocks` (a fused qkv), chunk `index` of each block, concatenated."""
    if spec is None:
        return tensor
    dim = spec["dim"]
    blocks = tensor.split(block_sizes(tensor.shape[dim], spec.get("blocks", 1)), dim=dim)
    return torch.cat([b.chunk(spec["parts"], dim=dim)[spec["index"]] for b in blocks], dim=dim)


def unshard(parts: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The full tensor from every rank's `shard(..., spec)`, in rank order (inverse of `shard`)."""
    dim, n = spec["dim"], len(parts)
    local = [size // n for size in block_sizes(parts[0].shape[dim] * n, spec.get("blocks", 1))]
    per_rank = [p.split(local, dim=dim) for p in parts]
    return torch.cat([per_rank[r][b] for b in range(len(local)) for r in range(n)], dim=dim)


def materialize(entries: list[dict], model: torch.nn.Module, device: torch.device) -> list[torch.Tensor]:
    out = []
    for e in entries:
        if "value" in e:
            src = torch.tensor(e["value"], dtype=getattr(torch, e["dtype"]))
        else:
            src = get(model, e["fqn"])
        t = shard(src.detach(), e["shard"]).to(device).clone()
        if tuple(t.shape) != tuple(e["shape"]):
            raise RuntimeError(f"{e['fqn']}: model gives shape {tuple(t.shape)} but the program was compiled for "
                               f"{tuple(e['shape'])}; the model file changed since `parc compile`?")
        out.append(t.requires_grad_(e["kind"] == "param" and e["requires_grad"]))
    return out


def host_ranks(rank: int, world: int) -> list[int]:
    """The ranks on this rank's host: torchrun numbers them contiguously, LOCAL_WORLD_SIZE to a host
    (unset, as under tests' `spawn`: one host)."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    first = rank - rank % per_host
    return list(range(first, min(first + per_host, world)))


def load_state(entries_of: Callable[[int], list[dict]], rank: int, world: int, user, seed: int,
               device: torch.device) -> list[torch.Tensor]:
    """This rank's state (`entries_of(r)`: rank r's state entries). The host's first rank builds the
    model and sends each other rank of the host its shards, in entry order; they receive into buffers
    of the compiled shapes. Collective over the host's ranks."""
    ranks = host_ranks(rank, world) if dist.is_available() and dist.is_initialized() else [rank]
    if rank == ranks[0]:
        model = build_reference(user, seed)
        for r in ranks[1:]:
            for e, t in zip(entries_of(r), materialize(entries_of(r), model, device)):
                if "value" not in e:
                    dist.send(t.detach().contiguous(), dst=r)
        return materialize(entries_of(rank), model, device)
    out = []
    for e in entries_of(rank):
        if "value" in e:
            t = torch.tensor(e["value"], dtype=getattr(torch, e["dtype"]), device=device)
        else:
            t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]), device=device)
            dist.recv(t, src=ranks[0])
        out.append(t.requires_grad_(e["kind"] == "param" and e["requires_grad"]))
    return out
