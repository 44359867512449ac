"""Read a `parc calibrate` preset file back: its own module, so that parc.analysis.cost (which reads
presets) and parc.analysis.calibrate (which writes them, and prices its probe with cost) do not import
each other."""

from __future__ import annotations

import json
from pathlib import Path

from parc.errors import ParcError


def read_preset(path: str, known: set[str]) -> dict:
    """The fields of a `parc calibrate` file, checked against `known` (Hardware's); one clear error for a
    bad file. parc.analysis.cost.hardware builds the Hardware (this module does not import cost)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ParcError(f"preset file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ParcError(f"preset file {path}: not JSON ({e.msg} at line {e.lineno})") from None
    need = {"name", "memory", "flops", "intra_bw", "inter_bw"}
    if not isinstance(data, dict) or need - set(data):
        missing = need - set(data) if isinstance(data, dict) else need
        raise ParcError(f"preset file {path}: missing {', '.join(sorted(missing))}",
                        hint="write one with `parc calibrate -o FILE.json`")
    unknown = set(data) - known
    if unknown:
        raise ParcError(f"preset file {path}: unknown field(s) {', '.join(sorted(unknown))}",
                        hint="valid: " + ", ".join(sorted(known)))
    data.setdefault("achievable", 0.5)
    return as_fields(data)


def as_fields(data: dict) -> dict:
    """`data` (a preset as JSON holds it: lists) with its tables as the tuples Hardware's fields are."""
    for key in ("matmul", "attention", "collectives", "op_overheads", "mem_times"):
        data[key] = tuple(tuple(r) for r in data.get(key, ()))
    for key in ("in_step", "step_overhead"):   # a file from before they were measured: the defaults
        if key in data:
            data[key] = tuple(data[key])
    return data
