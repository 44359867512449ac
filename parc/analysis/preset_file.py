"""Read a `parc calibrate` preset file back: its own module, so that parc.analysis.cost (which reads
presets) and parc.analysis.calibrate (which writes them, and prices its probe with cost) do not import
each other."""

from __future__ import annotations

import json
from pathlib import Path

from parc.errors import ParcError


def is_file(name: str) -> bool:
    """A preset given as a `parc calibrate` file rather than a shipped name."""
    return name.endswith(".json") or "/" in name


def resolve(name: str | None, plan_file: str | None) -> str | None:
    """The plan's `topology preset=`: a relative file path read against the plan file's directory (a plan
    names its preset file as a .par sits beside it, wherever `parc` is run from); a name as it is."""
    if name is None or not is_file(name) or Path(name).is_absolute() or not plan_file:
        return name
    return str(Path(plan_file).parent / name)


# A calibration outside these bounds measured the machine's neighbours, not the machine: `in_step` is a
# step's time over the tables' price of its ops, each timed in a loop of itself; on a quiet host it is
# near 1 (0.8–2 in tests/test_calibrate_step.py's runs), and 0.02 means the tables ran 50× slower than the
# step that used the same ops (a busy machine during the tables). An efficiency is achieved / peak: above 1
# the peak is not the device's.
IN_STEP_RANGE = (0.2, 5.0)


def implausible(hw) -> list[str]:
    """What in a preset (a `Hardware`) cannot be a quiet measurement of one device, one line each; [] if
    nothing. `parc report`, `parc plan` and `parc calibrate` print these as warnings."""
    out = []
    lo, hi = IN_STEP_RANGE
    for part, r in zip(("forward", "backward", "optimizer"), hw.in_step):
        if not lo <= r <= hi:
            out.append(f"in-step ratio of the {part} {r:.3g} is outside {lo:g}–{hi:g} (a step's time over the "
                       "tables' price of its ops): the tables or the step were measured on a busy machine, "
                       "so every time priced with this preset is off by that factor; calibrate again on a quiet one")
    for row in hw.matmul:
        if row[-1] > 1.05:
            out.append(f"matmul {row[0]} {row[1]}×{row[2]}×{row[3]} at {row[-1]:.0%} of the stated peak: "
                       "the peak FLOP/s is below what the device ran")
            break
    if not 0 < hw.achievable <= 1:
        out.append(f"achievable {hw.achievable:g} is not a fraction of the peak (0–1]")
    return out


def has_gpu() -> bool:
    """Whether this machine has a CUDA device (the default preset is a GPU's: said loudly when it has none)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


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
    for key in ("matmul", "attention", "attention_cudnn", "collectives", "op_overheads", "mem_times"):
        data[key] = tuple(tuple(r) for r in data.get(key, ()))
    for key in ("in_step", "step_overhead"):   # a file from before they were measured: the defaults
        if key in data:
            data[key] = tuple(data[key])
    return data
