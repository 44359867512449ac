"""Backward behaviour torch.export would drop: refused at compile, located, never replaced silently.

Start here: parc/trace.py wraps its export in `guarded(model, user_path)`. parc trains the
program's backward as autograd of the traced forward. That is the model's backward
unless the model changes its backward by hand, and torch.export (strict=False)
keeps none of the ways it can:

- a custom `torch.autograd.Function`: export inlines its `forward`; its `backward`
  (a straight-through estimator's identity, say) is lost, and the program would
  train with autograd of the forward instead;
- `Tensor.register_hook` in forward: the hook is not in the graph;
- module backward hooks (`register_full_backward_hook`, `register_backward_hook`,
  `register_full_backward_pre_hook`, the global `register_module_*` ones) and hooks
  on parameters (`p.register_hook`, `register_post_accumulate_grad_hook`): parc's
  runtime makes its own parameter tensors and never runs the module's forward.

Nor does it keep these, which `_BackwardGuard` refuses at the call:

- a gradient taken inside forward: `torch.autograd.grad(..., create_graph=False)` is a
  constant in eager (no graph), but its traced ops are differentiated like any others, so
  the gradient would flow through it; `Tensor.backward` / `torch.autograd.backward`
  accumulate into `.grad` outside the loss, which the program never does;
- a custom op with no registered autograd applied to a tensor that requires grad: the
  program's first backward would raise, so compile does;
- `torch.utils.checkpoint(..., use_reentrant=True)`: export traces its Function's forward
  under no_grad, so no gradient would flow through the region.

`x.data` of a tensor that requires grad, used as a value, makes export fail later with no
location ("a fake tensor in the exported program constant's list"): that failure is refused at
the first `.data` the model read (its shape alone traces, and is let through).

Each is refused with a TraceError: `.apply` and `register_hook` at the call (the
frame that made it, file:line:col), a registered hook at the hook function's `def`.
What export keeps as eager runs it is let through: non-reentrant checkpointing, `no_grad` /
`enable_grad` / `inference_mode` regions, `detach_`, `requires_grad_`, `retain_grad`,
`torch.compiler.disable`d and `torch.jit.script`ed functions. For what no list names,
parc/grad_probe.py compares the traced program's gradients with eager's at compile.
Functions torch defines itself are let through (a custom op's backward is one,
below). Only with grad on and a tensor argument that requires grad: under `torch.no_grad()`
the backward never runs, and neither does a Function's on inputs without grad.
The sound way to give an op its own backward is a custom op, which export keeps as
one node and parc carries, backward and all (docs/model-convention.md):
`torch.library.custom_op` with `register_fake` and `register_autograd`.

Assumes tracing runs in this thread and nothing else applies Functions meanwhile.
Guarantees: inside `guarded`, `Function.apply` and `Tensor.register_hook` are wrapped
(restored on exit, also on error); outside it torch is untouched.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.autograd.function import Function
from torch.overrides import TorchFunctionMode

from parc.errors import Span, TraceError

_CUSTOM_OP_HINT = ("give the op its own backward as a custom op, which torch.export keeps as one node and parc "
                   "carries with its backward: `@torch.library.custom_op(\"mylib::op\", mutates_args=())`, then "
                   "`op.register_fake(...)` and `op.register_autograd(backward, setup_context=...)` "
                   "(docs/model-convention.md, \"Custom backward\")")
_TORCH = Path(torch.__file__).resolve().parent
_ROOT = Path(__file__).resolve().parent.parent
_PARC = tuple(_ROOT / d for d in ("parc", "passes", "runtime", "grammar"))  # parc's own code, not its tests


@contextlib.contextmanager
def guarded(model: torch.nn.Module, user_path: Path):
    """Refuse hand-made backward behaviour while `model` is exported (module docstring)."""
    check_hooks(model)
    names = {id(m): n for n, m in model.named_modules()}
    apply, register_hook = Function.__dict__["apply"], torch.Tensor.register_hook

    def guarded_apply(cls, *args, **kwargs):
        if torch.is_grad_enabled() and cls.__name__ == "CheckpointFunction" and _needs_grad(args, kwargs):
            raise TraceError(f"`torch.utils.checkpoint(..., use_reentrant=True)`{running_module(names)}: torch.export "
                             f"traces the region's forward under no_grad, so no gradient would flow through it",
                             _caller_span(), hint="pass use_reentrant=False (export keeps it exactly), or drop the "
                                                  "checkpoint and write `recompute` in the plan")
        if torch.is_grad_enabled() and not _torch_own(cls) and _needs_grad(args, kwargs):
            span = _caller_span()
            where = running_module(names)
            raise TraceError(f"custom autograd.Function `{cls.__qualname__}` applied{where}: torch.export inlines its "
                             f"forward, so its backward would not run; parc refuses rather than train autograd of "
                             f"the forward instead", span, hint=_CUSTOM_OP_HINT)
        return apply.__func__(cls, *args, **kwargs)

    def guarded_register_hook(self, hook):
        if torch.is_grad_enabled() and self.requires_grad:
            raise TraceError(f"`Tensor.register_hook` in forward{running_module(names)}: torch.export drops the "
                             f"hook, so the gradient would flow without it", _caller_span(), hint=_CUSTOM_OP_HINT)
        return register_hook(self, hook)

    Function.apply = classmethod(guarded_apply)
    torch.Tensor.register_hook = guarded_register_hook
    guard = _BackwardGuard(names)
    try:
        with guard:
            yield
    except RuntimeError as e:
        if guard.data_reads and "fake tensor in the exported program constant" in str(e):
            span, where = guard.data_reads[0]
            raise TraceError(f"`.data` of a tensor that requires grad, read in forward{where}: it takes the value "
                             f"behind autograd's back, which torch.export cannot trace", span,
                             hint="use `.detach()`: the same values, and traced") from e
        raise
    finally:
        Function.apply = apply
        torch.Tensor.register_hook = register_hook
    check_hooks(model)  # a hook registered while forward ran


_OWN_NAMESPACES = ("aten", "prims", "parc")
_DATA = torch._C.TensorBase.__dict__["data"]  # the `.data` descriptor: its `__get__` reaches __torch_function__
# `.data` used only for its shape traces; used as a value, export fails later, unlocated: that failure is
# located at the first read


class _BackwardGuard(TorchFunctionMode):
    """Refuses, at the user's call, the ops whose traced backward would differ from eager's (module docstring)."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names
        self.data_reads: list[tuple[Span | None, str]] = []  # `.data` read by the model: (where, in which module)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DATA and _needs_grad(args[:1], {}) \
                and _is_user_frame(_past_modes(sys._getframe(1))):
            self.data_reads.append((_caller_span(), running_module(self.names)))
        if torch.is_grad_enabled():
            why = self._why(func, args, kwargs)
            if why is not None:
                message, hint = why
                raise TraceError(message + running_module(self.names), _caller_span(), hint=hint)
        return func(*args, **kwargs)

    @staticmethod
    def _why(func, args, kwargs) -> tuple[str, str] | None:
        if func is torch.autograd.grad and not kwargs.get("create_graph", args[4] if len(args) > 4 else False) \
                and _needs_grad(args[:1], {}):
            return ("`torch.autograd.grad(..., create_graph=False)` in forward: in eager the gradient is a constant, "
                    "but the traced program differentiates the ops that compute it",
                    "pass create_graph=True (and `.detach()` the result if it should be a constant), or compute it "
                    "outside the model")
        if func in (torch.autograd.backward, torch.Tensor.backward):
            return ("`backward()` in forward: it accumulates into `.grad` outside the loss's graph, which the "
                    "traced program never does", "return what it computes as part of the loss instead")
        if isinstance(func, torch._ops.OpOverload) and func.namespace not in _OWN_NAMESPACES \
                and _needs_grad(args, kwargs) and not _has_autograd(func):
            return (f"custom op `{func.namespace}::{func._opname}` has no registered autograd, and a tensor it "
                    f"takes requires grad: the program's first backward would fail", _CUSTOM_OP_HINT)
        return None


def _has_autograd(op: torch._ops.OpOverload) -> bool:
    """Whether backward through `op` runs: a `torch.library.custom_op` with `register_autograd`, an op with an
    Autograd kernel of its own, or one that decomposes (CompositeImplicitAutograd, which export inlines)."""
    from torch._library.custom_ops import OPDEFS
    opdef = OPDEFS.get(f"{op.namespace}::{op._opname}")
    if opdef is not None:
        return opdef._backward_fn is not None
    keys = torch._C.DispatchKey
    return op.has_kernel_for_dispatch_key(keys.Autograd) or \
        op.has_kernel_for_dispatch_key(keys.CompositeImplicitAutograd)


def check_hooks(model: torch.nn.Module) -> None:
    """Refuse backward hooks on the model's modules, its parameters and buffers, or registered globally."""
    mod = torch.nn.modules.module
    found = [("a global module backward hook", h) for h in mod._global_backward_hooks.values()]
    found += [("a global module backward pre-hook", h) for h in mod._global_backward_pre_hooks.values()]
    for name, m in model.named_modules():
        label = f"module `{name}`" if name else "the root module"
        found += [(f"{label}'s backward hook", h) for h in m._backward_hooks.values()]
        found += [(f"{label}'s backward pre-hook", h) for h in m._backward_pre_hooks.values()]
    for name, t in [*model.named_parameters(remove_duplicate=True), *model.named_buffers()]:
        found += [(f"a gradient hook on `{name}`", h) for h in (t._backward_hooks or {}).values()]
        found += [(f"a post-accumulate-grad hook on `{name}`", h)
                  for h in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values()]
    if found:
        what, hook = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise TraceError(f"{what} `{getattr(hook, '__qualname__', type(hook).__name__)}`{more}: parc trains the "
                         f"traced graph, where backward hooks do not run", _def_span(hook),
                         hint="remove the hook; to change an op's gradient, " + _CUSTOM_OP_HINT)


def _torch_own(cls) -> bool:
    """A Function torch defines: a custom op's generated autograd (torch._library.autograd; export keeps the
    op as one node, so its registered backward runs) or torch's own (checkpointing), which export handles."""
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


def _needs_grad(args, kwargs) -> bool:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in leaves)


def _caller_span() -> Span | None:
    """The innermost frame outside torch and parc: the line that called `.apply` / `register_hook`."""
    frame = sys._getframe(1)
    while frame is not None:
        if _is_user_frame(frame):
            return frame_span(frame)
        frame = frame.f_back
    return None


def _past_modes(frame):
    """The frame that made the call a stack of TorchFunctionModes is handling (parc's modes and torch's dispatch
    in between skipped): who read `.data`, say."""
    while frame is not None and (frame.f_code.co_name == "__torch_function__"
                                 or Path(frame.f_code.co_filename).resolve() == _TORCH / "overrides.py"):
        frame = frame.f_back
    return frame


def _is_user_frame(frame) -> bool:
    """The frame runs the user's code (a real file outside torch and parc), not torch's own."""
    if frame is None:
        return False
    path = Path(frame.f_code.co_filename).resolve()
    return path.is_file() and not (path.is_relative_to(_TORCH) or any(path.is_relative_to(p) for p in _PARC))


def frame_span(frame) -> Span:
    """Where `frame` is now: its line, with the running call's columns (the instruction's source position)."""
    path = Path(frame.f_code.co_filename).resolve()
    positions = list(getattr(frame.f_code, "co_positions", lambda: [])())  # Python ≥ 3.11
    at = frame.f_lasti // 2
    line, end_line, col, end_col = positions[at] if 0 <= at < len(positions) else (None,) * 4
    if line is None or col is None:
        return Span(str(path), frame.f_lineno, 1)
    one_line = end_line == line and end_col is not None
    return Span(str(path), line, col + 1, line if one_line else None, end_col + 1 if one_line else None)


def running_module(names: dict[int, str], frame=None) -> str:
    """` in module `blocks.0.act`` for the innermost module of the model whose forward is on the stack
    (from `frame` out, else from the caller's frame)."""
    frame = frame or sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if id(owner) in names and names[id(owner)]:
            return f" in module `{names[id(owner)]}`"
        frame = frame.f_back
    return ""


def _def_span(fn) -> Span | None:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return Span(code.co_filename, code.co_firstlineno, 1) if code is not None else None
