"""Sharded channels that are concatenated, mixed per channel and split again (used by
passes/tp_layouts.py's dispatcher): Qwen3-Next's and Qwen3.5's linear attention writes
`cat((q, k, v), -1)` of head-sharded projections, a depthwise causal `conv1d` over the channels,
and a `split` back into q, k and v by their global widths.

Start at `cat`. A value sharded along dim d in blocks (`Shard.blocks`: this rank holds chunk
`tp_rank` of each block, concatenated) is what a fused column layer makes; a cat of sharded
operands along d is the same thing: each operand's blocks, one after the other, and locally the
cat of the local pieces. So the cat is `Shard(d, blocks = the operands' block widths)` with no
rewrite, a later `split` by the global widths becomes a split by the per-rank widths
(tp_layouts `_split`), and a per-channel op sees this rank's chunk of every block:

- `conv1d` with groups == channels (depthwise, weight (C, 1, K)) on channel-sharded input: each
  group is one channel, so each rank convolves its own channels with their own filters. The weight
  and bias are replicated parameters (no rule names them) and keep this rank's chunk of each block
  (`parc.split_allgather`: slice forward, all-gather of the gradient backward: the gradient is whole
  on every rank). `groups` becomes the local channel count. Exact: no sum crosses a channel.

`repeat_interleave` with an int count along the sharded dim repeats each rank's own elements: the same op
on the local value.

A cat with a replicated operand along d keeps that operand's chunk as one more block. Any other
conv (channels mixed across groups) on sharded channels is refused.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from parc.passes.tp_contract import _insert
from parc.passes.tp_shard import Shard, shape
from parc.runtime.checkpoint.state import block_sizes

aten = torch.ops.aten
parc_ops = torch.ops.parc


def cat(lay, node: fx.Node, dim: int):
    """`cat` along the sharded dim `dim`: the operands' blocks concatenated (module docstring)."""
    tensors = list(node.args[0])
    shards = [lay.get(a) for a in tensors]
    ref = next(s for s in shards if s is not None)
    if any(s is not None and (s.dim != dim or s.seq) for s in shards) or ref.seq:
        lay.fail(node, f"it concatenates along dim {dim} values sharded differently: {shards}", ref)
    widths: list[int] = []
    for a, s in zip(tensors, shards):
        if s is None:  # a replicated operand: this rank's chunk of it, as one more block
            lay.localize(node, a, dim, ref)
            widths.append(shape(a)[dim])
        else:
            widths += block_sizes(shape(a)[dim], s.blocks)
    blocks = len(widths) if len(set(widths)) == 1 else tuple(widths)
    return Shard(dim, 1 if len(widths) == 1 else blocks, False, ref.rule)


def conv1d(lay, node: fx.Node):
    """aten.conv1d(x, weight, bias, stride, padding, dilation, groups) with x (B, C, L) sharded on C."""
    x, w = node.args[0], node.args[1]
    s = lay.get(x)
    b = node.args[2] if len(node.args) > 2 else None
    groups = node.args[6] if len(node.args) > 6 else 1
    channels = shape(x)[1] if len(shape(x)) == 3 else -1
    if s is None or lay.get(w) is not None or (isinstance(b, fx.Node) and lay.get(b) is not None):
        lay.fail(node, "a convolution with a sharded weight or bias", s or lay.get(w))
    if s.dim != 1 or s.seq:
        lay.fail(node, f"a convolution of a value sharded on dim {s.dim}, not on its channels (dim 1)", s)
    if groups != channels or shape(w)[0] != channels or shape(w)[1] != 1:
        lay.fail(node, f"a convolution that mixes channels (groups {groups}, {channels} channels, weight "
                 f"{shape(w)}): parc shards only depthwise ones (groups == channels) on sharded channels", s)
    keep_chunks(lay, node, w, 0, s)
    if isinstance(b, fx.Node):
        keep_chunks(lay, node, b, 0, s)
    node.args = (*node.args[:6], channels // lay.tp)  # every block divides by tp, so the local channels do
    return Shard(1, s.blocks, False, s.rule)


def keep_chunks(lay, node: fx.Node, a: fx.Node, d: int, s: Shard) -> None:
    """Replicated `a` used by `node` beside a value sharded like `s` along `a`'s dim `d`: this rank's chunk
    of each of s's blocks (one `parc.split_allgather` per block, concatenated)."""
    if s.blocks == 1:
        return lay.localize(node, a, d, s)
    sizes = block_sizes(shape(a)[d], s.blocks)
    val = a.meta["val"]
    parts = _insert(lay, node, aten.split_with_sizes.default, (a, sizes, d),
                    [val.narrow(d, 0, k) for k in sizes], None)
    chunks = []
    for i, k in enumerate(sizes):
        piece = _insert(lay, node, operator.getitem, (parts, i), val.narrow(d, 0, k), None)
        lay.localize(node, piece, d, Shard(d, 1, s.seq, s.rule))  # inserts the split_allgather before node
        chunks.append(next(u for u in piece.users if u.target is parc_ops.split_allgather.default))
    whole = _insert(lay, node, aten.cat.default, (chunks, d), val, Shard(d, s.blocks, s.seq, s.rule))
    node.replace_input_with(a, whole)


def repeat_interleave(lay, node: fx.Node):
    """`x.repeat_interleave(r, dim)` with an int r (Qwen3-Next repeating q and k heads to v's count): each
    element repeated r times in place, so along the sharded dim this rank's chunk of the output is its own
    chunk of x, repeated: the same op on the local value (an `output_size` made local)."""
    s = lay.get(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        lay.fail(node, "repeat_interleave without a dim flattens the sharded value", s)
    if dim % len(shape(node)) != s.dim:
        return s
    if s.blocks != 1:
        lay.fail(node, f"repeat_interleave of a fused output of {s.blocks} blocks along its sharded dim", s)
    if node.kwargs.get("output_size") is not None:
        node.kwargs = {**node.kwargs, "output_size": node.kwargs["output_size"] // (s.parts or lay.tp)}
    return s


RULES = {aten.conv1d.default: conv1d, aten.repeat_interleave.self_int: repeat_interleave}
