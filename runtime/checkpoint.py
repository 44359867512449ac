"""Sharded, atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Start here: `save(trainer, root, step)` and `load(trainer, path) -> step`.

Format. A checkpoint is a DCP directory `root/step_<N>/` plus `parc.json`
(step, mesh, zero stage). Every parameter and every per-parameter optimizer
tensor (Adam's exp_avg, exp_avg_sq) is stored WHOLE-shaped under its model FQN
(`model.<fqn>`, `optim.<fqn>.<key>`) as a DTensor on a (pp, dp·tp) device
mesh: Replicate over pp (only the ranks of the stage holding the tensor write
it; a tied copy on two stages is written once, DCP dedups equal chunks) and
Shard(0) over the dp·tp ranks of that stage (rank (d, t) writes rows
[(d·tp + t)·⌈d0/(dp·tp)⌉, …)). Before writing, ZeRO ranges are gathered over
dp and tp shards over tp (with their shard spec, fused qkv blocks included),
so the stored layout depends only on the tensor — never on the plan — and
DCP reshards on load: each rank reads whole exactly the tensors its programs
hold and keeps its tp slice / ZeRO range. Tested: dp=4 ZeRO-3 → dp=2 ZeRO-1,
dp=4 ZeRO-3 → dp=2 tp=2, pp=2 → dp=2. Scalars (`optim.step`, the data
position `meta.step`) are replicated; each rank's CPU RNG state is
`rng.rank<r>`, restored only when the world size is unchanged.

Atomicity. Ranks write `step_<N>.tmp-…/`; after every rank has finished, rank 0
writes `parc.json` and renames the directory to `step_<N>`, then replaces the
`latest` pointer file. A crash at any moment leaves either no `step_<N>` or a
complete one; `--resume` only ever sees complete ones.

Cost. Saving gathers all of this rank's tensors whole at once (over dp for
ZeRO ranges, over tp for shards) before writing its rows: peak extra memory is
the stage's full parameters + optimizer state, not one layer. Loading reads
each needed tensor whole on every rank that holds it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from parc.errors import LaunchError
from parc.runtime.state import shard as tp_slice, unshard

LATEST = "latest"


def _mesh(trainer):
    """A (pp, dp·tp) device mesh: row j holds the ranks of pp coordinate j, the ranks that hold stage j's
    parameters. Checkpoint tensors are DTensors Replicate over pp (a rank writes only what it holds) and
    Shard(0) over dp·tp. Built once per trainer: DeviceMesh creates process groups (collective)."""
    mesh = getattr(trainer, "_checkpoint_mesh", None)
    if mesh is None:
        ctx = trainer.ctx
        d = ctx.degree
        ranks = torch.empty(d["pp"], d["dp"] * d["tp"], dtype=torch.int64)
        for r, me in enumerate(trainer.art.plan["ranks"]):
            ranks[me["pp"], me["dp"] * d["tp"] + me["tp"]] = r
        mesh = trainer._checkpoint_mesh = DeviceMesh(ctx.device.type, ranks, mesh_dim_names=("pp", "shard"))
    return mesh


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Shard r's rows of `t` in DTensor's Shard(0) layout over n shards (possibly none)."""
    c = math.ceil(t.shape[0] / n)
    return t[r * c:(r + 1) * c]


def _sharded(full: torch.Tensor, mesh, n: int, r: int):
    if full.dim() == 0:
        return full.detach().clone()
    return DTensor.from_local(_rows(full.detach(), n, r).contiguous().clone(), mesh, [Replicate(), Shard(0)],
                              run_check=False, shape=full.shape, stride=full.contiguous().stride())


def _tp_whole(trainer, t: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """The full tensor from this rank's tp shard `t` (collective over the tp group when sharded)."""
    if spec is None:
        return t
    parts = [torch.empty_like(t) for _ in range(spec["parts"])]
    dist.all_gather(parts, t.contiguous(), group=trainer.ctx.groups["tp"])
    return unshard(parts, spec)


def _full_state(trainer) -> tuple[dict, dict, dict]:
    """(params, per-param optimizer state, scalars), whole (dp ranges and tp shards gathered), by placeholder
    name. Collective over dp (ZeRO) and tp; every rank of a tp group walks the same names in the same order."""
    if trainer.zero is not None:
        params = trainer.zero.full_params()
        optim, scalars = trainer.zero.full_optimizer_state()
    else:
        params, optim, scalars = {}, {}, {}
        for name, p in trainer.params.items():
            params[name] = p.detach()
            for k, v in trainer.optimizer.state.get(p, {}).items():
                if v.dim() == 0:
                    scalars[k] = v.detach().clone()
                else:
                    optim.setdefault(name, {})[k] = v.detach()
    spec = {e["name"]: e["shard"] for e in trainer.entry["state"]}
    params = {n: _tp_whole(trainer, t, spec[n]) for n, t in params.items()}
    optim = {n: {k: _tp_whole(trainer, v, spec[n]) for k, v in sorted(per.items())} for n, per in optim.items()}
    return params, optim, scalars


def save(trainer, root: str | Path, step: int) -> Path:
    """Write the state after `step` completed steps to `root/step_<step>`; collective over all ranks."""
    root = Path(root)
    mesh = _mesh(trainer)
    ctx = trainer.ctx
    n_shards, r = ctx.degree["dp"] * ctx.degree["tp"], ctx.coord["dp"] * ctx.degree["tp"] + ctx.coord["tp"]
    fqn = {e["name"]: e["fqn"] for e in trainer.entry["state"]}
    params, optim, scalars = _full_state(trainer)
    sd = {f"model.{fqn[n]}": _sharded(t, mesh, n_shards, r) for n, t in params.items()}
    for n, per in optim.items():
        sd.update({f"optim.{fqn[n]}.{k}": _sharded(v, mesh, n_shards, r) for k, v in per.items()})
    sd.update({f"optim.{k}": v for k, v in scalars.items()})
    sd["meta.step"] = torch.tensor(step, dtype=torch.int64)
    sd[f"rng.rank{ctx.rank}"] = torch.get_rng_state()

    final = root / f"step_{step}"
    # every rank must write into the same temporary directory: rank 0 names it, the others hear it
    name = [f"step_{step}.tmp-{os.getpid()}"] if ctx.rank == 0 else [None]
    dist.broadcast_object_list(name, src=0)
    tmp = root / name[0]
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp))
    dist.barrier()  # every rank's files are on disk before the directory gets its final name
    if ctx.rank == 0:
        (tmp / "parc.json").write_text(json.dumps({
            "step": step, "world_size": ctx.world_size, "mesh": ctx.degree,
            "zero": trainer.art.plan["plan"]["zero"], "program": trainer.name}, indent=1, sort_keys=True))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        for stale in root.glob("step_*.tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a `--checkpoint-dir` root (then its `latest`)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    if (path / LATEST).is_file():
        return path / (path / LATEST).read_text().strip()
    raise LaunchError(f"--resume {path}: neither a checkpoint (no .metadata) nor a checkpoint directory "
                      f"(no {LATEST} file); pass the --checkpoint-dir of an earlier run")


def load(trainer, path: str | Path) -> int:
    """Load a checkpoint into `trainer` (any dp/tp/pp, any ZeRO stage); return the number of steps it holds.

    Each rank reads, whole, only the tensors its own programs hold (DCP assembles them from whichever
    ranks wrote the rows) and keeps its tp slice and ZeRO range: no collective beyond DCP's own.
    """
    path = resolve(path)
    ctx = trainer.ctx
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    info = json.loads((path / "parc.json").read_text())
    names = {e["fqn"]: e["name"] for e in trainer.entry["state"] if e["name"] in trainer.params}
    missing = sorted(f for f in names if f"model.{f}" not in meta)
    if missing:
        raise LaunchError(f"checkpoint {path} lacks parameters {missing[:3]}; it was saved from another model")
    sd = {}
    for key, m in meta.items():
        kind, _, rest = key.partition(".")
        if kind == "rng":
            wanted = key == f"rng.rank{ctx.rank}" and info["world_size"] == ctx.world_size
        elif kind == "model":
            wanted = rest in names
        elif kind == "optim":
            wanted = len(m.size) == 0 or rest.rpartition(".")[0] in names
        else:
            wanted = True
        if wanted:
            sd[key] = torch.empty(torch.Size(m.size), dtype=m.properties.dtype)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))

    shard_of = {e["name"]: e["shard"] for e in trainer.entry["state"]}
    params, optim, scalars = {}, {}, {}
    for f, n in names.items():
        params[n] = tp_slice(sd[f"model.{f}"], shard_of[n]).to(ctx.device)
        prefix = f"optim.{f}."
        for key in sd:
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                optim.setdefault(n, {})[key[len(prefix):]] = tp_slice(sd[key], shard_of[n]).to(ctx.device)
    for key in sd:
        if key.startswith("optim.") and sd[key].dim() == 0:
            scalars[key[len("optim."):]] = sd[key]
    if trainer.zero is not None:
        trainer.zero.load_full(params, optim, scalars)
    else:
        with torch.no_grad():
            for n, p in trainer.params.items():
                p.copy_(params[n])
                if n in optim:
                    trainer.optimizer.state[p] = {**{k: v.clone() for k, v in optim[n].items()},
                                                  **{k: v.clone() for k, v in scalars.items()}}
    if f"rng.rank{ctx.rank}" in sd:
        torch.set_rng_state(sd[f"rng.rank{ctx.rank}"])
    return int(sd["meta.step"])
