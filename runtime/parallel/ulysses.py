"""All-to-all (DeepSpeed-Ulysses) attention over a sequence sharded across cp ranks.

Start here to see what a `torch.ops.parc.ulysses_attention` line of a program compiled with
`context_parallel alltoall` does (passes/context_parallel.py writes it; docs/context-parallel.md).

q, k, v arrive as (…, H, 2c, hs): all heads, this rank's tokens in the load-balanced layout of
runtime/parallel/ring_attention.py. One all-to-all per tensor scatters the heads and gathers the
sequence — rank j gets heads [j·H/cp, (j+1)·H/cp) of every token — the tokens are put in global
order, attention runs whole and unchanged (`F.scaled_dot_product_attention`, its own causal mask), and
one all-to-all brings each rank its tokens back with every head. The backward gathers the output's
gradient the same way, recomputes the attention's probabilities (fp32; a custom op's body runs below
autograd, so the backward is written out) and sends dQ, dK, dV back: 4 all-to-alls forward, 7 backward
(q, k and v are gathered again rather than kept: the gathered tensors are not held from forward to backward).
Needs H divisible by cp. With attention dropout (passes/dropout.py's key) the attention is written out and each
gathered head draws the serial mask of its global head (`_head_keep`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from parc.runtime import eager
from parc.runtime.dropout import Keyed, attention_keys
from parc.runtime.parallel.ops import _note, group, mark_ordered
from parc.runtime.parallel.ring_attention import dropout_backward_args, local_positions


def _order(seq_len: int, cp: int, device) -> Tensor:
    """Global position of each token of the gathered sequence (rank 0's tokens first, then rank 1's…)."""
    return torch.cat([local_positions(seq_len, r, cp) for r in range(cp)]).to(device)


def _heads_to_sequence(x: Tensor, axis: str, phase: str) -> Tensor:
    """(B, H, L, hs) all heads of local tokens → (B, H/cp, cp·L, hs) this rank's heads of every token,
    in global order."""
    g = group(axis)
    cp = dist.get_world_size(g)
    B, H, L, hs = x.shape
    send = x.reshape(B, cp, H // cp, L, hs).transpose(0, 1).contiguous()  # (cp, B, H/cp, L, hs)
    recv = torch.empty_like(send)
    _note("all_to_all", axis, phase)
    dist.all_to_all_single(recv, send, group=g)  # recv[j]: rank j's tokens of this rank's heads
    gathered = recv.permute(1, 2, 0, 3, 4).reshape(B, H // cp, cp * L, hs)
    return gathered[..., torch.argsort(_order(cp * L, cp, x.device)), :]


def _sequence_to_heads(y: Tensor, axis: str, phase: str) -> Tensor:
    """The inverse of `_heads_to_sequence`."""
    g = group(axis)
    cp = dist.get_world_size(g)
    B, Hc, T, hs = y.shape
    L = T // cp
    ranked = y[..., _order(T, cp, y.device), :]  # back to gathered order: rank j's tokens at [j·L, (j+1)·L)
    send = ranked.reshape(B, Hc, cp, L, hs).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H/cp, L, hs)
    recv = torch.empty_like(send)
    _note("all_to_all", axis, phase)
    dist.all_to_all_single(recv, send, group=g)  # recv[j]: head group j of this rank's tokens
    # contiguous, as the ops' fakes say: with one head a rank (Hc 1) the reshape is a view whose B and head
    # strides are swapped, which inductor's stride check refused (`compile inductor`, cp 2 × tp 2, 4 heads)
    return recv.transpose(0, 1).reshape(B, cp * Hc, L, hs).contiguous()


def _head_keep(drop: Keyed | None, shape, axis: str, device) -> Tensor | None:
    """The serial mask's part this rank's gathered heads draw: the heads dim (−3 of the site's (…, H, L, S)
    probabilities), after tp's cut, cut again into cp groups, this rank's the one `_heads_to_sequence` gave it;
    the tokens are in global order, so (L, S) are whole."""
    if drop is None:
        return None
    g = group(axis)
    return drop.keep(shape, device, [len(drop.full) - 3, dist.get_world_size(g), dist.get_rank(g), 1])


def _probabilities(q: Tensor, k: Tensor, scale: float, causal: bool) -> Tensor:
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1)


@eager.custom_op("parc::ulysses_attention")
def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, axis: str, causal: bool, scale: float, parts: int,
                      p: float = 0.0, site: int = 0, full: list[int] | None = None, per_sample: int = 0,
                      shard: list[int] | None = None) -> Tensor:
    """SDPA over a cp-sharded sequence by all-to-all (module docstring). `parts`: the cp degree. `p` > 0:
    attention dropout keyed as passes/dropout.py keys SDPA's (ring_attention's arguments): written out, each
    gathered head's mask the serial one's for that global head."""
    # fp32, as ring attention and this op's backward compute, the output rounded once to q's dtype. The inputs' dtypes
    # may differ: compiled under bf16 autocast (`compile`) HF Llama's q, k arrived fp32 beside a bf16 v,
    # and autocast does not reach into a custom op's body to cast them alike for SDPA
    drop = attention_keys(p, site, full, per_sample, shard)
    whole = [_heads_to_sequence(t, axis, "fwd").float() for t in (q, k, v)]
    if drop is None:
        out = F.scaled_dot_product_attention(*whole, is_causal=causal, scale=scale)
    else:  # SDPA's kernels draw their own mask: softmax, the keyed mask, @ v, as runtime/dropout.py's keyed_attention
        probs = _probabilities(whole[0], whole[1], scale, causal)
        out = drop.apply(probs, _head_keep(drop, probs.shape, axis, q.device)) @ whole[2]
    return _sequence_to_heads(out.to(q.dtype), axis, "fwd")


# contiguous, as the op returns them (`_sequence_to_heads` reshapes a transposed buffer): a compiled graph plans the
# views after the op from these strides
ulysses_attention.register_fake(
    lambda q, k, v, axis, causal, scale, parts, *dropout: torch.empty_like(q, memory_format=torch.contiguous_format))


@eager.custom_op("parc::bwd_ulysses_attention")
def bwd_ulysses_attention(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, axis: str, causal: bool,
                          scale: float, p: float = 0.0, site: int = 0, full: list[int] | None = None,
                          per_sample: int = 0, shard: list[int] | None = None,
                          key: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The backward: the attention recomputed on the gathered heads (written out: a custom op's body runs
    below autograd), its gradients sent back to the ranks holding their tokens. With attention dropout the
    forward's mask is drawn again (`key`: the forward's; None under `compile`, read when this runs):
    dV = (P·M)ᵀ dO, dP = (dO Vᵀ)·M, M = keep / (1 − p)."""
    drop = attention_keys(p, site, full, per_sample, shard, key)
    qg, kg, vg = (_heads_to_sequence(t, axis, "bwd").float() for t in (q, k, v))
    g = _heads_to_sequence(grad, axis, "bwd").float()
    probs = _probabilities(qg, kg, scale, causal)
    dp = g @ vg.transpose(-1, -2)
    keep = _head_keep(drop, probs.shape, axis, q.device)
    dropped = probs
    if keep is not None:
        dp, dropped = drop.apply(dp, keep), drop.apply(probs, keep)
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True)) * scale
    grads = (ds @ kg, ds.transpose(-1, -2) @ qg, dropped.transpose(-1, -2) @ g)  # dQ, dK, dV
    return tuple(_sequence_to_heads(d.to(t.dtype), axis, "bwd") for d, t in zip(grads, (q, k, v)))


@bwd_ulysses_attention.register_fake
def _(grad, q, k, v, axis, causal, scale, *dropout):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, axis, causal, scale, _, *dropout = inputs
    ctx.save_for_backward(q, k, v)
    ctx.args = (axis, causal, scale, *dropout_backward_args(dropout, q))
    ctx.inputs = len(inputs)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = eager.call("parc::bwd_ulysses_attention", grad, q, k, v, *ctx.args)
    return dq, dk, dv, *[None] * (ctx.inputs - 3)


eager.register_autograd(ulysses_attention, _backward, setup_context=_setup)
for _op in (ulysses_attention, bwd_ulysses_attention):
    mark_ordered(_op)
