"""`parc export CHECKPOINT -o DIR --hf MODEL`: a Hugging Face directory from a sharded checkpoint.

Start here: `export_hf`. When the model file's `build_model()` returns a transformers
`PreTrainedModel`, the directory `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads
is its config.json (and generation_config.json) plus the checkpoint's parameters as
safetensors under the model's own state_dict names: one `model.safetensors`, or shards of at
most `max_shard_size` bytes named `model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`. The model is built as a skeleton (parc/pretrained.py: no
weight memory) for its config and names only; the values come from the checkpoint
(parc/export.py `load_model_state`), and persistent buffers it does not hold from the
skeleton. A tied parameter (`lm_head.weight is model.embed_tokens.weight`) is written under
each of its names.

Never overwrites: DIR must not exist or be an empty directory. The files are written into a
temporary sibling that is renamed to DIR at the end, so a failure leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from parc.errors import ParcError

INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' → 5·10⁹ bytes (KB/MB/GB decimal, KiB/MiB/GiB binary, as transformers reads them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise ParcError(f"--max-shard-size {text}: expected a positive size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def model_file(model: Path) -> Path:
    """The model file of `--hf MODEL`: a model file, or a compiled directory's copy of it."""
    if model.is_dir() and (model / "model" / "model.py").is_file():
        return model / "model" / "model.py"
    if model.is_file():
        return model
    raise ParcError(f"--hf {model}: neither a model file nor a compiled directory (with model/model.py)")


def export_hf(checkpoint: str | Path, out: str | Path, model: str | Path, max_shard_size: int = 5 * 10**9) -> Path:
    from safetensors.torch import save_file

    from parc.export import load_model_state
    from parc.pretrained import build_skeleton, is_hf_model
    from parc.trace import load_user_module

    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ParcError(f"-o {out} exists and is not an empty directory; refusing to overwrite it "
                        f"(name a new directory)")
    skeleton, _ = build_skeleton(load_user_module(model_file(Path(model))))
    if not is_hf_model(skeleton):
        raise ParcError(f"--hf {model}: build_model() returns a {type(skeleton).__name__}, not a transformers "
                        f"PreTrainedModel, so there is no config.json to write; export one safetensors file "
                        f"instead (parc export CHECKPOINT -o model.safetensors)")
    tensors = _by_state_dict_name(skeleton, load_model_state(checkpoint), checkpoint)
    shards = _shards(tensors, max_shard_size)
    if out.parent.exists() and not out.parent.is_dir():
        raise ParcError(f"-o {out}: {out.parent} is a file, not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        skeleton.config.save_pretrained(tmp)
        if getattr(skeleton, "generation_config", None) is not None:
            skeleton.generation_config.save_pretrained(tmp)
        names = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, part in zip(names, shards):
            save_file(part, str(tmp / name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
                     "weight_map": {k: n for n, part in zip(names, shards) for k in sorted(part)}}
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        tmp.rename(out)
    except OSError as e:
        raise ParcError(f"-o {out}: cannot write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _by_state_dict_name(skeleton: torch.nn.Module, state: dict[str, torch.Tensor], checkpoint) -> dict:
    """Every state_dict entry of the model: a parameter from the checkpoint (under any name of its tie), a
    persistent buffer from the checkpoint or else the skeleton's real value."""
    names: dict[int, list[str]] = {}
    for n, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    alias = {n: group for group in names.values() for n in group}
    params = set(alias)
    out, missing = {}, []
    for key, value in skeleton.state_dict(keep_vars=True).items():
        found = next((state[n] for n in alias.get(key, [key]) if n in state), None)
        if found is None and key not in params and value.device.type != "meta":
            found = value.detach()
        if found is None:
            missing.append(key)
            continue
        if list(found.shape) != list(value.shape):
            raise ParcError(f"parc export: checkpoint {checkpoint} holds `{key}` of shape {tuple(found.shape)} but "
                            f"the model's is {tuple(value.shape)}: a checkpoint of another model?")
        out[key] = found.contiguous().clone()
    if missing:
        more = f", … {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ParcError(f"parc export: checkpoint {checkpoint} lacks {len(missing)} of the model's tensors "
                        f"({', '.join(missing[:3])}{more}): a checkpoint of another model?")
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, a new shard whenever the next one would pass `limit` bytes (a tensor larger
    than the limit gets a shard of its own, as in transformers)."""
    shards, size = [{}], 0
    for k in sorted(tensors):
        n = _nbytes(tensors[k])
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += n
    return shards
