"""Sharded, atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Start here: `save(trainer, root, step)` and `resume(trainer, path) -> (step, line)`.

Format. A checkpoint is a DCP directory `root/step_<N>/` plus `parc.json`
(what it holds and under which plan: runtime/checkpoint/record.py). Every parameter and every per-parameter optimizer
tensor (Adam's exp_avg, exp_avg_sq) is stored WHOLE-shaped under its model FQN
(`model.<fqn>`, `optim.<fqn>.<key>`) as a DTensor on a (pp, dp·tp) device
mesh: Replicate over pp (only the ranks of the stage holding the tensor write
it; a tied copy on two stages is written once, DCP dedups equal chunks) and
Shard(0) over the dp·tp ranks of that stage (rank (d, t) writes rows
[(d·tp + t)·⌈d0/(dp·tp)⌉, …); under context parallelism dp·cp·tp, rank (d, c, t)
the rows of shard (d·cp + c)·tp + t). Before writing, ZeRO ranges are gathered over
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
`rng.rank<r>`, restored only when the world size is unchanged; fp16's loss scaler is
`scaler.<key>` (runtime/loss_scale.py), replicated. Every
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
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from parc.errors import LaunchError, ParcError
import parc.runtime.checkpoint.checksums as checksums
import parc.runtime.checkpoint.record as rec
from parc.runtime.checkpoint.files import (LATEST, Saved, latest_step, open_checkpoint, point_latest, resolve,
                                          set_aside, steps)
from parc.runtime import faults
from parc.runtime.divergence import Divergence
from parc.runtime.optim_step import step_device
from parc.runtime.checkpoint.state import shard as tp_slice, unshard

__all__ = ["LATEST", "SaveFailed", "Saver", "load", "read", "resolve", "resume", "save"]


def _mesh(trainer):
    """A (pp, dp·cp·tp) device mesh: row j holds the ranks of pp coordinate j, the ranks that hold stage j's
    parameters. Checkpoint tensors are DTensors Replicate over pp (a rank writes only what it holds) and
    Shard(0) over dp·cp·tp (cp 1 without context parallelism). Built once per trainer: DeviceMesh creates process groups (collective)."""
    mesh = getattr(trainer, "_checkpoint_mesh", None)
    if mesh is None:
        ctx = trainer.ctx
        d, cp = ctx.degree, ctx.degree.get("cp", 1)
        ranks = torch.empty(d["pp"], d["dp"] * cp * d["tp"], dtype=torch.int64)
        for r, me in enumerate(trainer.art.plan["ranks"]):
            ranks[me["pp"], _shard_index(me, d)] = r
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


def _shard_index(coord: dict, d: dict) -> int:
    """A rank's place on the shard dim of `_mesh`: (dp, cp, tp) coordinates, tp innermost. Under context
    parallelism the cp ranks of a sample group hold the same parameters, so each writes its own rows of them
    (every rank sits on the mesh once)."""
    cp = d.get("cp", 1)
    return (coord["dp"] * cp + coord.get("cp", 0)) * d["tp"] + coord["tp"]


def _layouts(trainer) -> tuple[tuple, tuple | None]:
    """(mesh, placements, shards, this rank's shard) for dense tensors, and for expert slots (None without ep)."""
    ctx = trainer.ctx
    d, c = ctx.degree, ctx.coord
    dense = (_mesh(trainer), [Replicate(), Shard(0)], d["dp"] * d.get("cp", 1) * d["tp"], _shard_index(c, d))
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
    """`full` as the DTensor this rank writes: its rows of shard r of n on `mesh` (see `_layouts`). A copy:
    a view of a live parameter may share the storage of a ZeRO flat buffer, which DCP's staging to host
    memory (--async-save) cannot copy from."""
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


class SaveFailed(ParcError):
    """A checkpoint could not be written (disk full, permission denied, ...): nothing of it became `latest`."""


def _state_dict(trainer, step: int, final: Path) -> tuple[dict, dict]:
    """(the DCP state dict this rank writes to `final`, parc.json's record), after `step` steps. Collective over the
    training groups (ZeRO gathers, tp gathers, the finite check): the caller's thread, in step order."""
    ctx = trainer.ctx
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
    if trainer.scaler:  # fp16's loss scale, hysteresis and clean-step count: equal on every rank (runtime/loss_scale.py)
        sd.update({f"scaler.{k}": v for k, v in trainer.scaler.state_dict().items()})
    info = None
    if ctx.rank == 0:
        state_keys = sorted({k for per in optim.values() for k in per})
        data = {**trainer.data.describe(), "consumed_samples": trainer.data.consumed_at(step)}
        info = rec.record(trainer.art.plan, step, ctx.world_size, trainer.name, state_keys, sorted(scalars), data)
    return sd, info


def _agree(error: str | None, group=None) -> str | None:
    """Every rank's error, or None: the first one (in rank order) on every rank, so all act alike."""
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


# DCP's CheckpointException is a BaseException, which `except Exception` would let pass
_WRITE_ERRORS = (Exception, CheckpointException)


def _why(e: BaseException) -> str:
    """One phrase for a failed write: DCP gathers every rank's failure into one CheckpointException."""
    if isinstance(e, CheckpointException) and getattr(e, "failures", None):
        rank, err = sorted(e.failures.items())[0]
        err = err[0] if isinstance(err, tuple) else err
        return f"rank {rank}: {_one(err)}"
    return _one(e)


class Saver:
    """Every save of one run into one --checkpoint-dir: in the step (the default) or in the background.

    `save(step)` gathers and checks the state on the training groups (collective, in step order). Then
    DCP writes it into `step_<N>.tmp-<pid>/`, each rank its rows, and `_seal` records every file's
    checksum (runtime/checkpoint/checksums.py), writes parc.json and, on rank 0, renames the directory to
    `step_<N>` and moves `latest`. A crash at any point leaves no `step_<N>` or a complete one.

    `asynchronous` (--async-save): DCP's async save copies the state to host memory and returns; the
    write and the seal run in a background thread on a gloo group of their own (their collectives never
    interleave with training's), and the step goes on. The next save, and the end of the run, first wait
    for the one in flight. Cost: one more host copy of the state this rank writes while it is in flight.

    `keep_last` (--keep-last K): after a checkpoint is complete and `latest` names it, the step_<N> older
    than the K newest are deleted. `replace` (--overwrite-checkpoints): the first save first deletes the
    step_<N> beyond the step the run started from and lets `latest` move back.

    A failed write (disk full, permission denied) raises `SaveFailed` on every rank with one line, its
    temporary directory removed; with `keep_going` the line is printed and training goes on.
    """

    def __init__(self, trainer, root: Path, replace: bool = False, keep_last: int | None = None,
                 asynchronous: bool = False, keep_going: bool = False):
        self.trainer, self.root, self.replace, self.keep_last = trainer, Path(root), replace, keep_last
        self.keep_going, self.pending = keep_going, None
        # a group of its own for the background thread's collectives, created alike on every rank
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.asynchronous = asynchronous

    def save(self, step: int) -> Path:
        final = self.root / f"step_{step}"
        self.wait()  # the save in flight first: one at a time, in step order
        if final.exists() and not self.replace:  # every rank sees the same directory: all refuse together
            raise LaunchError(f"{final} exists already; refusing to overwrite a checkpoint (start with "
                              f"--overwrite-checkpoints to replace an earlier run's)")
        sd, info = _state_dict(self.trainer, step, final)
        ctx = self.trainer.ctx
        # every rank writes into the same temporary directory: rank 0 names and makes it, the others hear it
        made = None
        if ctx.rank == 0:
            tmp = self.root / f"step_{step}.tmp-{os.getpid()}"
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                made = f"cannot create {tmp}: {_one(e)}"
        name = [str(tmp) if ctx.rank == 0 else None, made]
        dist.broadcast_object_list(name, src=0)
        if name[1]:
            return self._failed(step, name[1], None)
        tmp, replace = Path(name[0]), self.replace
        self.replace = False  # only the first save replaces an earlier run's checkpoints
        if not self.asynchronous:
            try:
                dcp.save(sd, storage_writer=faults.writer(tmp, step, ctx.rank))
                error = None
            except _WRITE_ERRORS as e:  # DCP raises one CheckpointException on every rank
                error = _why(e)
            self._seal(step, tmp, info, replace, error, group=None)
            return final
        future = dcp.async_save(sd, storage_writer=faults.writer(tmp, step, ctx.rank), process_group=self.group)
        del sd  # staged: the host copy is DCP's now
        from concurrent.futures import ThreadPoolExecutor

        def finish():
            try:
                future.result()
                error = None
            except _WRITE_ERRORS as e:
                error = _why(e)
            self._seal(step, tmp, info, replace, error, group=self.group)

        pool = ThreadPoolExecutor(1, thread_name_prefix="parc-save")
        self.pending = (step, pool.submit(finish))
        pool.shutdown(wait=False)
        return final

    def wait(self) -> None:
        """Until the save in flight (if any) is complete; its failure is raised (or printed) here."""
        if self.pending is not None:
            step, job = self.pending
            self.pending = None
            job.result()

    def _seal(self, step: int, tmp: Path, info: dict | None, replace: bool, error: str | None, group) -> None:
        """After DCP wrote: checksums, parc.json, the rename and `latest` (rank 0), every rank told the outcome."""
        ctx = self.trainer.ctx
        faults.in_save(step, ctx.rank)
        error = _agree(error, group)
        sums: dict = {}
        if error is None:
            try:
                mine = checksums.measure(tmp, ctx.rank, ctx.world_size)
            except OSError as e:
                mine, error = {}, f"rank {ctx.rank}: {_one(e)}"
            error = _agree(error, group)
            shares = [None] * ctx.world_size
            dist.all_gather_object(shares, mine, group=group)
            for s in shares:
                sums.update(s)
        if ctx.rank == 0 and error is None:
            try:
                self._commit(step, tmp, {**info, "files": dict(sorted(sums.items()))}, replace)
            except OSError as e:
                error = _one(e)
        error = _agree(error if ctx.rank == 0 else None, group)
        if error is not None:
            self._failed(step, error, tmp)

    def _commit(self, step: int, tmp: Path, info: dict, replace: bool) -> None:
        """Rank 0: parc.json, then the rename that makes the checkpoint exist, then `latest`, then pruning."""
        root, final = self.root, self.root / f"step_{step}"
        (tmp / "parc.json").write_text(json.dumps(info, indent=1, sort_keys=True))
        if replace:
            for n, old in steps(root).items():
                if n > self.trainer.resumed_step:
                    shutil.rmtree(old)
        os.replace(tmp, final)
        newest = latest_step(root)
        if replace or newest is None or newest <= step:  # `latest` never moves back
            point_latest(root, final.name)
        if self.keep_last:
            done = sorted(n for n in steps(root) if n <= step)
            for n in done[:-self.keep_last]:  # only once a newer one is complete and named
                shutil.rmtree(root / f"step_{n}", ignore_errors=True)
        for stale in root.glob("step_*.tmp-*"):  # left by a crash mid-save (never the one in flight: one at a time)
            shutil.rmtree(stale, ignore_errors=True)
        faults.after_commit(step, final)

    def _failed(self, step: int, why: str, tmp: Path | None) -> Path:
        if tmp is not None and self.trainer.ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        line = f"checkpoint step_{step} not saved in {self.root}: {why}"
        if not self.keep_going:
            raise SaveFailed(line, hint="free space or fix permissions, then resume from the last checkpoint; "
                                        "or run with --on-save-error continue to train on without it")
        if self.trainer.ctx.rank == 0:
            print(f"parc.run: warning: {line}; training goes on (--on-save-error continue)", file=sys.stderr,
                  flush=True)
        return self.root / f"step_{step}"


def save(trainer, root: str | Path, step: int, replace: bool = False) -> Path:
    """Write the state after `step` completed steps to `root/step_<step>`, in the step; collective over all
    ranks (one `Saver` save: see there)."""
    return Saver(trainer, Path(root), replace=replace).save(step)


def read(path: str | Path, prefix: str = "", what: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with `prefix`, whole, in one process (no process group)."""
    saved = open_checkpoint(path, what)
    check_sums(saved, what)
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


def check_sums(saved: Saved, what: str = "--resume") -> None:
    """Refuse a checkpoint whose files differ from the checksums parc.json recorded, in one line naming the
    file. With a process group the files are shared out over the ranks and every rank gets the verdict."""
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    bad = checksums.damaged(saved.path, saved.info, rank, world)
    if on:
        shares = [None] * world
        dist.all_gather_object(shares, bad)
        bad = [b for share in shares for b in share]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise LaunchError(f"{what} {saved.path}: {bad[0]}{more}; the checkpoint is damaged")


def newest_complete(root: Path, lead: bool) -> tuple[Saved | None, list[str]]:
    """`--resume auto`: the newest checkpoint under `root` that is whole and matches its checksums, or None;
    and one line for each newer one found damaged, which is set aside (`files.set_aside`), not deleted.
    Collective: every rank reaches the same verdict (rank 0 stats the shard files, the sums are shared)."""
    said = []
    for step in sorted(steps(root), reverse=True):
        path = root / f"step_{step}"
        error, saved = None, None
        try:
            saved = open_checkpoint(path, "--resume auto", shards=lead)
        except LaunchError as e:
            error = e.diagnostics[0].message
        error = _agree(error)
        if error is None:
            try:
                check_sums(saved, "--resume auto")
                return saved, said
            except LaunchError as e:
                error = e.diagnostics[0].message
        if lead:
            aside = set_aside(path)
            said.append(f"{error}; set aside as {aside.name}, trying the one before")
        dist.barrier()
    return None, said


def load(trainer, path: str | Path) -> int:
    """`resume`, for callers that want only the number of steps the checkpoint holds."""
    return resume(trainer, path)[0]


def resume(trainer, path: str | Path, what: str = "--resume", sums: bool = True) -> tuple[int, str]:
    """Load a checkpoint into `trainer` (any dp/tp/pp, any ZeRO stage); return (the number of steps it
    holds, the one line saying what was loaded and what differs from the run).

    Every check runs on files and plan.json only, before DCP's collective read, so every rank refuses
    alike; the files' checksums are shared out over the ranks (`check_sums`; `sums=False`: checked already). Each rank then reads, whole, only the tensors its own programs hold (DCP assembles them from
    whichever ranks wrote the rows) and keeps its tp slice and ZeRO range.
    """
    saved = open_checkpoint(path, what, shards=False)  # a shard damaged after all: DCP's read fails on every rank
    if sums:
        check_sums(saved, what)
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
    if trainer.scaler and "scaler.scale" in sd:  # fp16: the scale goes on as the saved run's (else it starts anew)
        trainer.scaler.load_state_dict({k.removeprefix("scaler."): v for k, v in sd.items() if k.startswith("scaler.")})
    trainer.resumed_step = int(sd["meta.step"])
    data = info.get("data", {})  # the sample stream continues where the checkpoint's run stopped (runtime/data.py)
    trainer.data.seek(trainer.resumed_step,
                      data.get("consumed_samples", trainer.resumed_step * data.get("global_batch", 0)))
    return trainer.resumed_step, line
