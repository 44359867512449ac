"""Materialize a program's state inputs on this rank from the user's model.

Every rank builds the full model on CPU under the same seed — so every rank, and
the serial reference, starts from the same weights — then keeps only its shard
of each tensor (plan.json's `shard`: a slice of `dim` into `parts` equal parts)
and moves it to the rank's device. Parameters become leaf tensors that require
grad; buffers and constants do not. A tensor the model creates inside forward
from data (`torch.tensor(2.0)`) has no FQN in the model: its value travels in
plan.json (`value`), written by the compiler from the trace.
"""

from __future__ import annotations

import torch

from parc.trace import get


def build_reference(user, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = user.build_model()
    model.train()
    return model


def shard(tensor: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """This rank's slice. With `blocks` k (a fused qkv), chunk `index` of each of k equal blocks, concatenated."""
    if spec is None:
        return tensor
    blocks = tensor.chunk(spec.get("blocks", 1), dim=spec["dim"])
    return torch.cat([b.chunk(spec["parts"], dim=spec["dim"])[spec["index"]] for b in blocks], dim=spec["dim"])


def unshard(parts: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The full tensor from every rank's `shard(..., spec)`, in rank order (inverse of `shard`)."""
    k, dim = spec.get("blocks", 1), spec["dim"]
    per_rank = [p.chunk(k, dim=dim) for p in parts]
    return torch.cat([per_rank[r][b] for b in range(k) for r in range(len(parts))], dim=dim)


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
