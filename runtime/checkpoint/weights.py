"""Pretrained weights per shard: each rank reads only its own slices of a safetensors checkpoint.

Start here: `Weights.open(path)` accepts one `.safetensors` file, a directory of shards with
`model.safetensors.index.json`, or a Hugging Face checkpoint directory (config.json beside
`model.safetensors` or its shards). `materialize(entries, skeleton, device)` gives a rank its
state, entry by entry of plan.json: a parameter reads exactly its tensor-parallel shard
(`shard`: column, row and vocab slices, each block of a fused qkv) through safetensors'
lazy `safe_open(...).get_slice()`, so a pipeline stage reads only its stage's tensors; a
ZeRO-3 parameter is not read here at all (`stand_ins`), its rank's range of the flat bucket
is read later by `read_range`, row by row. `bytes_read` counts what was read, for the test
that no rank holds the whole model (tests/test_weights.py).

Names. A tensor is looked up by its model FQN; a parameter tied to others
(`lm_head.weight is model.embed_tokens.weight`, one placeholder in the program) is found
under any of its names, as `save_pretrained` keeps only one of them. Buffers the file does
not hold (RoPE's `inv_freq`, non-persistent) come from the skeleton, where they are real
(parc/pretrained.py). A missing parameter or a shape that differs is one line naming it.

Values are cast to the compiled dtype (a bf16 checkpoint trains fp32 masters), as
`load_into` does for the serial reference, so both start from the same numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from parc.errors import LaunchError
from parc.traced import get

INDEX = "model.safetensors.index.json"


class Weights:
    """A safetensors checkpoint opened lazily: `where[key]` is the file holding tensor `key`."""

    def __init__(self, path: Path, where: dict[str, Path]):
        self.path, self.where = path, where
        self.aliases: dict[str, list[str]] = {}  # fqn → the other names of the same parameter
        self.bytes_read = 0
        self._files: dict[Path, object] = {}

    @classmethod
    def open(cls, path: str | Path) -> Weights:
        from safetensors import safe_open

        path = Path(path)
        if path.is_dir():
            index = path / INDEX
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise LaunchError(f"--weights {path}: {INDEX} is not a safetensors index ({e})") from None
                return cls(path, {k: path / f for k, f in weight_map.items()})
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise LaunchError(f"--weights {path}: the directory has neither {INDEX} nor a .safetensors file")
        elif path.is_file():
            files = [path]
        else:
            raise LaunchError(f"--weights {path}: no such file or directory")
        where = {}
        for f in files:
            try:
                with safe_open(str(f), "pt") as h:
                    where.update({k: f for k in h.keys()})
            except Exception as e:  # noqa: BLE001 — safetensors raises its own error types
                raise LaunchError(f"--weights {f}: not a safetensors file ({str(e).splitlines()[0]})") from None
        return cls(path, where)

    def tie(self, model: torch.nn.Module) -> None:
        """Learn which FQNs name one parameter (tied weights), from the model's skeleton."""
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        self.aliases = {n: [m for m in group if m != n] for group in names.values() for n in group}

    def key(self, fqn: str) -> str | None:
        for name in [fqn, *self.aliases.get(fqn, [])]:
            if name in self.where:
                return name
        return None

    def _file(self, key: str):
        from safetensors import safe_open

        f = self.where[key]
        if f not in self._files:
            self._files[f] = safe_open(str(f), "pt")
        return self._files[f]

    def _slice(self, key: str):
        return self._file(key).get_slice(key)

    def _read(self, sl, index: tuple) -> torch.Tensor:
        t = sl[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, fqn: str, shape: list[int], spec: dict | None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's tp shard (`spec`, as runtime/checkpoint/state.py `shard`) of tensor `fqn`, whole shape `shape`;
        with `rows`, only rows [r0, r1) of that shard (dim 0). Reads nothing else."""
        key = self.key(fqn)
        if key is None:
            raise self.missing(fqn)
        if not shape:  # a 0-dim tensor has no slices to take
            t = self._file(key).get_tensor(key)
            self.bytes_read += t.element_size()
            return t
        sl = self._slice(key)
        if list(sl.get_shape()) != list(shape):
            raise LaunchError(f"--weights {self.path}: `{key}` has shape {tuple(sl.get_shape())} but the model's "
                              f"`{fqn}` is {tuple(shape)}; a checkpoint of another model?")
        dim = spec["dim"] if spec else 0
        # `shard`'s chunking (torch.chunk: ceil-sized pieces), as runs [lo, hi) of dim `dim`
        runs = [(0, shape[dim])] if spec is None else _runs(shape[dim], spec.get("blocks", 1), spec["parts"],
                                                             spec["index"])
        local0 = sum(hi - lo for lo, hi in runs) if dim == 0 else shape[0]
        r0, r1 = rows if rows is not None else (0, local0)
        pad = (slice(None),) * dim
        if dim == 0:  # local rows are the runs, concatenated: read the part of each run in [r0, r1)
            parts, start = [], 0
            for lo, hi in runs:
                a, b = max(r0, start), min(r1, start + hi - lo)
                if a < b:
                    parts.append(self._read(sl, (slice(lo + a - start, lo + b - start),)))
                start += hi - lo
            return torch.cat(parts) if len(parts) != 1 else parts[0]
        parts = [self._read(sl, (slice(r0, r1), *pad[1:], slice(lo, hi))) for lo, hi in runs]
        return torch.cat(parts, dim=dim) if len(parts) != 1 else parts[0]

    def read_range(self, fqn: str, shape: list[int], spec: dict | None, a: int, e: int) -> torch.Tensor:
        """Elements [a, e) of this rank's tp shard of `fqn`, flattened (a ZeRO-3 range), reading only the
        shard rows that hold them."""
        local = _local_shape(shape, spec)
        if len(local) == 0:
            return self.read(fqn, shape, spec).reshape(-1)[a:e]
        inner = math.prod(local[1:])
        r0, r1 = a // inner, -(-e // inner)
        flat = self.read(fqn, shape, spec, (r0, r1)).reshape(-1)
        return flat[a - r0 * inner:e - r0 * inner]

    def missing(self, fqn: str) -> LaunchError:
        names = " or ".join(f"`{n}`" for n in [fqn, *self.aliases.get(fqn, [])])
        some = ", ".join(sorted(self.where)[:3])
        return LaunchError(f"--weights {self.path}: no tensor {names}; it holds {len(self.where)} tensors "
                           f"({some}, …): a checkpoint of another model, or saved under other names?")

    def materialize(self, entries: list[dict], skeleton: torch.nn.Module, device: torch.device,
                    stand_ins: set[str] = frozenset()) -> list[torch.Tensor]:
        """This rank's state for plan.json `entries`. Parameters named in `stand_ins` (ZeRO-3's) get a
        one-element stand-in of their shape: ZeroOptimizer reads their ranges (`read_range`)."""
        from parc.runtime.checkpoint.state import shard

        out = []
        for e in entries:
            if "value" in e:
                t = torch.tensor(e["value"], dtype=getattr(torch, e["dtype"]), device=device)
            elif e["name"] in stand_ins:
                t = torch.zeros(1, dtype=getattr(torch, e["dtype"]), device=device).expand(e["shape"])
            elif self.key(e["fqn"]) is not None:
                t = self.read(e["fqn"], whole_shape(e), e["shard"]).to(device, getattr(torch, e["dtype"])).clone()
            elif e["kind"] == "param":
                raise self.missing(e["fqn"])
            else:  # a buffer or constant the checkpoint does not hold: the skeleton's real value
                t = shard(get(skeleton, e["fqn"]).detach(), e["shard"]).to(device).clone()
            out.append(t.requires_grad_(e["kind"] == "param" and e["requires_grad"]))
        return out

    def load_into(self, model: torch.nn.Module) -> None:
        """The serial reference: every parameter (and every buffer the file holds) of a real model, whole."""
        self.tie(model)
        with torch.no_grad():
            for fqn, t in [*model.named_parameters(), *model.named_buffers()]:
                if self.key(fqn) is None:
                    if isinstance(t, torch.nn.Parameter):
                        raise self.missing(fqn)
                    continue
                t.copy_(self.read(fqn, list(t.shape), None))


def whole_shape(e: dict) -> list[int]:
    """The unsharded shape of a plan.json state entry."""
    shape = list(e["shape"])
    if e["shard"] is not None:
        shape[e["shard"]["dim"]] *= e["shard"]["parts"]
    return shape


def _local_shape(shape: list[int], spec: dict | None) -> list[int]:
    if spec is None:
        return list(shape)
    local = list(shape)
    local[spec["dim"]] = sum(hi - lo for lo, hi in _runs(shape[spec["dim"]], spec.get("blocks", 1), spec["parts"],
                                                          spec["index"]))
    return local


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """[lo, hi) of piece i of `torch.chunk` over n elements in `parts`: ceil-sized pieces, the last shorter."""
    c = -(-n // parts)
    return min(i * c, n), min((i + 1) * c, n)


def _runs(n: int, blocks: int | list[int], parts: int, index: int) -> list[tuple[int, int]]:
    """Ranges [lo, hi) of a dim of n that shard `index` of `parts` takes: its chunk of each of `blocks`
    (runtime/checkpoint/state.py's `shard`)."""
    from parc.runtime.checkpoint.state import block_sizes

    out, blo = [], 0
    for size in block_sizes(n, blocks):
        lo, hi = _chunk(size, parts, index)
        out.append((blo + lo, blo + hi))
        blo += size
    return out


def resolve(user, path: str | Path | None, seed: int) -> tuple[Weights | None, torch.nn.Module | None]:
    """(the weights to start from, the model's skeleton), or (None, None) to build the model on CPU under
    the seed (runtime/checkpoint/state.py). `path` (--weights) wins over a `from_pretrained` directory the model file
    names. Without `path`, a model whose skeleton cannot be built (an init that fails on meta) builds on
    CPU as before: it then names no checkpoint, and `from_pretrained` reads its own weights there."""
    from parc.pretrained import build_skeleton

    try:
        skeleton, named = build_skeleton(user, seed)
    except Exception:  # noqa: BLE001 — only a fallback when no weights were asked for
        if path is not None:
            raise
        return None, None
    path = path if path is not None else (named[-1] if named else None)
    if path is None:
        return None, None
    weights = Weights.open(path)
    weights.tie(skeleton)
    return weights, skeleton


def reference(user, seed: int, path: str | Path | None) -> torch.nn.Module:
    """The serial model (--verify, tests): built on CPU under the seed, whole, then given `path`'s weights."""
    from parc.runtime.checkpoint.state import build_reference

    model = build_reference(user, seed)  # from_pretrained in build_model reads its own checkpoint here
    if path is not None:
        Weights.open(path).load_into(model)
    return model


def zero3_params(entry: dict) -> set[str]:
    """Placeholder names of the parameters a ZeRO-3 program keeps only a range of."""
    table = entry.get("zero") or {}
    if table.get("stage") != 3:
        return set()
    return {p["name"] for b in table["buckets"] for p in b["params"]}


def range_reader(weights: Weights, entry: dict, device: torch.device):
    """`read_range(name, a, e)` for runtime/parallel/zero.py: elements [a, e) of a placeholder's tp shard."""
    by_name = {e["name"]: e for e in entry["state"]}

    def read_range(name: str, a: int, e: int) -> torch.Tensor:
        s = by_name[name]
        return weights.read_range(s["fqn"], whole_shape(s), s["shard"], a, e).to(device, getattr(torch, s["dtype"]))

    return read_range
