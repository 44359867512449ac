"""A checksum of every file of a checkpoint, in parc.json, checked before a tensor is read.

Start here: `measure(folder, rank, world)` at save, `damaged(saved, rank, world)` at load.

Why: DCP checks that its index parses and names files that exist, and runtime/checkpoint/files.py
checks each file is long enough; neither sees a flipped byte inside a shard (a bad disk block, a
copy cut and resumed at the wrong offset). Such a checkpoint would load and train on wrong values
without a word. So every file DCP wrote (its shard files and `.metadata`) gets its size and CRC-32
recorded in parc.json (`files`), and a checkpoint whose bytes differ is refused in one line naming
the file (`--resume auto` then falls back to the one before: parc/run.py).

CRC-32 (zlib) because it is a checksum, not a signature: it catches every burst error up to 32
bits and any random damage with probability 1 − 2⁻³², at about 6 GB/s on one core (SHA-256: 1.7).
The work is shared: rank r reads the files whose index in sorted order is r modulo the world size,
at save (the files just written, likely still in the page cache) and at load, and the verdicts are
gathered, so no rank reads the whole checkpoint. A process without a group (`parc export`) reads
them all (rank 0 of a world of 1).

A checkpoint written before checksums existed has no `files` in parc.json and is read as before.
"""

from __future__ import annotations

import zlib
from pathlib import Path

CHUNK = 8 << 20
RECORD = "parc.json"  # written after the sums, so not among them


def files(folder: Path) -> list[str]:
    """Every file of a checkpoint directory but parc.json, by name, sorted (the same list on every rank)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != RECORD)


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def measure(folder: Path, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """This rank's share of the sums: {name: {"bytes", "crc32"}} for every world-th file from `rank`."""
    return {name: {"bytes": (folder / name).stat().st_size, "crc32": crc32(folder / name)}
            for name in files(folder)[rank::world]}


def damaged(folder: Path, info: dict, rank: int = 0, world: int = 1) -> list[str]:
    """This rank's share of the recorded files whose size or CRC-32 differs (or which are gone), each as
    one phrase naming the file. [] when parc.json records no sums (an older checkpoint)."""
    recorded = info.get("files")
    if not recorded:
        return []
    out = []
    for name in sorted(recorded)[rank::world]:
        want, path = recorded[name], folder / name
        if not path.is_file():
            out.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            out.append(f"{name} holds {size} bytes, {want['bytes']} were written")
        elif (got := crc32(path)) != want["crc32"]:
            out.append(f"{name} does not match its checksum (crc32 {got}, {want['crc32']} when written)")
    return out
