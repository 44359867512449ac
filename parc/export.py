"""`parc export CHECKPOINT -o model.safetensors`: one consolidated file from a sharded checkpoint.

Reads the `model.<fqn>` entries of a `parc.runtime.checkpoint` directory (or
the latest one under a `--checkpoint-dir`) in one process, without a process
group — DCP assembles every rank's rows — and writes them under their model
FQNs, the names `model.load_state_dict` expects. Optimizer state is left out.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole, by model FQN (single process)."""
    from parc.runtime.checkpoint import resolve

    path = resolve(path)
    reader = dcp.FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("model.")}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return {k.removeprefix("model."): v for k, v in sd.items()}


def export(path: str | Path, out: str | Path) -> Path:
    state = load_model_state(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out)  # atomic: a reader never sees half a file
    return out
