"""Programs run eagerly (`compile none`) without the per-call Python cost of `torch.ops`.

Start at `bind`, which `parc.codegen.load_program(..., eager=True)` applies to a program's
syntax tree before it is compiled to bytecode. A generated program calls every op by its
qualified name (`torch.ops.aten.add.Tensor(...)`, `torch.ops.parc.alltoall_alltoall.default(...)`),
which is what makes it readable, and what `torch.compile` traces. Run eagerly, that spelling
costs at each call, on top of the kernel:

- an aten op: the attribute walk `torch.ops.aten.add.Tensor` and `OpOverload.__call__`, a Python
  frame whose whole body is `self._op(*args, **kwargs)`; `bind` calls `_op`, the C++ entry, under
  a module name bound once at load (about 0.35 µs an op, some 300 ops a micro-batch's forward
  of examples/moe.py);
- a parc op with a backward (runtime/parallel/ops.py, expert_parallel.py, dropout.py): torch.library's
  custom-op machinery, a dispatcher round trip and two Python autograd wrappers in each
  direction (about 50 µs a forward and backward more than an autograd.Function, on one CPU
  core; 5% of a micro-batch of examples/moe.py, whose experts call four all-to-alls, and
  their backward called a second custom op each). `bind` calls the op's eager twin
  instead: a `torch.autograd.Function` whose forward is the op's own Python function and whose
  backward is the very function registered with `register_autograd`.

What the twin keeps of a custom op, so that the numbers are the same bits (the tests that
prove the programs against the serial model run them eagerly, through the twins):
- the forward is the same function on the same arguments, run, like the custom op's, with
  autograd not recording (an autograd.Function's forward runs under no_grad);
- with no input needing a gradient, or grad mode off, it calls the function directly and skips
  `setup_context`, as the custom op does (`torch._library.autograd.make_autograd_impl`);
- otherwise `setup_context(ctx, inputs, output)` then the registered `backward(ctx, *grads)`,
  with the same `needs_input_grad` and the default materialized (zero) gradients of unused
  outputs, as the custom op's generated autograd.Function has; the ops that backward calls
  through `call` (the backward collectives) run as their own functions there.
Ops with a tensor-list argument or result (ZeRO-3's `zero_unshard`) keep the custom op: an
autograd.Function does not see tensors inside a list, so the backward would never run.

Under `compile inductor | aot_eager` none of this runs: the program text is loaded as written,
dynamo traces the custom ops through their fake implementations (runtime/compiled.py), and a
backward formula's `call` returns the custom op, since no twin's backward is running.
"""

from __future__ import annotations

import ast
import threading
from typing import Callable

import torch
from torch._ops import OpOverload

_IMPLS: dict[str, Callable] = {}   # "parc::name" → the op's Python function
_TWINS: dict[str, Callable] = {}   # "parc::name" → its eager twin


def custom_op(name: str):
    """`torch.library.custom_op(name, mutates_args=())`, keeping the function for the op's eager twin."""
    def wrap(fn):
        _IMPLS[name] = fn
        return torch.library.custom_op(name, mutates_args=())(fn)
    return wrap


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """`op.register_autograd(backward, setup_context=setup_context)`, and the op's eager twin (module docstring)."""
    op.register_autograd(backward, setup_context=setup_context)
    name = op._qualname
    if name not in _IMPLS or _has_tensor_list(op._opoverload._schema):
        return  # no Python function kept (not made by `custom_op` here), or tensors in a list: the custom op stays
    _TWINS[name] = _twin(name, _IMPLS[name], backward, setup_context)


def _has_tensor_list(schema) -> bool:
    return any(str(a.type).startswith("List[") and "Tensor" in str(a.type) for a in (*schema.arguments, *schema.returns))


def call(name: str, *args):
    """The parc op `name` ("parc::alltoall_bwd"), as a backward formula calls the ops it communicates with:
    the custom op, which `compile` traces as an opaque call, except inside an eager twin's backward (with
    grad mode off, as a backward without `create_graph` runs), where the op's own function runs: the same
    function, without the custom op's dispatch (another ~8% of an uncompiled backward of examples/moe.py)."""
    if getattr(_BACKWARD, "on", False) and not torch.is_grad_enabled():
        return _IMPLS[name](*args)
    return getattr(torch.ops.parc, name.split("::", 1)[1])(*args)


_BACKWARD = threading.local()  # .on: an eager twin's backward formula is running on this thread


def _twin(name: str, impl: Callable, backward: Callable, setup_context: Callable) -> Callable:
    def forward(ctx, *args):
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    def eager_backward(ctx, *grads):
        outer, _BACKWARD.on = getattr(_BACKWARD, "on", False), True
        try:
            return backward(ctx, *grads)
        finally:
            _BACKWARD.on = outer

    function = type(f"Eager_{name.replace('::', '_')}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(eager_backward)})

    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function.apply(*args)
        return impl(*args)  # as the custom op without autograd: no graph node, no setup_context

    call.__name__ = call.__qualname__ = f"eager_{name.replace('::', '_')}"
    return call


def twin(name: str) -> Callable | None:
    """The eager twin of the parc op `name` ("parc::alltoall_alltoall"), if it has one."""
    return _TWINS.get(name)


def bind(tree: ast.Module, namespace: dict) -> ast.Module:
    """Rewrite every `torch.ops.<ns>.<op>.<overload>` of `tree` into a module name, bound in `namespace`
    to the parc op's eager twin, else to the aten (or other) overload's `_op`; leave any other callee
    (an overload packet, a higher-order op) as written. Line numbers stay, so tracebacks point at the
    program's own lines."""
    return _Bind(namespace).visit(tree)


class _Bind(ast.NodeTransformer):
    def __init__(self, namespace: dict):
        self.namespace = namespace

    def visit_Attribute(self, node: ast.Attribute):
        parts = _dotted(node)
        if parts is None or len(parts) != 5 or parts[:2] != ["torch", "ops"] or not isinstance(node.ctx, ast.Load):
            return self.generic_visit(node)
        ns, op, overload = parts[2:]
        target = self._target(ns, op, overload)
        if target is None:
            return node
        name = f"_parc_op_{ns}_{op}_{overload}"
        if self.namespace.setdefault(name, target) is not target:
            raise RuntimeError(f"program name {name!r} is taken; cannot bind torch.ops.{ns}.{op}.{overload}")
        return ast.copy_location(ast.Name(id=name, ctx=ast.Load()), node)

    @staticmethod
    def _target(ns: str, op: str, overload: str):
        if ns == "parc" and overload == "default" and f"parc::{op}" in _TWINS:
            return _TWINS[f"parc::{op}"]
        ovl = getattr(getattr(getattr(torch.ops, ns), op), overload)
        # exactly OpOverload, whose __call__ is `return self._op(*args, **kwargs)`; subclasses may do more
        return getattr(ovl, "_op", None) if type(ovl) is OpOverload else None


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything but a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]
