"""Tracing: the user's model file → one aten-level FX graph of the loss, on meta.

Start here: `load_user_module(path)` imports a model file, `trace(user, micro_batch)`
exports its loss as a `Traced` (parc/traced.py: what the passes consume, and
`module_path(node)`, which module a node came from), and `parc.traced.state_values(traced, model)` supplies the real
state when a traced graph is run.

The model-file convention (also in docs/model-convention.md). A `model.py` defines:

    build_model() -> torch.nn.Module
        Builds the model. parc calls it under `torch.device("meta")` to compile and
        on CPU under `torch.manual_seed(seed)` to train, so it must depend on no
        global state besides the RNG.
    get_batch(step: int, batch_size: int) -> tuple[Tensor, ...]
        The GLOBAL batch of optimizer step `step`, a pure function of
        (step, batch_size). Dim 0 of every tensor is the sample dim: parc slices it
        across data-parallel ranks and micro-batches.
    loss_fn(model, *batch) -> Tensor
        The scalar loss, a MEAN over the batch's samples/tokens, so that the mean of
        equal micro-batches' losses is the global batch's loss.

The number of layers is not declared: `num_layers(model)` is the length of the
longest `nn.ModuleList`/`nn.Sequential` whose children all have one class.

How tracing works. The model is built on meta (no memory for weights), a sample
batch of `micro_batch` samples is moved to meta, and a tiny wrapper whose forward
is `loss_fn(self.model, *batch)` goes through `torch.export.export(strict=False)`
in train mode. The wrapper's `model.` prefix is stripped, so every FQN equals a
name of the user's `model.named_parameters()` / `named_buffers()`. The export
runs with no default-device context, like a run on an accelerator: a tensor the
forward creates without `device=` lands on CPU, and mixing it with the model's
tensors fails exactly as it would on a GPU.

State and where its values come from at run time (`state_values`):
- "param", "buffer": `get(model, fqn)` on the real model; this covers
  non-persistent buffers (e.g. RoPE's `inv_freq`) that are not in its state_dict.
- "constant", a plain tensor attribute of a module, also one held in a list or
  dict: the same attribute lookup, by the path parc/trace_constants.py finds.
- "constant", a tensor the forward creates from data (`torch.tensor([0.5, 2.0],
  device=x.device)`, named `lifted_tensor_N`): made on CPU while tracing, so its
  value is real, and stored in `Traced.constants` (plan.json carries it).

While export runs, parc/trace_guards.py refuses what would change the backward
behind the graph's back: custom autograd.Functions, backward hooks, gradients taken in forward,
reentrant checkpointing, custom ops without autograd. What no rule names, parc/grad_probe.py
catches after the trace (compile and check run it). parc/trace_host_random.py refuses a number
drawn from a host generator (`random`, `numpy.random`) in forward, which the graph would keep as
a constant.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import itertools
import logging
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from parc import replicate
from parc.errors import Span, TraceError
from parc.pretrained import pretrained_as_config
from parc.trace_constants import MAX_CARRIED_ELEMENTS, constant_source, keep_data_constants
from parc.trace_guards import guarded
from parc.trace_host_random import locate_draw, watched
from parc.trace_regions import inline_regions
from parc.trace_sizes import bound_sizes
from parc.traced import WRAPPER_ATTR, StateInput, Traced, UserInputSpec, get, num_layers

_SIGNATURES = {
    "build_model": "def build_model() -> torch.nn.Module: ...",
    "get_batch": "def get_batch(step: int, batch_size: int) -> tuple[torch.Tensor, ...]: ...",
    "loss_fn": "def loss_fn(model, *batch) -> torch.Tensor:  # scalar, mean over the batch",
}
_KINDS = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant"}
_counter = itertools.count()


@dataclass(frozen=True)
class UserModel:
    path: Path
    module: ModuleType
    build_model: Callable[[], torch.nn.Module]
    get_batch: Callable[[int, int], tuple[torch.Tensor, ...]]
    loss_fn: Callable[..., torch.Tensor]


def load_user_module(path: str | Path) -> UserModel:
    """Import a model file by path, under a unique module name, and check its three functions."""
    path = Path(path).resolve()
    if not path.is_file():
        raise TraceError(f"model file {path} does not exist")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"parc_user_{path.stem}_{digest}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    with _user_errors(path, "importing the model file"):
        spec.loader.exec_module(module)
    fns = {}
    for fn, signature in _SIGNATURES.items():
        value = getattr(module, fn, None)
        if fn == "get_batch" and value is None and callable(getattr(module, "get_samples", None)):
            value = _batch_of_samples(module.get_samples)  # the per-rank convention (runtime/data.py)
        if not callable(value):
            what = "is not a function" if value is not None else "is missing"
            raise TraceError(f"`{fn}` {what} in the model file", Span(str(path), 1, 1),
                             hint=f"define `{signature}` (see docs/model-convention.md)")
        fns[fn] = value
    return UserModel(path, module, **fns)


def _batch_of_samples(get_samples):
    """get_batch(step, n) for a model file that defines only get_samples(indices): samples step·n … step·n + n − 1,
    what `parc compile` traces one micro-batch of (training reads samples through runtime/data.py's sampler)."""
    def get_batch(step: int, batch_size: int):
        return get_samples(torch.arange(step * batch_size, (step + 1) * batch_size, dtype=torch.int64))
    return get_batch


def trace(user: UserModel, micro_batch: int, fast: bool = True, debug: bool = False,
          max_carried: int = MAX_CARRIED_ELEMENTS) -> Traced:
    """Export `loss_fn(build_model(), *get_batch(0, micro_batch))` on meta; no weight memory is used.

    `max_carried`: the most elements of a tensor made in forward from data that plan.json carries
    (parc/trace_constants.py; `parc compile --max-carried-constant`).

    With `fast`, a model with ≥ 3 repeated blocks is exported with 2 and the rest
    replicated (`parc.replicate`), which gives the same graph in a fraction of the time.
    """
    # from_pretrained builds from the checkpoint's config.json on meta; parc.run reads the weights per shard
    with _user_errors(user.path, "building the model"), torch.device("meta"), pretrained_as_config([]):
        model = user.build_model()
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"build_model() returned {type(model).__name__}, not a torch.nn.Module",
                         _def_span(user, "build_model"), hint=_SIGNATURES["build_model"])
    model.train()  # dropout and friends must appear as they will run in training
    batch = _sample_batch(user, micro_batch)
    traced = replicate.trace_replicated(lambda m: _export(user, m, batch, debug, max_carried), model) if fast else None
    return traced if traced is not None else _export(user, model, batch, debug, max_carried)


@contextlib.contextmanager
def _quiet_unless_failed_in_debug(debug: bool):
    """What torch.export prints while it fails stays unsaid unless --debug: parc's located error says it.

    A data-dependent branch made torch print the FX graph of the failing region once per attempt (three
    times, 98 lines) above parc's one located error, and log "Unable to find user code". The text is held
    back; an export that succeeds prints it after all (nothing it says is lost), `--debug` always does.
    """
    if debug:
        yield
        return
    held, shapes = io.StringIO(), logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    succeeded = False
    try:
        with contextlib.redirect_stderr(held):
            yield
        succeeded = True
    finally:
        shapes.setLevel(level)
        if succeeded:
            sys.stderr.write(held.getvalue())


def _export(user: UserModel, model: torch.nn.Module, batch: tuple[torch.Tensor, ...], debug: bool = False,
            max_carried: int = MAX_CARRIED_ELEMENTS) -> Traced:
    """The whole model through torch.export (what `trace` does when replication does not apply)."""
    wrapper = _LossWrapper(model, user.loss_fn)

    def export():
        with _user_errors(user.path, "tracing the loss", model), guarded(model, user.path), keep_data_constants(), \
                _quiet_unless_failed_in_debug(debug):
            return torch.export.export(wrapper, batch, strict=False)

    with watched(model, user.module) as drew:
        ep = export()
    if drew():  # a host generator changed state: find the draw, and refuse it if the model's code made it
        with locate_draw(model, user.module):
            export()
    gm = ep.graph_module
    _check_scalar_loss(user, gm)
    inline_regions(gm, user.path)  # `with torch.no_grad():` blocks in forward: flat aten code, detached
    set_device(gm, torch.device("cpu"))  # `device=x.device` was traced as meta; parc trains on CPU ranks
    bound_sizes(gm, user.path)  # sizes that depend on the data, at their upper bounds (trace_sizes.py)

    state, constants, inputs = [], {}, []
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        val = node.meta["val"]
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(UserInputSpec(spec.arg.name, tuple(val.shape), _dtype(val.dtype)))
            continue
        if spec.kind not in _KINDS:
            raise TraceError(f"unsupported graph input {spec.arg.name} of kind {spec.kind.name}",
                             _def_span(user, "loss_fn"))
        fqn = _strip_wrapper(spec.target)
        kind = _KINDS[spec.kind]
        if kind == "constant":  # where its value comes from at run time (parc/trace_constants.py)
            fqn = constant_source(model, fqn, ep.constants[spec.target], list(node.users), user.path, constants,
                                  max_carried)
        node.meta["parc_fqn"] = fqn  # lets module_path() place state placeholders
        state.append(StateInput(spec.arg.name, fqn, kind, tuple(val.shape), _dtype(val.dtype),
                                kind == "param" and bool(get(model, fqn).requires_grad)))
    state = _drop_tied_aliases(gm, model, state)
    return Traced(
        gm=gm, state=state, inputs=inputs,
        module_paths=[n for n, _ in model.named_modules() if n],
        num_layers=num_layers(model),
        param_count=sum(p.numel() for p in model.parameters()),
        constants=constants, program=ep,
    )


def _drop_tied_aliases(gm: torch.fx.GraphModule, model: torch.nn.Module, state: list[StateInput]) -> list[StateInput]:
    """torch.export lifts a tied parameter (HF's `lm_head.weight is transformer.wte.weight`) once per name but
    uses only one placeholder; the other has no users. Kept, it would be a second, never-updated copy of the
    tensor on every rank, reported (gathered_state) under the other name. Such a placeholder is removed."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    owners: dict[int, int] = {}  # id(tensor) → how many state entries name it
    for s in state:
        if s.kind == "param":
            owners[id(get(model, s.fqn))] = owners.get(id(get(model, s.fqn)), 0) + 1
    keep = []
    for s in state:
        node = placeholders[s.name]
        if s.kind == "param" and not node.users and owners[id(get(model, s.fqn))] > 1:
            owners[id(get(model, s.fqn))] -= 1
            gm.graph.erase_node(node)
            continue
        keep.append(s)
    if len(keep) != len(state):
        gm.recompile()
    return keep


def set_device(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Retarget the devices the trace baked in (`arange(..., device=meta)`, `.to(meta)`); returns how many."""
    meta, count = torch.device("meta"), 0

    def swap(a):
        nonlocal count
        if isinstance(a, torch.device) and a == meta:
            count += 1
            return device
        return a

    for node in gm.graph.nodes:
        node.args = torch.fx.node.map_aggregate(node.args, swap)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()
    return count


# --- helpers ---------------------------------------------------------------------


class _LossWrapper(torch.nn.Module):
    """Makes `loss_fn(model, *batch)` exportable: export wants a Module whose forward is the function."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        setattr(self, WRAPPER_ATTR, model)
        self._loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(getattr(self, WRAPPER_ATTR), *batch)


def _sample_batch(user: UserModel, micro_batch: int) -> tuple[torch.Tensor, ...]:
    with _user_errors(user.path, "getting a batch"):
        batch = user.get_batch(0, micro_batch)
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise TraceError(f"get_batch(0, {micro_batch}) returned {type(batch).__name__}, not a tuple of tensors",
                         _def_span(user, "get_batch"), hint=_SIGNATURES["get_batch"])
    for i, t in enumerate(batch):
        if t.dim() == 0 or t.shape[0] != micro_batch:
            got = "a scalar" if t.dim() == 0 else f"dim 0 = {t.shape[0]}"
            raise TraceError(f"get_batch(0, {micro_batch}) tensor {i} has {got} ≠ batch_size {micro_batch}",
                             _def_span(user, "get_batch"), hint="dim 0 of every batch tensor is the sample dim")
    return tuple(t.to("meta") for t in batch)


def _check_scalar_loss(user: UserModel, gm: torch.fx.GraphModule) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    vals = [a.meta.get("val") for a in out] if isinstance(out, (tuple, list)) else [None]
    if len(vals) != 1 or not isinstance(vals[0], torch.Tensor) or vals[0].dim() != 0:
        shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals]
        raise TraceError(f"loss_fn must return one scalar tensor, got {shapes}", _def_span(user, "loss_fn"),
                         hint="return a mean, e.g. F.cross_entropy(logits.flatten(0, 1), targets.flatten())")


def _strip_wrapper(fqn: str) -> str:
    prefix = WRAPPER_ATTR + "."
    return fqn[len(prefix):] if fqn.startswith(prefix) else fqn


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _def_span(user: UserModel, fn: str) -> Span:
    code = getattr(getattr(user.module, fn, None), "__code__", None)
    return Span(str(user.path), code.co_firstlineno if code else 1, 1)


class _user_errors:
    """Turns any exception raised under it into a TraceError at the user file's innermost line."""

    def __init__(self, path: Path, doing: str, model: torch.nn.Module | None = None):
        self.path, self.doing, self.model = path, doing, model

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or isinstance(exc, TraceError) or not isinstance(exc, Exception):
            return False
        where, at, depth = _failing_module(self.model, tb)
        mine = [i for i, f in enumerate(traceback.extract_tb(tb)) if Path(f.filename).resolve() == self.path]
        if at is not None and depth <= max(mine, default=-1):
            at = None  # the user's own line is as deep: it is the one to show
        span = at or _user_span(self.path, exc) or Span(str(self.path), 1, 1)
        first = (str(exc).strip().splitlines() or [typ.__name__])[0]
        subject = f"module `{where}`" if where else ("the model" if self.model is not None else "the model file")
        raise TraceError(f"{self.doing} failed in {subject}: {typ.__name__}: {first}", span,
                         hint=_hint(exc)) from exc


def _user_span(path: Path, exc: BaseException) -> Span | None:
    """The innermost frame in the user's file, else a `File "...", line N` in torch's message (None: neither)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path]
    if isinstance(exc, SyntaxError) and exc.lineno and Path(exc.filename or "").resolve() == path:
        return Span(str(path), exc.lineno, exc.offset or 1)
    if frames:
        f = frames[-1]
        col = (f.colno or 0) + 1
        end = (f.end_colno or 0) + 1 if f.end_lineno == f.lineno and f.end_colno else None
        return Span(str(path), f.lineno, col, f.lineno if end else None, end)
    for file, line in re.findall(r'File "([^"]+)", line (\d+)', str(exc))[::-1]:
        if Path(file).resolve() == path:
            return Span(str(path), int(line), 1)
    return None


def _failing_module(model: torch.nn.Module | None, tb) -> tuple[str, Span | None, int]:
    """The innermost module whose forward was running when the error was raised ('' if none); and the line
    of the innermost model code outside torch's own files it was at, with that frame's depth in `tb`: where a
    model defined in a library (a transformers family the model file imports) is located, deeper than the
    user's `loss_fn` line that called it."""
    if model is None:
        return "", None, -1
    names = {id(m): n for n, m in model.named_modules()}
    found, at, depth = None, None, -1
    summaries = traceback.extract_tb(tb)  # one per frame of walk_tb, in the same order
    for i, (frame, _) in enumerate(traceback.walk_tb(tb)):
        owner = frame.f_locals.get("self")
        if id(owner) in names:
            found = names[id(owner)]
            if not Path(frame.f_code.co_filename).resolve().is_relative_to(_TORCH):
                f = summaries[i]
                at, depth = Span(f.filename, f.lineno, (f.colno or 0) + 1), i
    return found or "", at, depth


_TORCH = Path(torch.__file__).resolve().parent


def _hint(exc: BaseException) -> str:
    text = f"{type(exc).__name__} {exc}"
    if "data-dependent" in text or "DataDependent" in text:
        return ("parc traces on meta tensors, which have shapes but no values: branch on shapes, "
                "or use torch.where / torch.cond instead of `if tensor:`")
    if "device" in text and "meta" in text:
        return "create tensors in forward on the input's device, e.g. torch.arange(T, device=x.device)"
    return "the model must run under torch.export.export(strict=False) on meta tensors"
