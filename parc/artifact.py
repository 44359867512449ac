"""The compiled/ directory: write it atomically, load it only if it verifies.

Layout (DESIGN.md): plan.json, programs/*.py, model/model.py, MANIFEST (sha256
of every other file). Writing goes to a sibling temporary directory that is
renamed into place at the end, so a crash never leaves a half-written artifact
that loads. Nothing is replaced that is not ours: the output path may be missing,
an empty directory or an earlier artifact (a directory holding MANIFEST and
plan.json); a file or any other directory is refused unless `force` is given. Output is byte-deterministic: sorted JSON keys, no timestamps, no
absolute paths. Loading reads JSON and text only; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parc.errors import ArtifactError

FORMAT_VERSION = 1
MANIFEST = "MANIFEST"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def is_artifact(path: Path) -> bool:
    """A directory `parc compile` wrote: it holds a MANIFEST and a plan.json (verified only by `load`)."""
    path = Path(path)
    return not path.is_symlink() and path.is_dir() and (path / MANIFEST).is_file() and (path / "plan.json").is_file()


def check_output(out_dir: Path, force: bool = False) -> None:
    """Refuse to replace `out_dir` unless it is missing, an empty directory, an artifact, or `force` says so."""
    out_dir = Path(out_dir)
    if force or not os.path.lexists(out_dir) or is_artifact(out_dir):
        return
    if out_dir.is_symlink():
        what = "a symbolic link"
    elif out_dir.is_dir():
        try:
            if not any(os.scandir(out_dir)):
                return
        except OSError as e:
            raise ArtifactError(f"output {out_dir}: cannot read it: {e.strerror or e}") from None
        what = "a directory that is not a parc artifact (no MANIFEST and plan.json)"
    elif out_dir.is_file():
        what = "a file"
    else:
        what = "not a directory"
    raise ArtifactError(f"output {out_dir} exists and is {what}; refusing to replace it",
                        hint="choose another -o, or pass --force to delete it and write the artifact there")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def write(out_dir: Path, files: dict[str, str | bytes], force: bool = False) -> None:
    """Write `files` (relative path → text or bytes) plus a MANIFEST as `out_dir`, atomically.
    `out_dir` must pass `check_output(out_dir, force)`; an ArtifactError says why it does not."""
    out_dir = Path(out_dir)
    check_output(out_dir, force)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as e:
        raise ArtifactError(f"output {out_dir}: cannot create it: {e.strerror or e}",
                            hint="choose an -o whose parent is a writable directory") from None
    try:
        lines = []
        for rel in sorted(files):
            data = files[rel].encode() if isinstance(files[rel], str) else files[rel]
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            lines.append(f"{_sha256(data)}  {rel}")
        (tmp / MANIFEST).write_text("\n".join(lines) + "\n")
        for p in [tmp, *tmp.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)  # mkdtemp's 0700 would differ from a plain mkdir
        if os.path.lexists(out_dir):
            # move the old one aside and the new one in: a reader sees the old artifact, none, or the new
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            _remove(old)
        else:
            os.replace(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ArtifactError(f"output {out_dir}: cannot write it: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Artifact:
    root: Path
    plan: dict                    # plan.json
    programs: dict[str, str]      # program name → source text
    model_source: str

    @property
    def world_size(self) -> int:
        return self.plan["mesh"]["world_size"]


def load(root: Path) -> Artifact:
    """Verify the manifest and the format version, then read the artifact."""
    root = Path(root)
    what = "is it the output directory of `parc compile`?"
    if not root.is_dir():
        raise ArtifactError(f"{root}: no such directory; {what}")
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise ArtifactError(f"{root}: no {MANIFEST}; {what}")
    listed: dict[str, str] = {}
    for line in manifest.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        listed[rel] = digest
    for rel, digest in listed.items():
        path = root / rel
        if not path.is_file():
            raise ArtifactError(f"{root}: {rel} is listed in the manifest but missing; recompile with `parc compile`")
        if _sha256(path.read_bytes()) != digest:
            raise ArtifactError(f"{root}: {rel} does not match its manifest hash (edited or corrupted); "
                                f"recompile with `parc compile`")
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and rel != MANIFEST and rel not in listed and "__pycache__" not in rel:
            raise ArtifactError(f"{root}: {rel} is not in the manifest; recompile with `parc compile`")
    if "plan.json" not in listed:
        raise ArtifactError(f"{root}: the manifest lists no plan.json; recompile with `parc compile`")
    plan = json.loads((root / "plan.json").read_text())
    version = plan.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"{root}: artifact format version {version!r}, but this parc reads version "
                            f"{FORMAT_VERSION}; recompile with this parc's `parc compile`")
    programs = {name: (root / p["file"]).read_text() for name, p in plan["programs"].items()}
    return Artifact(root, plan, programs, (root / "model" / "model.py").read_text())
