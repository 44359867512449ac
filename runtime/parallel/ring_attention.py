"""Context parallelism's runtime: the sequence layout over cp ranks and ring attention.

Start here to see what the `torch.ops.parc.cp_*` and `torch.ops.parc.ring_attention` lines of a program
compiled with `mesh … cp=N` do (passes/context_parallel.py writes them; docs/context-parallel.md).

Layout (Megatron-Core's causal load balancing). The sequence of T tokens is cut into 2·cp chunks of
c = T / (2·cp); cp rank r holds chunks r and 2·cp−1−r, in that order, as one local sequence of 2c tokens.
Under a causal mask chunk j attends to chunks 0..j, so every rank gets the same number of (query, key)
chunk pairs to compute: rank r's chunks r and 2cp−1−r see r+1 and 2cp−r chunks, 2cp+1 in all.

Ring attention. Each rank keeps its queries; the key/value blocks travel around the cp ring (rank r
sends to r+1, receives from r−1), cp−1 hops, the next hop posted before the current block is computed
so the two overlap. Each (query chunk, key chunk) pair is skipped when the key chunk lies wholly after
the query chunk (causal), computed without a mask when wholly before, with a triangle on the diagonal:
masks from global positions. The partial results of one query row are merged exactly with the
log-sum-exp of its scores (the online softmax). The backward is a ring too: K and V travel the same
way, and each block's dK/dV sum travels one hop behind them, gathering the other ranks' shares on its way
home to its owner, which kept its own (cp − 1 transfers a block); both transfers overlap a block's compute.

Attention dropout (SDPA's `dropout_p`, keyed by passes/dropout.py): each block draws its part of the serial
model's mask, cut at its global (query chunk, key chunk) (`_block_keep`), and drops its probabilities before
they weigh V; the merge is linear in a block's output, so the result is the serial attention's.

Everything here computes in fp32 (a bf16 input is cast up and the outputs cast back), as SDPA's math
path does on CPU. A block (one chunk pair) runs on CPU as torch's fused flash-attention kernel, which returns
the block's log-sum-exp with its output, and its backward as that kernel's backward given the merged output
and log-sum-exp (FlashAttention's backward needs nothing else). Elsewhere (CUDA, which no test here has run)
it is written out: scores, log-sum-exp, exp, two matmuls. The two are the same arithmetic; the fused one
keeps each tile in cache instead of making five passes over a (c, c) score matrix in memory (profiled on
bench/cp_vs_torch.py at T = 2048, cp 2: the written-out blocks were 95% of a step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from parc.runtime import eager
from parc.runtime.dropout import Keyed, attention_keys, current_key
from parc.runtime.parallel.ops import _note, group, mark_ordered


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two global chunks cp rank `rank` holds under causal load balancing."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, rank: int, cp: int) -> Tensor:
    """The global positions of rank `rank`'s local tokens, in local order (int64, length seq_len / cp)."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp)])


def _rank(axis: str) -> tuple[int, int]:
    g = group(axis)
    return dist.get_rank(g), dist.get_world_size(g)


# --- the sequence layout, as ops -------------------------------------------------------------------

@eager.custom_op("parc::cp_shard")
def cp_shard(x: Tensor, axis: str, dim: int, parts: int) -> Tensor:
    """A batch input entering the program: this cp rank's two chunks of `x` along `dim` (the sequence).
    No communication; batch inputs carry no gradient."""
    r, cp = _rank(axis)
    chunks = x.chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in chunk_ids(r, cp)], dim).contiguous()


@cp_shard.register_fake
def _(x, axis, dim, parts):
    shape = list(x.shape)
    shape[dim] //= parts
    return x.new_empty(shape)


@eager.custom_op("parc::cp_positions")
def cp_positions(like: Tensor, seq_len: int, axis: str, parts: int) -> Tensor:
    """`arange(seq_len)` of the serial model, as this cp rank sees it: the global positions of its local
    tokens (`like` only gives the device)."""
    r, cp = _rank(axis)
    return local_positions(seq_len, r, cp).to(like.device)


@cp_positions.register_fake
def _(like, seq_len, axis, parts):
    return like.new_empty((seq_len // parts,), dtype=torch.int64)


@eager.custom_op("parc::cp_sum")
def cp_sum(x: Tensor, axis: str) -> Tensor:
    """A loss's partial sum over this rank's tokens. Forward: all-reduce (sum) over `axis`, so every cp
    rank holds the micro-batch's whole sum. Backward: identity: the one (replicated) sum's gradient
    reaches every rank's share once; parameter gradients are then summed over cp (runtime/train.py)."""
    _note("all_reduce", axis, "fwd")
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group(axis))
    return out


cp_sum.register_fake(lambda x, axis: torch.empty_like(x, memory_format=torch.contiguous_format))
eager.register_autograd(cp_sum, lambda ctx, g: (g, None), setup_context=lambda ctx, inputs, output: None)


# --- ring attention ----------------------------------------------------------------------------------

class _Ring:
    """Point-to-point exchange with the ring neighbours of this rank's `axis` group."""

    def __init__(self, axis: str, phase: str):
        self.group = group(axis)
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        self.axis, self.phase = axis, phase

    def start(self, tensors: list[Tensor]):
        """Post the sends of `tensors` to the next rank and the receives of their like from the previous."""
        _note("ring_send", self.axis, self.phase)
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous, as gloo needs
        reqs = [dist.isend(t.contiguous(), self.next, group=self.group) for t in tensors]
        reqs += [dist.irecv(o, self.prev, group=self.group) for o in out]
        return out, reqs

    @staticmethod
    def finish(reqs) -> None:
        for q in reqs:
            q.wait()


def _pairs(causal: bool, q_chunks, k_chunks):
    """(query half, key half, "full" | "diag") of every chunk pair a block computes; causal skips the
    pairs whose key chunk lies after the query chunk."""
    for a, qa in enumerate(q_chunks):
        for b, kb in enumerate(k_chunks):
            if not causal or kb < qa:
                yield a, b, "full"
            elif kb == qa:
                yield a, b, "diag"


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    return x.chunk(2, dim=-2)


FUSED_ON_CPU = True  # tests turn it off to hold the written-out blocks (the CUDA path) to SDPA as well


def _fused(q: Tensor, drop: Keyed | None = None) -> bool:
    """Whether a block runs as torch's fused CPU flash-attention kernel: on CPU, for (B, H, T, hs) blocks,
    without attention dropout (the kernel draws its own mask, or none; it cannot take the keyed one)."""
    return FUSED_ON_CPU and drop is None and q.device.type == "cpu" and q.dim() == 4


def _block_keep(drop: Keyed | None, shape, q_chunk: int, k_chunk: int, cp: int, device) -> Tensor | None:
    """The serial mask's block of query chunk `q_chunk` × key chunk `k_chunk` (global chunks of 2·cp): the
    (L, S) dims of the site's (…, L, S) probabilities each cut into 2·cp chunks (runtime/dropout.py records)."""
    if drop is None:
        return None
    n = len(drop.full)
    return drop.keep(shape, device, [n - 2, 2 * cp, q_chunk, 1, n - 1, 2 * cp, k_chunk, 1])


def _block_forward(q, k, v, scale, kind, keep: Tensor | None = None, drop: Keyed | None = None):
    """Log-sum-exp per row and the softmax-weighted values of one chunk pair (fp32); "diag": causal
    within the pair (a square block: query i sees keys 0..i). With `keep` (attention dropout), the block's
    probabilities are dropped before they weigh the values: exp(s − lse_b) · keep / (1 − p) @ v. The merge
    rescales a block's output by exp(lse_b − lse), linear, so the merged output is dropout(softmax) @ V: the
    serial attention's, whose mask is applied after the whole row's softmax."""
    if _fused(q, drop):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, kind == "diag",
                                                                                scale=scale)
        return lse, out  # lse (…, c) fp32, as the written-out form's
    s = (q @ k.transpose(-1, -2)) * scale
    if kind == "diag":
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (…, c); finite: a causal diagonal keeps each row's own key
    probs = torch.exp(s - lse.unsqueeze(-1))
    return lse, (probs if keep is None else drop.apply(probs, keep)) @ v


def _merge(acc, lse_acc, out_b, lse_b):
    """Online softmax: two partial results of the same query rows, merged exactly by their log-sum-exps."""
    if acc is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_acc, lse_b)
    return acc * torch.exp(lse_acc - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(-1), lse


@eager.custom_op("parc::ring_attention")
def ring_attention(q: Tensor, k: Tensor, v: Tensor, axis: str, causal: bool, scale: float, parts: int,
                   p: float = 0.0, site: int = 0, full: list[int] | None = None, per_sample: int = 0,
                   shard: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """SDPA over a sequence sharded across `axis` in the load-balanced layout: q, k, v (…, 2c, hs) local.
    `parts`: the cp degree (the compiler's; the group's size at run time). Returns (out (…, 2c, hs) in q's
    dtype, lse (…, 2c) fp32, kept for the backward). `p` > 0: attention dropout, keyed as passes/dropout.py
    keys SDPA's (`site`, the serial (B, H, T, T) shape `full`, `per_sample`, tp's `shard` records of the
    heads): each block's mask is the serial one's block at its global (query, key) chunks."""
    ring = _Ring(axis, "fwd")
    cp = ring.size
    drop = attention_keys(p, site, full, per_sample, shard)
    qh = _halves(q.float())
    mine = chunk_ids(ring.rank, cp)
    acc, lse = [None, None], [None, None]
    kv = [k.float().contiguous(), v.float().contiguous()]
    for t in range(cp):
        src = (ring.rank - t) % cp  # whose block this rank holds at hop t
        pending = ring.start(kv) if t < cp - 1 else None  # the next hop overlaps this block's compute
        kh, vh = _halves(kv[0]), _halves(kv[1])
        theirs = chunk_ids(src, cp)
        for a, b, kind in _pairs(causal, mine, theirs):
            keep = _block_keep(drop, (*qh[a].shape[:-1], kh[b].shape[-2]), mine[a], theirs[b], cp, q.device)
            lse_b, out_b = _block_forward(qh[a], kh[b], vh[b], scale, kind, keep, drop)
            acc[a], lse[a] = _merge(acc[a], lse[a], out_b, lse_b)
        if pending is not None:
            kv, reqs = pending
            _Ring.finish(reqs)
    return torch.cat(acc, dim=-2).to(q.dtype), torch.cat(lse, dim=-1)


@ring_attention.register_fake
def _(q, k, v, axis, causal, scale, parts, p=0.0, site=0, full=None, per_sample=0, shard=None):
    # contiguous, as the op returns them (`torch.cat`): a compiled graph (`compile`) plans the views after the op
    # from these strides, and q is usually a transposed view
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=torch.float32)


@eager.custom_op("parc::bwd_ring_attention")
def bwd_ring_attention(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, axis: str,
                       causal: bool, scale: float, p: float = 0.0, site: int = 0, full: list[int] | None = None,
                       per_sample: int = 0, shard: list[int] | None = None,
                       key: list[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention's backward (FlashAttention's, block by block). K, V go round the ring as in forward,
    each hop posted before the block computes. The dK, dV of a block are summed on their way to its owner:
    the owner keeps its own share (hop 0); the rank holding the block at hop 1 sends its share on, each
    later one adds its share to the sum the previous rank passed and sends it on, and the rank of the last
    hop sends it home: cp − 1 transfers a block, each rank's own share never leaving it. A sum is awaited
    only after the next block's compute (torch's ring backward orders them the same way, with one transfer
    more: it sends the owner's share round too), so neither transfer waits on an idle rank; the owner's
    full block pair is computed last, while the sums come home.
    With attention dropout each block redraws the forward's mask (`key`: the forward's; None under `compile`,
    read when this runs) and is written out: dV = (P·M)ᵀ dO, dP = (dO Vᵀ)·M, dS = P (dP − rowsum(dO ∘ O)),
    M = keep / (1 − p); rowsum(dO ∘ O) is still Σ_j P_ij dP_ij, O being the dropped output."""
    ring = _Ring(axis, "bwd")
    cp = ring.size
    drop = attention_keys(p, site, full, per_sample, shard, key)
    g32, q32, o32 = grad.float(), q.float(), out.float()
    delta = (g32 * o32).sum(-1)  # (…, 2c): rowsum(dO ∘ O)
    qh, gh, lh, dh, oh = _halves(q32), _halves(g32), lse.chunk(2, dim=-1), delta.chunk(2, dim=-1), _halves(o32)
    dq = [torch.zeros_like(h) for h in qh]
    mine = chunk_ids(ring.rank, cp)

    def blocks(pairs, theirs, kv, dkv) -> None:
        """The pairs' dQ into `dq`, their dK, dV into `dkv`: the shares of the block whose K, V is `kv` and whose
        global chunks are `theirs`."""
        kh, vh, dkh, dvh = _halves(kv[0]), _halves(kv[1]), _halves(dkv[0]), _halves(dkv[1])
        for a, b, kind in pairs:
            if _fused(q32, drop):  # the fused kernel's backward, given the merged output and log-sum-exp
                dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    gh[a], qh[a], kh[b], vh[b], oh[a], lh[a], 0.0, kind == "diag", scale=scale)
                dq[a].add_(dq_b)
                dkh[b].add_(dk_b)
                dvh[b].add_(dv_b)
                continue
            s = (qh[a] @ kh[b].transpose(-1, -2)) * scale
            probs = torch.exp(s - lh[a].unsqueeze(-1))
            if kind == "diag":
                n = probs.shape[-1]
                probs = probs.masked_fill(torch.ones(n, n, dtype=torch.bool, device=probs.device).triu(1), 0.0)
            dp = gh[a] @ vh[b].transpose(-1, -2)
            keep = _block_keep(drop, probs.shape, mine[a], theirs[b], cp, q.device)
            if keep is not None:
                dp = drop.apply(dp, keep)
            dvh[b].add_((probs if keep is None else drop.apply(probs, keep)).transpose(-1, -2) @ gh[a])
            ds = probs * (dp - dh[a].unsqueeze(-1)) * scale
            dq[a].add_(ds @ kh[b])
            dkh[b].add_(ds.transpose(-1, -2) @ qh[a])

    kv = home = [k.float().contiguous(), v.float().contiguous()]
    own = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]  # this rank's share of its own block's dK, dV
    # the own block's pairs: all but one now, while the first K, V hop travels; the last full one after the
    # last hop, while the other ranks' shares of this block travel home (nothing else is left to overlap it)
    first = list(_pairs(causal, mine, mine))
    full_pairs = [pair for pair in first if pair[2] == "full"]
    late = full_pairs[-1:] if cp > 1 and len(first) > 1 else []
    passed = None  # (the sums in flight to this rank, their requests)
    for t in range(cp):
        src = (ring.rank - t) % cp  # whose K, V this rank holds at hop t
        next_kv = ring.start(kv) if t < cp - 1 else None
        if t == 0:  # stays here: the other shares come home to it
            blocks([pair for pair in first if pair not in late], mine, kv, own)
        else:
            dkv = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]  # this rank's share of block src's dK, dV
            theirs = chunk_ids(src, cp)
            blocks(_pairs(causal, mine, theirs), theirs, kv, dkv)
            if passed is not None:  # the ranks of hops 1 … t − 1 have summed their shares of block src
                sums, reqs = passed
                _Ring.finish(reqs)
                dkv[0].add_(sums[0])
                dkv[1].add_(sums[1])
            # on to the next rank, which holds block src at hop t + 1 (after the last hop: its owner); the
            # receive posted with it is the previous rank's sum of the block this rank holds next
            passed = ring.start(dkv)
        if next_kv is not None:
            kv, reqs = next_kv
            _Ring.finish(reqs)
    if late:
        blocks(late, mine, home, own)
    if passed is not None:  # every other rank's share of this rank's block, summed on its way round
        sums, reqs = passed
        _Ring.finish(reqs)
        own[0].add_(sums[0])
        own[1].add_(sums[1])
    dk, dv = own
    return torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@bwd_ring_attention.register_fake
def _(grad, q, k, v, out, lse, axis, causal, scale, *dropout):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))  # as the op returns


def _ring_setup(ctx, inputs, output):
    q, k, v, axis, causal, scale, _, *dropout = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1])
    ctx.args = (axis, causal, scale, *dropout_backward_args(dropout, q))
    ctx.inputs = len(inputs)


def dropout_backward_args(dropout: list, q: Tensor) -> list:
    """A cp attention's trailing dropout arguments (p, site, full, per_sample, shard) for its backward op, with
    the forward's key: eager, the key set now (the forward's micro-batch); traced by `compile` (fake
    tensors), none, so the compiled backward reads the key when it runs, which the runtime sets to the same
    micro-batch's around its backward (runtime/dropout.py key_scope). Empty without dropout."""
    if not dropout or not dropout[0]:
        return []
    return [*dropout, None if is_fake(q) else list(current_key())]


def _ring_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = eager.call("parc::bwd_ring_attention", grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, *[None] * (ctx.inputs - 3)


eager.register_autograd(ring_attention, _ring_backward, setup_context=_ring_setup)
for _op in (cp_sum, ring_attention, bwd_ring_attention):
    mark_ordered(_op)
