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

A dtype's extreme the model read from a value (`torch.finfo(h.dtype).min`, the mask fill of most attention
code) traced as float32's, ±3.4028e38, a number bf16 (largest 3.3895e38) and fp16 (65504) cannot hold: under
bf16 `masked_fill`, `fill`, `clamp`, `full_like`, `index_fill` and `scatter` of a bf16 tensor stop at step 0
(`value cannot be converted to type c10::BFloat16 without overflow`, doge's dynamic mask), and arithmetic
and `where` round it to -inf where the eager model has a finite value (a fully masked row's softmax is
then nan, not uniform). `extremes`, run on each program after zero (so no other pass sees it), puts back
what the eager model computes: each float32 extreme among an op's scalars becomes
`torch.finfo(x.dtype).min` (or `.max`) of the op's first floating tensor operand `x`, read at run time.
Where `x` is bf16 that is bf16's extreme, as in the serial bf16 run (whose finfo reads a bf16 value);
where the model kept `x` in fp32 it is the traced number itself. An op whose result dtype the trace pinned
(`dtype=torch.float32`) stores the traced number in fp32, representable, and is left as it is. A literal
out of the compute dtype's range that is not float32's extreme (`-1e9` under fp16) is left too: the eager
model overflows on it as well.

A norm whose input the model cast to its weight's dtype (`norm(x.to(norm.weight.dtype))`, transformers' hy_v4 on
a module it keeps in fp32) traced the cast as `.to(torch.float32)`, so under bf16 the norm gets an fp32 input
with bf16 weight copies and stops at step 0 (`mixed dtype (CPU): expect parameter to have scalar type of
Float`). `norm_operands`, run on each program after `extremes`, casts each norm's weight and bias
(`NORM_WEIGHTS`) to its input's dtype read at run time: where the input is bf16 that is no cast at all (the
same tensor), where the model made it fp32 the norm runs in fp32, autocast's "promote" as for opaque ops
above, never less precise than the eager bf16 model (which rounds the input to bf16 and runs the norm there).

Assumes: the traced whole graph (before tensor_parallel, which keeps these nodes as they are); `extremes`:
one program's graph after pipeline_split and zero, before recompute (which moves the new nodes into a
region with the op they feed).
Guarantees: under bf16 no `_assert_tensor_metadata` of a floating tensor names a dtype, no device
move of a floating tensor casts it, and every floating tensor operand of an opaque op is float32; every
other node is untouched; after `norm_operands`, every norm's weight and bias have its input's dtype; after
`extremes`, no op scalar is float32's extreme where a floating tensor operand
decides its dtype. Rewrites counted per node changed.
"""

from __future__ import annotations

import builtins

import torch
import torch.fx as fx

from parc.runtime.precision import compute_dtype

aten = torch.ops.aten
NAME = "precision"
EXTREMES = "precision_extremes"  # `extremes`' rewrites, counted apart (it runs per program, after zero)
NORMS = "precision_norms"  # `norm_operands`' rewrites, counted apart (it runs per program, after zero)
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


def extremes(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    """Each float32 extreme among an op's scalars read from its operand's dtype at run time (module docstring)."""
    if compute_dtype(plan.precision) is None:
        return gm
    changed = 0
    for node in list(gm.graph.nodes):
        x = _extreme_owner(node)
        if x is None:
            continue
        dtype = _dtype_of(gm, x, node)
        with gm.graph.inserting_before(node):
            info = gm.graph.call_function(torch.finfo, (dtype,))
            ends = {which: gm.graph.call_function(builtins.getattr, (info, which)) for which in ("min", "max")}
        for made, val in ((info, torch.finfo(torch.float32)), (ends["min"], -_F32_MAX), (ends["max"], _F32_MAX)):
            made.meta = {"val": val, "nn_module_stack": node.meta.get("nn_module_stack")}

        def end(a):
            return ends["max" if a > 0 else "min"] if _is_extreme(a) else a

        node.args = tuple(end(a) for a in node.args)
        node.kwargs = {k: end(v) for k, v in node.kwargs.items()}
        for which in [w for w, n in ends.items() if not n.users]:
            gm.graph.erase_node(ends[which])
        changed += 1
    if changed:
        ctx.count(EXTREMES, changed)
        gm.recompile()
    return gm


_F32_MAX = torch.finfo(torch.float32).max


def _dtype_of(gm: fx.GraphModule, x: fx.Node, node: fx.Node) -> fx.Node:
    """A node before `node` reading `x.dtype` at run time (traced: float32), in `node`'s module."""
    with gm.graph.inserting_before(node):
        dtype = gm.graph.call_function(builtins.getattr, (x, "dtype"))
    dtype.meta = {"val": torch.float32, "nn_module_stack": node.meta.get("nn_module_stack")}
    return dtype


# A norm's weight operands, by position: a norm that runs on a tensor and weights of two dtypes stops at step 0
# (`mixed dtype (CPU): expect parameter to have scalar type of Float`); see `norm_operands`.
NORM_WEIGHTS = {
    aten.layer_norm.default: (2, 3),         # (input, normalized_shape, weight, bias, eps, cudnn_enable)
    aten.native_layer_norm.default: (2, 3),  # (input, normalized_shape, weight, bias, eps)
    aten.rms_norm.default: (2,),             # (input, normalized_shape, weight, eps)
    aten.group_norm.default: (2, 3),         # (input, num_groups, weight, bias, eps, cudnn_enabled)
    aten.native_group_norm.default: (1, 2),  # (input, weight, bias, N, C, HxW, group, eps)
}


def norm_operands(gm: fx.GraphModule, plan, ctx) -> fx.GraphModule:
    """Each norm's weight and bias take its input's dtype at run time (module docstring)."""
    if compute_dtype(plan.precision) is None:
        return gm
    changed = 0
    for node in list(gm.graph.nodes):
        x = node.args[0] if node.op == "call_function" and node.target in NORM_WEIGHTS and node.args else None
        if not isinstance(x, fx.Node) or not getattr(x.meta.get("val"), "dtype", torch.int64).is_floating_point:
            continue
        slots = [i for i in NORM_WEIGHTS[node.target] if i < len(node.args) and isinstance(node.args[i], fx.Node)]
        if not slots:
            continue
        dtype = _dtype_of(gm, x, node)
        with gm.graph.inserting_before(node):
            args = list(node.args)
            for i in slots:
                w = args[i]
                args[i] = gm.graph.call_function(aten.to.dtype, (w, dtype))  # the same tensor where dtypes agree
                args[i].meta = {**w.meta, "nn_module_stack": node.meta.get("nn_module_stack")}
        node.args = tuple(args)
        changed += 1
    if changed:
        ctx.count(NORMS, changed)
        gm.recompile()
    return gm




def _is_extreme(a) -> bool:
    return isinstance(a, float) and abs(a) == _F32_MAX


def _extreme_owner(node: fx.Node) -> fx.Node | None:
    """The floating tensor operand whose dtype `node`'s float32-extreme scalars should follow, or None: no such
    scalar, no floating operand, or a result dtype the trace pinned."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if not any(_is_extreme(a) for a in (*node.args, *node.kwargs.values())):
        return None
    pinned = node.kwargs.get("dtype")
    if pinned is not None and pinned.is_floating_point:
        return None
    return next((a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)
                 and getattr(a.meta.get("val"), "dtype", torch.int64).is_floating_point), None)


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
