"""Dtype guards under `precision bf16`: the traced program's dtype checks and moves agree with the layout it runs in.

Start at `run`. parc traces in fp32, so torch.export writes every floating value's dtype into the
graph as float32: each `.to(...)` gets a guard `aten._assert_tensor_metadata(x, dtype=torch.float32)`,
and a device-only move `x.to(device)` is recorded as `aten.to.dtype_layout(x, dtype=torch.float32,
device=…)`. Under bf16 (runtime/precision.py) the program's weights are bf16 copies and it runs under
autocast, so those values are bf16 at run time: the guard fails at step 0 (`Tensor dtype mismatch!
Expected: Float, Got: c10::BFloat16`, on any HF model whose RMSNorm upcasts with `.to(torch.float32)`),
and a device move would upcast what the model only meant to move.

Changes (only under bf16; fp32 programs are returned unchanged):
- each `_assert_tensor_metadata` of a floating tensor loses its `dtype` (its device and layout stay
  checked): the policy, not the trace, decides a floating value's dtype;
- each `aten.to.dtype_layout` of a floating tensor whose dtype is the one it was traced with and that
  names a device (what `x.to(device)` traces to) loses its `dtype`, so it moves without casting.

Kept as the model wrote them: casts that name a dtype (`.to(torch.float32)`, `.float()`, `.to(x.device,
torch.float32)`, `.to(other)`), which run as written: an RMSNorm's upcast computes its statistics in
fp32, as it does in the eager bf16 model. A cast the model derives from a value's dtype
(`.to(input_dtype)` at the end of the same RMSNorm) traced as float32 too, and nothing in the graph tells
it from an explicit one, so it also stays fp32: the program then keeps that value in fp32 where the
eager model rounds it to bf16, and autocast rounds it at the next matmul (one rounding later, never
less precise; tests/test_bf16_casts.py holds such models to the serial bf16 run).

- each floating tensor operand of an opaque op (a custom op outside aten/prims/parc: autocast does not
  reach it) is cast to float32 before the op, so the op runs in the dtype it was traced in. Such an op
  cannot be told which of its operands the model meant to follow which (`op(x.to(w.dtype), w)`, as
  transformers' grouped-MoE fallback is called, traces as `op(x.to(torch.float32), w)`), and under bf16
  its operands would otherwise arrive in two dtypes (fp32 from the traced cast, bf16 weights) and fail at
  step 0. Computing the op in fp32 is autocast's own "promote" policy: never less precise than the eager
  bf16 model, at the cost of fp32 copies of its operands (tests/test_bf16_casts.py).

Assumes: the traced whole graph (before tensor_parallel, which keeps these nodes as they are).
Guarantees: under bf16 no `_assert_tensor_metadata` of a floating tensor names a dtype, no device
move of a floating tensor casts it, and every floating tensor operand of an opaque op is float32; every
other node is untouched. Rewrites counted per node changed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.runtime.precision import compute_dtype

aten = torch.ops.aten
NAME = "precision"
AUTOCAST_REACHES = ("aten", "prims", "parc")  # op namespaces autocast (or parc's own runtime) casts for


def run(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    if compute_dtype(plan.precision) is None:
        return gm
    for node in list(gm.graph.nodes):
        if _is_float_guard(node) or _is_device_move(node):
            node.args = node.args[:3]  # `dtype` is the guard's fourth positional argument when not a keyword
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
            ctx.count(NAME)
        elif opaque_float_operands(node):
            _operands_in_fp32(gm, node)
            ctx.count(NAME)
    if ctx.rewrites.get(NAME):
        gm.recompile()
    return gm


def opaque_float_operands(node: fx.Node) -> list[fx.Node]:
    """The floating tensor operands of `node` if it calls an op autocast does not reach, else []."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or op.namespace in AUTOCAST_REACHES:
        return []
    operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    return [a for a in operands if getattr(a.meta.get("val"), "dtype", torch.int64).is_floating_point]


def _operands_in_fp32(gm: fx.GraphModule, node: fx.Node) -> None:
    for operand in dict.fromkeys(opaque_float_operands(node)):
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(aten._to_copy.default, (operand,), {"dtype": torch.float32})
        cast.meta = dict(operand.meta)
        node.replace_input_with(operand, cast)


def float_guards(gm: fx.GraphModule) -> list[fx.Node]:
    """The dtype guards and dtype-pinning device moves of floating tensors left in `gm` (none after `run` under bf16)."""
    return [n for n in gm.graph.nodes if _is_float_guard(n) or _is_device_move(n)]


def _is_float_guard(node: fx.Node) -> bool:
    if node.target is not aten._assert_tensor_metadata.default:
        return False
    dtype = node.kwargs.get("dtype", node.args[3] if len(node.args) > 3 else None)
    return dtype is not None and dtype.is_floating_point


def _is_device_move(node: fx.Node) -> bool:
    if node.target is not aten.to.dtype_layout or node.kwargs.get("device") is None:
        return False
    dtype, x = node.kwargs.get("dtype"), node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return dtype is not None and dtype.is_floating_point and val is not None and val.dtype == dtype
