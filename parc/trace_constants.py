"""Tensor constants of the traced graph: where each one's real value comes from at run time.

Start here: parc/trace.py traces inside `keep_data_constants()` and asks `constant_source`
for every constant torch.export lifts. The model is traced on meta, where tensors have no
values, so a constant's value must be found elsewhere:

- made in forward from shapes (`torch.arange(T, device=x.device)`, `ones(T, T).tril()`):
  not a constant at all; export traces the ops, and they run on each rank.
- a plain tensor attribute of a module (not a parameter or buffer), e.g. `self.scale`:
  lifted under its FQN; each rank reads it from its real model (parc.traced.get).
- the same held in a list, tuple, dict or plain object attribute (`self.tables[0]`,
  `self.cfg.freqs`): export names it `lifted_tensor_N`; `attribute_path` finds the
  attribute holding that very tensor object, and the constant takes its path
  (`tables.0`), which parc.traced.get follows at run time like any FQN.
- made in forward from data (`torch.tensor([0.5, 1.0], device=x.device)`,
  `x.new_tensor(...)`, or a list index, `qkv[..., [-2], :]`, which torch's indexing turns
  into an index tensor on the indexed tensor's device): on meta its value would be lost. `keep_data_constants` makes it
  on CPU and moves it (`.to(meta)`, which the program replays on the rank's device),
  so export lifts the real CPU value; it is carried in plan.json (`value`) when it has
  at most MAX_CARRIED_ELEMENTS elements, and refused, at the line that made it, when larger.

Guarantees: every constant `constant_source` accepts has a value on each rank;
one it cannot place raises a TraceError located in the user's code.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from parc.errors import Span, TraceError
from parc.traced import get

# Elements of a tensor made in forward from data that plan.json carries inline (per program, as a JSON list):
# 4096 (16 KiB of float32) holds lookup tables, scales and small codebooks; a larger value belongs in the
# model's state, which each rank reads from its own build.
MAX_CARRIED_ELEMENTS = 4096

_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)
_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
_META = torch.device("meta")
_MAX_DEPTH = 4  # attribute levels searched below a module: self.cfg.tables["rope"][0]


class keep_data_constants(TorchFunctionMode):
    """While active, a tensor made from Python or numpy data on meta is made on CPU and moved to meta.

    Python data reaches a tensor through two doors: the factories (`torch.tensor`, `as_tensor`,
    `asarray`, `Tensor.new_tensor`) and indexing (`x[..., [-2]]`, `x[:, [0, 3]] = 0`, `x[range(3)]`,
    a list of bools), where torch's C++ indexing turns each list into an index tensor on `x`'s device:
    on meta that tensor has no value, and export lifted it as `lifted_tensor_N`, lost. Both are made here
    on CPU, from the same data with the same dtype, then moved, so export lifts the real value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and args and _is_meta(kwargs.get("device")) and _is_data(args[0], kwargs):
            return func(*args, **{**kwargs, "device": "cpu"}).to(_META)
        if getattr(func, "__name__", "") == "new_tensor" and len(args) > 1 and isinstance(args[0], torch.Tensor) \
                and _is_meta(kwargs.get("device", args[0].device)) and _is_data(args[1], kwargs):
            dtype = kwargs.get("dtype") or args[0].dtype
            return torch.tensor(args[1], dtype=dtype, device="cpu").to(_META)
        if func in _INDEXING and len(args) > 1 and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            args = (args[0], real_indices(args[1], tuple(args[0].shape)), *args[2:])
        return func(*args, **kwargs)


def real_indices(index, shape: tuple[int, ...]):
    """`index` (into a tensor of `shape`) with every Python sequence that torch's indexing would turn into an
    index tensor replaced by that tensor, made on CPU and moved to meta. Mirrors python_variable_indexing.cpp:
    a tuple is a tuple of indices; a non-tuple sequence shorter than 32 that holds a tensor, sequence, slice,
    `...` or None is one too (NumPy's legacy rule); any other sequence is one index, an int64 tensor.

    A list of bools is a mask: torch indexes with its `nonzero()` positions, whose count the trace could only
    know as a symbol. Here the mask's positions are taken on CPU instead (one int64 tensor per mask dim, what
    torch's `expandTensors` makes of it), so every shape stays concrete; when the mask's shape differs from
    the dims it indexes it is left alone, for torch to refuse as eager would."""
    tupled = isinstance(index, tuple) or _sequence_as_tuple(index)
    parts = list(index) if tupled else [index]
    width = [_dims(p) for p in parts]
    dim, out = 0, []
    for part, k in zip(parts, width):
        if part is Ellipsis:
            k = len(shape) - sum(w for w in width if w is not None)
        elif _data_array(part) is not None:
            a = _data_array(part)
            if a.is_bool and a.shape == tuple(shape[dim:dim + k]):
                out += [_on_meta(p, torch.int64) for p in a.nonzero()]
            else:
                out.append(_on_meta(part, torch.bool if a.is_bool else torch.int64))
            dim += k
            continue
        out.append(part)
        dim += k or 0
    return tuple(out) if tupled else out[0]


def _dims(part) -> int | None:
    """How many dims of the indexed tensor `part` consumes (None for `...`, which takes the rest)."""
    if part is Ellipsis:
        return None
    if part is None or isinstance(part, bool):
        return 0
    if isinstance(part, torch.Tensor):
        return part.dim() if part.dtype in (torch.bool, torch.uint8) else 1
    if _data_array(part) is not None:
        return _data_array(part).ndim if _data_array(part).is_bool else 1
    if type(part).__module__ == "numpy" and hasattr(part, "dtype"):
        return part.ndim if part.dtype.kind in "bu" and part.dtype.itemsize == 1 else 1
    return 1


def _data_array(part) -> _Data | None:
    """A rectangular Python sequence of numbers or bools, flattened (pure Python: a torch op here would be
    traced into the graph); None for anything else, which torch's indexing handles without Python data."""
    if not _is_sequence(part) or not _is_data(part, {}):
        return None
    shape, level = [], [part]
    while all(_is_sequence(x) for x in level) and level:
        sizes = {len(x) for x in level}
        if len(sizes) != 1:
            return None  # ragged: torch refuses it too
        shape.append(sizes.pop())
        level = [y for x in level for y in x]
    if any(_is_sequence(x) for x in level):
        return None
    return _Data(level, tuple(shape), bool(level) and all(type(x).__name__ in ("bool", "bool_") for x in level))


class _Data:
    def __init__(self, flat: list, shape: tuple[int, ...], is_bool: bool):
        self.flat, self.shape, self.is_bool, self.ndim = flat, shape, is_bool, len(shape)

    def nonzero(self) -> list[list[int]]:
        """Per dim, the coordinates of the true entries in row-major order (torch's `nonzero(as_tuple=True)`)."""
        out = [[] for _ in self.shape]
        for i, x in enumerate(self.flat):
            if x:
                for d in reversed(range(self.ndim)):
                    i, c = divmod(i, self.shape[d])
                    out[d].append(c)
        return out


def _on_meta(values, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device="cpu").to(_META)


def _sequence_as_tuple(index) -> bool:
    if not _is_sequence(index) or len(index) >= 32:
        return False
    return any(isinstance(x, (torch.Tensor, slice)) or x is None or x is Ellipsis or _is_sequence(x) for x in index)


def _is_sequence(x) -> bool:
    return isinstance(x, (list, tuple, range))


def constant_source(model: torch.nn.Module, fqn: str, value: torch.Tensor, user_nodes: list, user_path: Path,
                    constants: dict[str, torch.Tensor], max_carried: int = MAX_CARRIED_ELEMENTS) -> str:
    """The FQN the runtime reads constant `fqn` from (its own, or the attribute path holding `value`);
    a value made in forward is recorded in `constants` instead. Raises a located TraceError otherwise."""
    try:
        get(model, fqn)
        return fqn  # a plain tensor attribute: the real model has it at run time
    except (AttributeError, KeyError, IndexError, ValueError):
        pass
    path = attribute_path(model, value)
    if path is not None:
        return path
    span = creation_span(user_nodes, user_path)
    if value.device.type == "meta":
        raise TraceError(f"the value of tensor constant `{fqn}` {tuple(value.shape)} is lost on meta: parc found no "
                         f"module attribute holding it", span,
                         hint="parc keeps the value of a tensor torch.tensor/as_tensor/new_tensor or a list index "
                              "(`x[..., [0, 2]]`) makes from Python data; this one came another way (a list that "
                              "holds a tensor, say): make it with torch.tensor(data, device=x.device), or hold it in a "
                              "buffer or a plain tensor attribute of a module (also in a list or dict), which each rank "
                              "reads from its own build")
    if value.numel() > max_carried:
        raise TraceError(f"a {tuple(value.shape)} tensor is made in forward from data: {value.numel()} elements > "
                         f"{max_carried}, the most parc carries inline in plan.json", span,
                         hint="hold it in a buffer (register_buffer(name, t, persistent=False)) or a plain tensor "
                              "attribute of a module, made once in __init__; each rank reads those from its own "
                              f"build. In code you cannot edit (a library's): `parc compile --max-carried-constant "
                              f"{value.numel()}` carries it in plan.json (as a JSON list, in each program that uses "
                              f"it)")
    constants[fqn] = value.detach().clone()
    return fqn


def attribute_path(model: torch.nn.Module, value: torch.Tensor) -> str | None:
    """The dotted path (list and tuple indices, dict keys as parts) of an attribute of one of `model`'s modules
    that is `value` itself; None when there is none. Parameters and buffers are export's to name."""
    for name, module in model.named_modules():
        for attr, held in vars(module).items():
            if attr.startswith("_") or isinstance(held, torch.nn.Module):
                continue
            found = _search(held, value, _MAX_DEPTH, set())
            if found is not None:
                return ".".join(p for p in (name, attr, found) if p)
    return None


def creation_span(user_nodes: list, user_path: Path) -> Span | None:
    """Where the graph first uses a constant: the innermost user-code frame of its first user node's
    stack trace (the line that made or read it), preferring the model file's own frames."""
    frames = []
    for node in user_nodes:
        frames += re.findall(r'File "([^"]+)", line (\d+)', node.meta.get("stack_trace") or "")
        if frames:
            break
    own = [(f, n) for f, n in frames if Path(f).resolve() == Path(user_path).resolve()]
    torch_dir = Path(torch.__file__).resolve().parent
    other = [(f, n) for f, n in frames if not Path(f).resolve().is_relative_to(torch_dir)]
    for f, n in (own or other)[-1:]:
        return Span(f, int(n), 1)
    return Span(str(user_path), 1, 1)


def _search(obj, value: torch.Tensor, depth: int, seen: set) -> str | None:
    """'' when `obj` is `value`; else the path below `obj` to it, through lists, tuples, dicts and objects."""
    if obj is value:
        return ""
    if depth == 0 or id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, str, bytes, int, float, type)):
        return None
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        items = [(str(i), x) for i, x in enumerate(obj)]
    elif isinstance(obj, dict):
        items = [(k, x) for k, x in obj.items() if isinstance(k, str) and k and "." not in k]
    elif hasattr(obj, "__dict__") and not callable(obj):
        items = [(k, x) for k, x in vars(obj).items() if not k.startswith("_")]
    else:
        return None
    for key, x in items:
        below = _search(x, value, depth - 1, seen)
        if below is not None:
            return ".".join(p for p in (key, below) if p)
    return None


def _is_data(data, kwargs: dict) -> bool:
    """Python or numpy data (no tensor inside), for a tensor that does not require grad."""
    leaves = torch.utils._pytree.tree_leaves(data)
    return not kwargs.get("requires_grad") and not any(isinstance(a, torch.Tensor) for a in leaves)


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"
