"""Sharding rules for normalisations: LayerNorm and RMSNorm, over sharded and unsharded dims (used by
passes/tp_layouts.py's dispatcher, like passes/tp_contract.py's rules).

Start at `RULES`. A norm over dims that do not include the sharded one runs on each shard as it is
(per-head q/k norms on head-sharded values; a norm over the hidden of a sequence slice): its output
is sharded like its input, and its replicated weight and bias get a Partial gradient, which
passes/tp_grads.py completes.

A norm *over* the sharded dim (OLMo 2's q/k norms over the full projected width; any LayerNorm on a
column layer's output) has no local answer: every element depends on statistics over the whole
dim. The rule is Megatron's: each rank computes its shard's partial sums, all-reduced over tp
(`parc.allreduce_identity`, g), in the order the serial op computes them:

    LayerNorm:  mean = Σx / N;   var = Σ(x − mean)² / N   (two passes, never E[x²] − E[x]²)
                y = (x − mean) · rsqrt(var + eps) · w + b
    RMSNorm:    ms = Σx² / N;    y = x · rsqrt(ms + eps) · w

N is the full count of normalised elements. The statistics are computed in float32, as the fused
kernels accumulate (and as autocast runs them under bf16). The weight and bias, replicated
parameters of the normalised shape, keep this rank's chunk (`parc.split_allgather`: slice forward,
all-gather of the gradient backward), so their gradient is whole on every rank.

Gradients: the replicated statistics (mean, rstd) meet the sharded x in an op with a sharded
output, so their gradient on each rank is only its slice's share: passes/tp_grads.py sees those
edges after the walk and puts Megatron's f before them, which sums the shares; g's identity
backward then hands every rank's partial sum the full gradient. So the backward is exact with no
rule-specific code, and tp_grads' proof covers it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from parc.passes.tp_contract import _insert
from parc.passes.tp_shard import Shard, shape

aten = torch.ops.aten
parc_ops = torch.ops.parc


def layer_norm(lay, node: fx.Node):
    """aten.layer_norm(x, normalized_shape, weight, bias, eps, cudnn_enable)."""
    x, normalized = node.args[0], list(node.args[1])
    w, b = _arg(node, 2, "weight"), _arg(node, 3, "bias")
    eps = _arg(node, 4, "eps", 1e-5)
    s = _sharded_dims(lay, node, x, normalized, (w, b))
    if s is None:
        return lay.get(x)
    y = _decompose(lay, node, x, normalized, s, w, b, eps, rms=False)
    _replace(lay, node, y)
    return s


def native_layer_norm(lay, node: fx.Node):
    """aten.native_layer_norm(x, normalized_shape, weight, bias, eps) → (y, mean, rstd); mean and rstd
    have x's shape with the normalised dims kept as 1."""
    x, normalized = node.args[0], list(node.args[1])
    w, b, eps = node.args[2], node.args[3], node.args[4]
    s = _sharded_dims(lay, node, x, normalized, (w, b))
    if s is None:
        s = lay.get(x)
        return [s, s, s]  # the statistics keep every dim outside the normalised ones, the sharded one too
    y, mean, rstd = _decompose(lay, node, x, normalized, s, w, b, eps, rms=False, stats=True)
    for u in list(node.users):  # getitem(node, i): the decomposed value i
        u.replace_all_uses_with((y, mean, rstd)[u.args[1]])
    node.args = (x, normalized, None, None, eps)  # now dead: no longer a use of w and b
    return [s, None, None]


def rms_norm(lay, node: fx.Node):
    """aten.rms_norm(x, normalized_shape, weight, eps); eps None is float32's machine epsilon, as the
    op takes it for float32 (and for bf16, whose statistics it accumulates in float32)."""
    x, normalized = node.args[0], list(node.args[1])
    w = _arg(node, 2, "weight")
    eps = _arg(node, 3, "eps")
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    s = _sharded_dims(lay, node, x, normalized, (w,))
    if s is None:
        return lay.get(x)
    y = _decompose(lay, node, x, normalized, s, w, None, eps, rms=True)
    _replace(lay, node, y)
    return s


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _sharded_dims(lay, node: fx.Node, x, normalized: list[int], params) -> Shard | None:
    """x's shard when the norm reduces over it (None when it does not); refuses what has no exact form."""
    s = lay.get(x)
    if any(lay.get(p) is not None for p in params if isinstance(p, fx.Node)):
        lay.fail(node, "sharded norm parameters (parc shards only linear weights and embedding tables)", s)
    if s is None or s.dim < len(shape(x)) - len(normalized):
        return None
    if s.blocks != 1:
        lay.fail(node, f"it normalizes over a fused output of {s.blocks} blocks before it is split", s)
    return s


def _decompose(lay, node, x, normalized, s: Shard, w, b, eps, rms: bool, stats: bool = False):
    """The norm of sharded `x` over its last len(normalized) dims, written with sums over tp (module
    docstring). Returns y, or (y, mean, rstd) with `stats`."""
    full = shape(x)
    dims = list(range(len(full) - len(normalized), len(full)))
    count = 1
    for d in dims:
        count *= full[d]
    kept = [1 if d in dims else n for d, n in enumerate(full)]

    def make(op, args, layout, size):
        return _insert(lay, node, op, args, torch.empty(size, dtype=torch.float32, device="meta"), layout)

    def total(v):  # Σ over the normalised dims of sharded v, then over tp: the full sum on every rank
        part = make(aten.sum.dim_IntList, (v, dims, True), "partial", kept)
        return make(parc_ops.allreduce_identity.default, (part, "tp"), None, kept)

    xf = make(aten.to.dtype, (x, torch.float32), s, full)
    if rms:
        mean = None
        centred = xf
    else:
        mean = make(aten.div.Tensor, (total(xf), count), None, kept)
        centred = make(aten.sub.Tensor, (xf, mean), s, full)
    var = make(aten.div.Tensor, (total(make(aten.mul.Tensor, (centred, centred), s, full)), count), None, kept)
    rstd = make(aten.rsqrt.default, (make(aten.add.Tensor, (var, eps), None, kept),), None, kept)
    y = make(aten.mul.Tensor, (centred, rstd), s, full)
    for p, op in ((w, aten.mul.Tensor), (b, aten.add.Tensor)):
        if isinstance(p, fx.Node):
            y = make(op, (y, p), s, full)
            lay.localize(y, p, s.dim - (len(full) - len(shape(p))), s)  # this rank's chunk of the weight
    return (y, mean, rstd) if stats else y


def _replace(lay, node: fx.Node, y: fx.Node) -> None:
    """Every use of the norm reads the decomposed value; the original node is left dead, with no weight
    or bias, so no gradient edge from a parameter runs through it (dead code elimination removes it)."""
    node.replace_all_uses_with(y)
    node.args = (node.args[0], node.args[1])
    node.kwargs = {}


RULES = {aten.layer_norm.default: layer_norm, aten.native_layer_norm.default: native_layer_norm,
         aten.rms_norm.default: rms_norm}
