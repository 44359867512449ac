"""Sharded, atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Start here: `save(trainer, root, step)` and `load(trainer, path) -> step`.

Format. A checkpoint is a DCP directory `root/step_<N>/` plus `parc.json`
(step, mesh, zero stage). Every parameter and every per-parameter optimizer
tensor (Adam's exp_avg, exp_avg_sq) is stored under its model FQN
(`model.<fqn>`, `optim.<fqn>.<key>`) as a DTensor over the dp group, sharded
along dim 0 in DTensor's layout (rank r holds rows [r·⌈d0/dp⌉, …)). That
layout depends only on the tensor and dp, never on ZeRO's bucketing, so DCP
reshards on load: a checkpoint saved by dp=4 ZeRO-3 loads under dp=2 ZeRO-1
or plain DP. Each rank writes its own rows. Scalars (`optim.step`, the data
position `meta.step`) are replicated; each rank's CPU RNG state is
`rng.rank<r>`, restored only when the world size is unchanged.

Atomicity. Ranks write `step_<N>.tmp-…/`; after every rank has finished, rank 0
writes `parc.json` and renames the directory to `step_<N>`, then replaces the
`latest` pointer file. A crash at any moment leaves either no `step_<N>` or a
complete one; `--resume` only ever sees complete ones.

Cost. ZeRO ranges are converted to and from the DTensor layout by gathering one
bucket (a layer) at a time over dp: a layer's worth of extra memory while saving.
Not yet: programs with tp > 1 or pp > 1 (their parameters are tp/pp shards;
`save` refuses them with a message).
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from parc.errors import LaunchError
from parc.runtime.state import shard as tp_slice

LATEST = "latest"


def _mesh(trainer):
    ctx = trainer.ctx
    if ctx.degree["tp"] > 1 or ctx.degree["pp"] > 1:
        raise LaunchError(f"checkpoints support dp-only meshes so far; this one is tp {ctx.degree['tp']} × "
                          f"pp {ctx.degree['pp']} × dp {ctx.degree['dp']}")
    return init_device_mesh(ctx.device.type, (ctx.degree["dp"],), mesh_dim_names=("dp",))


def _rows(t: torch.Tensor, dp: int, r: int) -> torch.Tensor:
    """Rank r's rows of `t` in DTensor's Shard(0) layout (possibly none)."""
    c = math.ceil(t.shape[0] / dp)
    return t[r * c:(r + 1) * c]


def _sharded(full: torch.Tensor, mesh, dp: int, r: int):
    if full.dim() == 0:
        return full.detach().clone()
    return DTensor.from_local(_rows(full.detach(), dp, r).contiguous().clone(), mesh, [Shard(0)],
                              run_check=False, shape=full.shape, stride=full.contiguous().stride())


def _full_state(trainer) -> tuple[dict, dict, dict]:
    """(params, per-param optimizer state, scalars), whole, keyed by placeholder name."""
    if trainer.zero is not None:
        params = trainer.zero.full_params()
        optim, scalars = trainer.zero.full_optimizer_state()
        return params, optim, scalars
    params, optim, scalars = {}, {}, {}
    for name, p in trainer.params.items():
        params[name] = p.detach()
        for k, v in trainer.optimizer.state.get(p, {}).items():
            if v.dim() == 0:
                scalars[k] = v.detach().clone()
            else:
                optim.setdefault(name, {})[k] = v.detach()
    return params, optim, scalars


def save(trainer, root: str | Path, step: int) -> Path:
    """Write the state after `step` completed steps to `root/step_<step>`; collective over all ranks."""
    root = Path(root)
    mesh = _mesh(trainer)
    ctx = trainer.ctx
    dp, r = ctx.degree["dp"], ctx.coord["dp"]
    fqn = {e["name"]: e["fqn"] for e in trainer.entry["state"]}
    params, optim, scalars = _full_state(trainer)
    sd = {f"model.{fqn[n]}": _sharded(t, mesh, dp, r) for n, t in params.items()}
    for n, per in optim.items():
        sd.update({f"optim.{fqn[n]}.{k}": _sharded(v, mesh, dp, r) for k, v in per.items()})
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
    """Load a checkpoint into `trainer` (any dp, any ZeRO stage); return the number of steps it holds."""
    path = resolve(path)
    mesh = _mesh(trainer)
    ctx = trainer.ctx
    dp, r = ctx.degree["dp"], ctx.coord["dp"]
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    info = json.loads((path / "parc.json").read_text())
    names = {e["fqn"]: e["name"] for e in trainer.entry["state"] if e["name"] in trainer.params}
    sd = {}
    for key, m in meta.items():
        kind, _, rest = key.partition(".")
        if kind == "rng":
            if key == f"rng.rank{ctx.rank}" and info["world_size"] == ctx.world_size:
                sd[key] = torch.empty(m.size, dtype=m.properties.dtype)
            continue
        size = torch.Size(m.size)
        if len(size) == 0:
            sd[key] = torch.zeros((), dtype=m.properties.dtype)
        else:
            sd[key] = _sharded(torch.zeros(size, dtype=m.properties.dtype), mesh, dp, r)
    missing = sorted(f for f in names if f"model.{f}" not in sd)
    if missing:
        raise LaunchError(f"checkpoint {path} lacks parameters {missing[:3]}; it was saved from another model")
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))

    def whole(key: str) -> torch.Tensor:
        v = sd[key]
        return v.full_tensor() if isinstance(v, DTensor) else v  # full_tensor: all-gather over dp

    shard_of = {e["name"]: e["shard"] for e in trainer.entry["state"]}
    params, optim, scalars = {}, {}, {}
    for f, n in names.items():
        params[n] = tp_slice(whole(f"model.{f}"), shard_of[n])
        prefix = f"optim.{f}."
        for key in sd:
            if key.startswith(prefix):
                optim.setdefault(n, {})[key[len(prefix):]] = tp_slice(whole(key), shard_of[n])
    for key in sd:
        if key.startswith("optim.") and sd[key].dim() == 0 and not isinstance(sd[key], DTensor):
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
