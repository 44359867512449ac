"""Sharded, atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Start here: `save(trainer, root, step)` and `resume(trainer, path) -> (step, line)`.

Format. A checkpoint is a DCP directory `root/step_<N>/` plus `parc.json`
(what it holds and under which plan: runtime/checkpoint/record.py). Every parameter and every per-parameter optimizer
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
dp=4 ZeRO-3 → dp=2 tp=2, pp=2 → dp=2. Expert parallelism (docs/moe.md): an expert lives
on the ranks of one ep coordinate only, so it is stored whole under its serial-model FQN (the
`ep_fqns` of its slot) on a second (pp, ep, edp·tp) mesh: Replicate over pp and ep (only its
holders have the key), Shard(0) over the edp·tp ranks holding it, after gathering its ZeRO
ranges over edp; so an ep checkpoint is read by any plan, ep or not (tests/test_moe_checkpoint.py).
Scalars (`optim.step`, the data
position `meta.step`) are replicated; each rank's CPU RNG state is
`rng.rank<r>`, restored only when the world size is unchanged. Every
collective walks names and optimizer keys in plan or sorted order, never a
set's: a set of strings iterates in an order PYTHONHASHSEED picks per process
(tests/test_resume_exact.py).

Atomicity. Ranks write `step_<N>.tmp-…/`; after every rank has finished, rank 0
writes `parc.json` and renames the directory to `step_<N>`, then replaces the
`latest` pointer file. A crash at any moment leaves either no `step_<N>` or a
complete one; `--resume` only ever sees complete ones.

Nothing good is overwritten. `save` refuses an existing `step_<N>` and never
moves `latest` back (unless the run was started with --overwrite-checkpoints:
`replace`), and it refuses to write a non-finite parameter or optimizer value
(runtime/divergence.py), so a diverged run cannot replace a good checkpoint.

Self-checking. parc.json records what the checkpoint holds and under which
plan (runtime/checkpoint/record.py); `resume` checks the files are whole
(runtime/checkpoint/files.py), refuses another model structure, and returns one
line saying what it loaded and every setting that differs.

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
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from parc.errors import LaunchError
import parc.runtime.checkpoint.record as rec
from parc.runtime.checkpoint.files import LATEST, Saved, latest_step, open_checkpoint, point_latest, resolve, steps
from parc.runtime.divergence import Divergence
from parc.runtime.optim_step import step_device
from parc.runtime.checkpoint.state import shard as tp_slice, unshard

__all__ = ["LATEST", "load", "read", "resolve", "resume", "save"]


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


def _expert_mesh(trainer):
    """Expert parallelism: a (pp, ep, edp·tp) device mesh, entry [j, e, b·tp + t] the rank of pp coordinate j,
    ep coordinate e (dp % ep: which experts it holds), edp coordinate b (dp // ep) and tp coordinate t. An
    expert's tensors are Replicate over pp and ep (only the ranks holding it have its key, as only a stage's
    ranks have its tensors) and Shard(0) over the edp·tp ranks that hold it: each expert written once, its
    rows spread over its holders as a dense tensor's are over dp·tp. parc/mesh.py expert_groups: ep groups
    are runs of ep consecutive dp coordinates, edp groups the dp coordinates equal modulo ep."""
    mesh = getattr(trainer, "_checkpoint_expert_mesh", None)
    if mesh is None:
        ctx, ep = trainer.ctx, trainer.art.plan["mesh"]["ep"]
        d = ctx.degree
        ranks = torch.empty(d["pp"], ep, d["dp"] // ep * d["tp"], dtype=torch.int64)
        for r, me in enumerate(trainer.art.plan["ranks"]):
            ranks[me["pp"], me["dp"] % ep, me["dp"] // ep * d["tp"] + me["tp"]] = r
        mesh = trainer._checkpoint_expert_mesh = DeviceMesh(ctx.device.type, ranks,
                                                            mesh_dim_names=("pp", "ep", "shard"))
    return mesh


def _layouts(trainer) -> tuple[tuple, tuple | None]:
    """(mesh, placements, shards, this rank's shard) for dense tensors, and for expert slots (None without ep)."""
    ctx = trainer.ctx
    d, c = ctx.degree, ctx.coord
    dense = (_mesh(trainer), [Replicate(), Shard(0)], d["dp"] * d["tp"], c["dp"] * d["tp"] + c["tp"])
    if not trainer.entry.get("experts"):
        return dense, None
    ep = trainer.art.plan["mesh"]["ep"]
    return dense, (_expert_mesh(trainer), [Replicate(), Replicate(), Shard(0)], d["dp"] // ep * d["tp"],
                   c["dp"] // ep * d["tp"] + c["tp"])


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Shard r's rows of `t` in DTensor's Shard(0) layout over n shards (possibly none)."""
    c = math.ceil(t.shape[0] / n)
    return t[r * c:(r + 1) * c]


def _sharded(full: torch.Tensor, layout: tuple):
    """`full` as the DTensor this rank writes: its rows of shard r of n on `mesh` (see `_layouts`)."""
    mesh, placements, n, r = layout
    if full.dim() == 0:
        return full.detach().clone()
    return DTensor.from_local(_rows(full.detach(), n, r).contiguous().clone(), mesh, placements,
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


def _all_finite(trainer, params: dict, optim: dict, scalars: dict) -> bool:
    """Whether every value every rank is about to save is finite (collective: each checks its own)."""
    ok = torch.ones((), device=trainer.ctx.device)
    for t in (*params.values(), *(v for per in optim.values() for v in per.values()), *scalars.values()):
        if t.is_floating_point():
            ok = ok * torch.isfinite(t).all()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def save(trainer, root: str | Path, step: int, replace: bool = False) -> Path:
    """Write the state after `step` completed steps to `root/step_<step>`; collective over all ranks.

    `replace` (the first save of a run started with --overwrite-checkpoints): first delete the step_<N>
    beyond the step the run started from, and let `latest` move back to this one.
    """
    root = Path(root)
    ctx = trainer.ctx
    final = root / f"step_{step}"
    if final.exists() and not replace:  # every rank sees the same directory: all refuse together
        raise LaunchError(f"{final} exists already; refusing to overwrite a checkpoint (start with "
                          f"--overwrite-checkpoints to replace an earlier run's)")
    dense, expert = _layouts(trainer)
    experts = set(trainer.entry.get("experts") or ())
    layout = {n: expert if n in experts else dense for n in (e["name"] for e in trainer.entry["state"])}
    # an expert slot's FQN is this ep rank's expert (runtime/parallel/expert_parallel.py localize): its serial-model name
    fqn = {e["name"]: e["fqn"] for e in trainer.entry["state"]}
    params, optim, scalars = _full_state(trainer)
    # a diverged run must not replace a good checkpoint: every rank checks what it writes, all decide alike
    if not _all_finite(trainer, params, optim, scalars):
        raise Divergence(f"after step {step} the parameters or optimizer state hold nan/inf; not saved to {final} "
                         f"(a gradient went non-finite under a finite loss between log points; the run checks the "
                         f"gradient norm at every log point, and every step's with `clip=` in the plan)")
    sd = {f"model.{fqn[n]}": _sharded(t, layout[n]) for n, t in params.items()}
    for n, per in optim.items():
        sd.update({f"optim.{fqn[n]}.{k}": _sharded(v, layout[n]) for k, v in per.items()})
    sd.update({f"optim.{k}": v for k, v in scalars.items()})
    sd["meta.step"] = torch.tensor(step, dtype=torch.int64)
    sd[f"rng.rank{ctx.rank}"] = torch.get_rng_state()

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
        state_keys = sorted({k for per in optim.values() for k in per})
        data = {**trainer.data.describe(), "consumed_samples": trainer.data.consumed_at(step)}
        info = rec.record(trainer.art.plan, step, ctx.world_size, trainer.name, state_keys, sorted(scalars), data)
        (tmp / "parc.json").write_text(json.dumps(info, indent=1, sort_keys=True))
        if replace:
            for n, old in steps(root).items():
                if n > trainer.resumed_step:
                    shutil.rmtree(old)
        os.replace(tmp, final)
        newest = latest_step(root)
        if replace or newest is None or newest <= step:  # `latest` never moves back
            point_latest(root, final.name)
        for stale in root.glob("step_*.tmp-*"):  # left by a crash mid-save
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def read(path: str | Path, prefix: str = "", what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with `prefix`, whole, in one process (no process group)."""
    saved = open_checkpoint(path, what)
    md = saved.meta.state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith(prefix) and hasattr(m, "size")}
    with warnings.catch_warnings():  # one process on purpose: DCP's warning that it assumes so says nothing
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        _read(saved, sd, what, no_dist=True)
    return sd


def _read(saved: Saved, sd: dict, what: str, **kwargs) -> None:
    """DCP's load into `sd`; a failure (a shard damaged inside) is one line on every rank (DCP gathers
    every rank's failure and raises on all of them)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(saved.path), **kwargs)
    except CheckpointException as e:
        failures = getattr(e, "failures", {}) or {}
        rank, err = next(iter(sorted(failures.items())), (None, e))
        err = err[0] if isinstance(err, tuple) else err  # DCP keeps (exception, stack summary)
        raise LaunchError(f"{what} {saved.path}: reading the tensors failed (rank {rank}: {_one(err)}); the "
                          f"checkpoint is damaged") from None
    except (RuntimeError, OSError, ValueError, EOFError) as e:
        raise LaunchError(f"{what} {saved.path}: reading the tensors failed ({_one(e)}); the checkpoint is "
                          f"damaged") from None


def _one(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load(trainer, path: str | Path) -> int:
    """`resume`, for callers that want only the number of steps the checkpoint holds."""
    return resume(trainer, path)[0]


def resume(trainer, path: str | Path, what: str = "--resume") -> tuple[int, str]:
    """Load a checkpoint into `trainer` (any dp/tp/pp, any ZeRO stage); return (the number of steps it
    holds, the one line saying what was loaded and what differs from the run).

    Every check runs on files and plan.json only, before DCP's collective read, so every rank refuses
    alike. Each rank then reads, whole, only the tensors its own programs hold (DCP assembles them from
    whichever ranks wrote the rows) and keeps its tp slice and ZeRO range.
    """
    saved = open_checkpoint(path, what, shards=False)  # a shard damaged after all: DCP's read fails on every rank
    plan_json, ctx = trainer.art.plan, trainer.ctx
    meta, info = saved.meta.state_dict_metadata, saved.info
    ckpt_params, ckpt_state, ckpt_scalars = rec.held(saved.meta)
    rec.check_model(saved.path, ckpt_params, rec.model_params(plan_json))
    want_state, want_scalars = rec.optimizer_keys(plan_json["plan"]["optimizer"])
    with_optim = bool(want_state or want_scalars) and (ckpt_state, ckpt_scalars) == (want_state, want_scalars)
    line = rec.summary(saved.path, info, rec.differences(info, plan_json, ctx.world_size, with_optim, ckpt_state,
                                                        ckpt_scalars, trainer.data.describe()),
                       plan_json["plan"]["batch"]["global"])
    names = {e["fqn"]: e["name"] for e in trainer.entry["state"] if e["name"] in trainer.params}
    sd = {}
    for key, m in meta.items():
        kind, _, rest = key.partition(".")
        if kind == "rng":
            wanted = key == f"rng.rank{ctx.rank}" and info.get("world_size") == ctx.world_size
        elif kind == "model":
            wanted = rest in names
        elif kind == "optim":
            wanted = with_optim and (len(m.size) == 0 or rest.rpartition(".")[0] in names)
        else:
            wanted = True
        if wanted:
            sd[key] = torch.empty(torch.Size(m.size), dtype=m.properties.dtype)
    _read(saved, sd, what)

    shard_of = {e["name"]: e["shard"] for e in trainer.entry["state"]}
    params, optim, scalars = {}, {}, {}
    for f, n in names.items():
        params[n] = tp_slice(sd[f"model.{f}"], shard_of[n]).to(ctx.device)
        for k in want_state if with_optim else ():
            if f"optim.{f}.{k}" in sd:  # absent: the parameter never had a gradient, so no state yet
                optim.setdefault(n, {})[k] = tp_slice(sd[f"optim.{f}.{k}"], shard_of[n]).to(ctx.device)
    opt = trainer.zero.optimizer if trainer.zero is not None else trainer.optimizer
    for k in want_scalars if with_optim else ():  # a fused optimizer keeps its step counts on the device
        scalars[k] = sd[f"optim.{k}"].to(step_device(opt, ctx.device))
    if trainer.zero is not None:
        trainer.zero.load_full(params, optim, scalars)
    else:
        with torch.no_grad():
            for n, p in trainer.params.items():
                p.copy_(params[n])
                if n in optim:
                    trainer.optimizer.state[p] = {**{k: v.clone() for k, v in sorted(scalars.items())},
                                                  **{k: v.clone() for k, v in sorted(optim[n].items())}}
    if f"rng.rank{ctx.rank}" in sd:
        torch.set_rng_state(sd[f"rng.rank{ctx.rank}"])
    trainer.resumed_step = int(sd["meta.step"])
    data = info.get("data", {})  # the sample stream continues where the checkpoint's run stopped (runtime/data.py)
    trainer.data.seek(trainer.resumed_step,
                      data.get("consumed_samples", trainer.resumed_step * data.get("global_batch", 0)))
    return trainer.resumed_step, line
