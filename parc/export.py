"""`parc export CHECKPOINT -o model.safetensors`: one consolidated file from a sharded checkpoint.

Reads the `model.<fqn>` entries of a `parc.runtime.checkpoint` directory (or
the latest one under a `--checkpoint-dir`) in one process, without a process
group — DCP assembles every rank's rows — and writes them under their model
FQNs, the names `model.load_state_dict` expects. Optimizer state is left out.
A damaged checkpoint or an unusable output path is one line (exit 2), and a
failed write leaves no temporary file behind.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parc.errors import ParcError

WHAT = "parc export: checkpoint"


def load_model_state(path: str | Path, what: str = WHAT) -> dict[str, torch.Tensor]:
    """Every parameter of a checkpoint, whole, by model FQN (single process)."""
    from parc.runtime.checkpoint import read

    return {k.removeprefix("model."): v for k, v in read(path, "model.", what).items()}


def export(path: str | Path, out: str | Path) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    if out.is_dir():
        raise ParcError(f"-o {out} is a directory; name the .safetensors file to write "
                        f"(e.g. -o {out / 'model.safetensors'})")
    if out.exists() and not out.is_file():
        raise ParcError(f"-o {out} exists and is not a regular file")
    state = load_model_state(path)
    if out.parent.exists() and not out.parent.is_dir():
        raise ParcError(f"-o {out}: {out.parent} is a file, not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(tmp), metadata={"format": "pt"})
        tmp.replace(out)  # atomic: a reader never sees half a file
    except OSError as e:
        raise ParcError(f"-o {out}: cannot write ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return out
