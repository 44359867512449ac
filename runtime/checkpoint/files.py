"""The files of a checkpoint directory: finding a checkpoint, refusing a damaged one, never overwriting one.

Start here: `open_checkpoint(path, what)` and `check_saving(...)`. A `--checkpoint-dir` holds

  step_<N>/             one complete checkpoint (runtime/checkpoint/sharded.py): DCP's `.metadata`, its shard files
                        `__<rank>_<i>.distcp`, and parc.json (what the checkpoint holds, under which plan)
  latest                one line: the name of the newest complete step_<N>
  step_<N>.tmp-<pid>/   a save in progress, or one a crash interrupted; never read
  step_<N>.damaged/     a checkpoint `--resume auto` found damaged and set aside; never read

Everything here reads files only, no process group: every rank, and `parc export`, reaches the same
verdict from the same files before any collective starts, so a damaged checkpoint stops every rank with
the same one line instead of leaving some of them waiting in a collective. `what` names the flag or
argument the path came from, so the line points at what the user typed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from parc.errors import LaunchError

LATEST = "latest"
STEP = re.compile(r"step_(\d+)")
TMP = re.compile(r"step_\d+\.tmp-\d+")
DAMAGED = re.compile(r"step_\d+\.damaged(-\d+)?")


@dataclass
class Saved:
    """A complete checkpoint on disk: its directory, its parc.json and DCP's index of its tensors."""

    path: Path
    info: dict
    meta: object  # torch.distributed.checkpoint.Metadata

    @property
    def step(self) -> int:
        return int(self.info["step"])


def steps(root: Path) -> dict[int, Path]:
    """The complete-looking step_<N> directories under `root`, by N."""
    if not root.is_dir():
        return {}
    return {int(m.group(1)): p for p in root.iterdir() if (m := STEP.fullmatch(p.name)) and p.is_dir()}


def _names(found: dict[int, Path]) -> str:
    return ", ".join(f"step_{n}" for n in sorted(found)) or "none"


def resolve(path: str | Path, what: str = "--resume") -> Path:
    """A checkpoint directory, or a checkpoint root (then the step its `latest` names)."""
    path = Path(path)
    if not path.exists():
        raise LaunchError(f"{what} {path}: no such file or directory")
    if not path.is_dir():
        raise LaunchError(f"{what} {path}: a file, not a checkpoint directory")
    if (path / ".metadata").is_file() or (path / "parc.json").is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        found = steps(path)
        if found:
            raise LaunchError(f"{what} {path}: no `{LATEST}` file to say which checkpoint is newest; pass one "
                              f"of {_names(found)} (e.g. {path / f'step_{max(found)}'})")
        raise LaunchError(f"{what} {path}: neither a checkpoint (no .metadata) nor a checkpoint directory "
                          f"(no `{LATEST}` file); pass the --checkpoint-dir of an earlier run or one of its step_<N>")
    name = pointer.read_bytes()[:200].decode("utf-8", "replace").strip()
    if not STEP.fullmatch(name):
        raise LaunchError(f"{what} {path}: {pointer} holds {name[:40]!r}, not the name of a step_<N> checkpoint; "
                          f"it is damaged: pass a checkpoint directly (here: {_names(steps(path))})")
    if not (path / name).is_dir():
        raise LaunchError(f"{what} {path}: {pointer} names {name}, which does not exist (deleted or not copied?); "
                          f"complete checkpoints here: {_names(steps(path))}")
    return path / name


def open_checkpoint(path: str | Path, what: str = "--resume", shards: bool = True) -> Saved:
    """The checkpoint at `path` (see `resolve`), checked to be whole: parc.json readable, DCP's index
    readable and, with `shards`, every shard file it names present and at least as long as the index
    says (one stat per file: parc/run.py asks it of rank 0 only, not of every rank of a large job)."""
    import torch.distributed.checkpoint as dcp

    where = resolve(path, what)
    info_file = where / "parc.json"
    if not info_file.is_file():
        raise LaunchError(f"{what} {where}: no parc.json, so not a complete parc checkpoint (a partial copy?)")
    try:
        info = json.loads(info_file.read_text())
        int(info["step"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise LaunchError(f"{what} {where}: parc.json is damaged ({type(e).__name__}: {_first(e)})") from None
    if not (where / ".metadata").is_file():
        raise LaunchError(f"{what} {where}: no .metadata (DCP's index of the tensors), so not a complete checkpoint")
    try:
        meta = dcp.FileSystemReader(where).read_metadata()
    except Exception as e:  # noqa: BLE001 — a truncated or foreign pickle raises anything
        raise LaunchError(f"{what} {where}: .metadata is damaged or truncated ({type(e).__name__}: "
                          f"{_first(e)})") from None
    need: dict[str, int] = {}  # shard file → bytes the index reads from it
    for item in (getattr(meta, "storage_data", None) or {}).values() if shards else ():
        rel = getattr(item, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), item.offset + item.length)
    for rel, size in sorted(need.items()):
        f = where / rel
        if not f.is_file():
            raise LaunchError(f"{what} {where}: shard file {rel} is missing (the index names it)")
        have = f.stat().st_size
        if have < size:
            raise LaunchError(f"{what} {where}: shard file {rel} is truncated: {have} bytes, the index needs {size}")
    return Saved(where, info, meta)


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:160]


def leftovers(root: Path) -> list[str]:
    """What a crashed or restarted run leaves beside its checkpoints, and `--resume auto` may start over:
    saves a crash interrupted, checkpoints set aside as damaged, and the `latest` pointer."""
    return sorted(p.name for p in root.iterdir()
                  if p.name in (LATEST, f".{LATEST}.tmp") or TMP.fullmatch(p.name) or DAMAGED.fullmatch(p.name))


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint `step_<N>` to `step_<N>.damaged` (or `.damaged-2`, …): kept, never read."""
    i, aside = 1, path.with_name(f"{path.name}.damaged")
    while aside.exists():
        i += 1
        aside = path.with_name(f"{path.name}.damaged-{i}")
    os.replace(path, aside)
    return aside


def check_saving(save_every: int | None, root: Path | None, resumed: int | None, overwrite: bool,
                 auto: bool = False) -> None:
    """Refuse, at start, a checkpoint setting that would save nothing or overwrite what is there.

    `resumed`: the step of the checkpoint this run resumes from (None: a fresh run). A fresh run needs an
    empty or new directory; a resumed one may write into a directory holding nothing beyond `resumed`
    (so `latest` only moves forward); `overwrite` (--overwrite-checkpoints) lifts both: the first save
    then replaces what lies beyond `resumed` (runtime/checkpoint/sharded.py `save(replace=True)`).
    `auto` (--resume auto, after it chose): a fresh start may find what a crashed run left (`leftovers`).
    """
    if save_every is None and root is None:
        return
    if save_every is None:
        raise LaunchError(f"--checkpoint-dir {root} without --save-every N would save nothing; add --save-every N")
    if save_every < 1:
        raise LaunchError(f"--save-every {save_every}: must be a number of steps ≥ 1 between checkpoints")
    if root is None:
        raise LaunchError(f"--save-every {save_every} needs --checkpoint-dir DIR to write into")
    if root.exists() and not root.is_dir():
        raise LaunchError(f"--checkpoint-dir {root} is a file, not a directory; name a new or empty directory")
    if not root.exists() or overwrite:
        return
    found = steps(root)
    if resumed is None:
        entries = sorted(set(p.name for p in root.iterdir()) - set(leftovers(root) if auto else ()))
        if not entries:
            return
        held = f"checkpoints ({_names(found)})" if found else f"{len(entries)} entries ({', '.join(entries[:3])})"
        raise LaunchError(f"--checkpoint-dir {root} already holds {held}; a fresh run would overwrite them: add "
                          f"--resume {root} to continue that run, --overwrite-checkpoints to replace it, or pass "
                          f"a new directory")
    later = sorted(n for n in found if n > resumed)
    if later:
        raise LaunchError(f"--checkpoint-dir {root} holds {_names({n: None for n in later})}, beyond step {resumed} "
                          f"being resumed: saving would overwrite them and move `{LATEST}` back; resume from the "
                          f"newest, pass another directory, or --overwrite-checkpoints to replace them")


def latest_step(root: Path) -> int | None:
    """The step `latest` names, or None when there is no readable pointer."""
    try:
        m = STEP.fullmatch((root / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


def point_latest(root: Path, name: str) -> None:
    """Replace `latest` atomically: a reader sees the old name or the new one, never half a line."""
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, root / LATEST)
