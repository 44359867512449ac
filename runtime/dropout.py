"""Keyed dropout: masks that are a pure function of (seed, step, call site, global element index).

Start at `keep_mask`. A dropout mask drawn from a stateful generator depends on
who draws it: the serial model draws one mask over the whole global batch, a
dp rank draws its own slice, a tp rank only its heads or its sequence chunk, a
pipeline stage whatever its generator's history left. So `--verify` could not
compare a run with dropout against the serial model. Here every element's
keep/drop is a counter-based hash (splitmix64, in torch int64 ops: exact and
identical on CPU and CUDA) of

    key   = mix(seed, step, site)        site: the call site (passes/dropout.py `site_id`)
    index = the element's linear index in the serial run's tensor over the global batch

The index is `sample0 · per_sample + Σ_d coord_d · stride_d`, where sample0 is
the global index of the micro-batch's first sample (set by the runtime with
`key_scope`), per_sample the elements one sample contributes, and coord_d the
element's GLOBAL coordinate along dim d: on a tp-sharded dim, chunk `index` of
`parts` (of each of `blocks` blocks) is shifted to where it sits in the full
tensor; on cp's sequence dim (blocks LOAD_BALANCED) local token j sits in chunk
r or 2·cp−1−r; records apply innermost first. So dp, micro-batching, tp,
sequence and context parallelism all see the serial run's mask; recompute replays it (a pure function); pipeline stages need no
generator state at all.

The ops:
- `parc::keyed_dropout(x, p, site, full, per_sample, shard)`: (x · keep / (1 − p), keep),
  like aten.native_dropout. Backward: the saved mask × grad / (1 − p).
- `parc::keyed_attention(q, k, v, mask, p, causal, scale, gqa, site, full, per_sample, shard)`:
  `scaled_dot_product_attention` with dropout on the attention probabilities,
  written out (softmax(q·kᵀ·scale + mask) → keyed dropout → ·v) since the fused
  kernels draw their own masks. Backward re-runs that math under autograd (only
  q, k, v are saved, as a fused kernel would).

`key_scope(seed, step, sample0)` is a per-process setting, like the group
binding in runtime/parallel/ops.py: a program's text cannot carry it. The runtime sets
it around each micro-batch's forward AND backward, so a recomputed region
(which re-runs forward inside backward) sees its own micro-batch's key.
`serial_keys(model, sites, batch, micro)` keys the user's eager model the same way,
for the serial reference of `--verify` (runtime/serial_reference.py).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from parc.runtime import eager

_KEY: tuple[int, int, int] | None = None  # (seed, step, sample0): see the module docstring for why this is global

_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants
_MASK64 = (1 << 64) - 1
_BITS = 24  # keep iff the top 24 bits of the hash < round((1 − p) · 2^24): p is honoured to 6e-8


def _signed(c: int) -> int:
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


def mix64(z: int) -> int:
    """splitmix64's finalizer on a Python int (the reference the tensor version is tested against)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def site_id(module: str, occurrence: int) -> int:
    """A call site's stable 63-bit id: its module path and which dropout of that module it is (0, 1, …)."""
    digest = hashlib.blake2b(f"{module}#{occurrence}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def stream_key(seed: int, step: int, site: int) -> int:
    return mix64(mix64(mix64(seed + _GOLDEN) + step) ^ site)


LOAD_BALANCED = 0  # a shard record's `blocks` for context parallelism's layout (below)
THIS_CP_RANK = -1  # a shard record's `index` read at run time: the cp rank (one program serves every cp rank)


def _records(shard: list[int]) -> list[tuple[int, int, int, int]]:
    """`shard` as its (dim, parts, index, blocks) records, outermost first (module docstring)."""
    return [tuple(shard[i:i + 4]) for i in range(0, len(shard), 4)]


def _to_outer(c: Tensor, n: int, outer: int, parts: int, index: int, blocks: int) -> Tensor:
    """Local coordinates `c` (of `n`) along a dim cut by one record → coordinates in the `outer`-long dim it
    was cut from. blocks ≥ 1 (tensor parallelism): chunk `index` of `parts` of each of `blocks` blocks.
    LOAD_BALANCED (context parallelism, runtime/parallel/ring_attention.py): chunks `index` and
    2·parts−1−index of 2·parts, in that order."""
    if blocks == LOAD_BALANCED:
        half = n // 2
        first = c < half
        return torch.where(first, index * half + c, (2 * parts - 1 - index) * half + c - half)
    per_block = n // blocks
    return (c // per_block) * (outer // blocks) + index * per_block + c % per_block


def counters(local: list[int], full: list[int], per_sample: int, sample0: int, shard: list[int], device,
             mult: int = 1, add: int = 0) -> Tensor:
    """int64 (local shape, a fresh tensor): each element's linear index in the serial run's tensor over
    the global batch, times `mult` plus `add` (mod 2^64: folded into the per-dim terms, so the one
    full-size pass is the broadcast sum). `shard`: (dim, parts, index, blocks) records, outermost first
    (cp's cut of the sequence, then sequence parallelism's cut of that; tp's heads on another dim)."""
    records = _records(shard)
    sizes = [list(full)]  # each dim's size before each record, then the local size
    for dim, parts, _, _ in records:
        sizes.append([f // parts if d == dim else f for d, f in enumerate(sizes[-1])])
    if list(local) != sizes[-1] or any(full[d] % math.prod(r[1] for r in records if r[0] == d)
                                       for d in range(len(full))):
        raise RuntimeError(f"keyed dropout: local shape {list(local)} is not full shape {list(full)} "
                           f"cut by {records}")
    stride, strides = 1, []
    for f in reversed(full):
        strides.append(stride)
        stride *= f
    idx = torch.full((), _signed(sample0 * per_sample * mult + add), dtype=torch.int64, device=device)
    for d, (n, s) in enumerate(zip(local, reversed(strides))):
        c = torch.arange(n, dtype=torch.int64, device=device)
        for k in reversed(range(len(records))):  # innermost first: local j → its coordinate in the full dim
            dim, parts, index, blocks = records[k]
            if dim == d:
                c = _to_outer(c, sizes[k + 1][d], sizes[k][d], parts, index, blocks)
        shape = [1] * len(local)
        shape[d] = n
        idx = idx + (c * _signed(s * mult)).view(shape)
    return idx.clone() if idx.dim() == 0 else idx


_CP_RANK: int | None = None  # this process's cp rank, bound with the mesh's groups (bind_cp_rank)


def bind_cp_rank(rank: int | None) -> None:
    """Set by runtime/parallel/ops.py's `bind_groups` (the cp group's rank, None without cp): bound there so
    this module, which ops imports to register its ops, never imports ops back."""
    global _CP_RANK
    _CP_RANK = rank


def _resolved(shard: list[int]) -> list[int]:
    """`shard` with THIS_CP_RANK replaced by this process's cp rank (bound by `bind_cp_rank`)."""
    if THIS_CP_RANK not in shard[2::4]:
        return shard
    if _CP_RANK is None:
        raise RuntimeError("a keyed dropout split over cp ran with no cp group bound "
                           "(parc.runtime.parallel.ops.bind_groups)")
    return [_CP_RANK if i % 4 == 2 and v == THIS_CP_RANK else v for i, v in enumerate(shard)]


def current_key() -> tuple[int, int, int]:
    if _KEY is None:
        raise RuntimeError("keyed dropout ran outside a training step: no dropout key is set "
                           "(parc.runtime.dropout.key_scope)")
    return _KEY


def keep_mask(shape, p: float, key: tuple[int, int, int], site: int, full: list[int], per_sample: int,
              shard: list[int], device) -> Tensor:
    """bool (shape): True where the element is kept; key = (seed, step, sample0).

    keep ⇔ top 24 bits of mix64(key' + index · golden) < (1 − p) · 2^24: splitmix64. mix64's last
    xor-shift (by 31) leaves the top 24 bits alone, so it is skipped; the unsigned comparison is a
    signed one after flipping the sign bit. Peak memory: two int64 tensors of the shape.
    """
    seed, step, sample0 = key
    h = counters(list(shape), full, per_sample, sample0, _resolved(list(shard)), device, _GOLDEN,
                 stream_key(seed, step, site))
    tmp = torch.empty_like(h)
    for shift, mult in ((30, _M1), (27, _M2)):
        torch.bitwise_right_shift(h, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1  # logical shift: torch's >> copies the sign bit
        h ^= tmp
        h *= _signed(mult)
    threshold = round((1.0 - p) * (1 << _BITS)) << (64 - _BITS)
    if threshold >= 1 << 64:
        return torch.ones(shape, dtype=torch.bool, device=device)
    h ^= -(1 << 63)
    return h < _signed(threshold ^ (1 << 63))


@contextmanager
def key_scope(seed: int, step: int, sample0: int):
    """Key the dropouts run inside: `sample0` is the global index of the batch's first sample."""
    global _KEY
    outer, _KEY = _KEY, (seed, step, sample0)
    try:
        yield
    finally:
        _KEY = outer


def _apply(x: Tensor, keep: Tensor, p: float) -> Tensor:
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


@dataclass(frozen=True)
class Keyed:
    """One attention-dropout site's constants (passes/dropout.py) and the step's key: the masks of any block
    of its serial (B, H, L, S) probabilities. Context parallelism's attentions compute the probabilities in
    pieces (runtime/parallel/ring_attention.py: a (query chunk, key chunk) block at a time;
    runtime/parallel/ulysses.py: a group of heads), each piece's mask cut from the serial one by `records`
    appended inside the tp records of `shard`."""

    p: float
    site: int
    full: list[int]
    per_sample: int
    shard: list[int]
    key: tuple[int, int, int]

    def keep(self, shape, device, records: list[int]) -> Tensor:
        return keep_mask(shape, self.p, self.key, self.site, self.full, self.per_sample, [*self.shard, *records],
                         device)

    def apply(self, x: Tensor, keep: Tensor) -> Tensor:
        """x · keep / (1 − p), as keyed_dropout's forward and backward compute it."""
        return _apply(x, keep, self.p)


def attention_keys(p: float, site: int, full: list[int] | None, per_sample: int, shard: list[int] | None,
                   key: list[int] | None = None) -> Keyed | None:
    """The `Keyed` of a cp attention's trailing dropout arguments (None where p is 0); `key` None: the one set
    now (`key_scope`), as a compiled backward must read it at run time."""
    if not p:
        return None
    if full is None:
        raise RuntimeError(f"attention dropout {p} under context parallelism with no keyed site: passes/dropout.py "
                           "writes its site, full shape and shard records")
    return Keyed(float(p), site, list(full), per_sample, list(shard or []),
                 tuple(key) if key is not None else current_key())


# --- parc::keyed_dropout ----------------------------------------------------------------

@eager.custom_op("parc::keyed_dropout")
def keyed_dropout(x: Tensor, p: float, site: int, full: list[int], per_sample: int,
                  shard: list[int]) -> tuple[Tensor, Tensor]:
    """Forward: (x · keep / (1 − p), keep), keep = `keep_mask(...)`, as aten.native_dropout returns its mask.
    Backward: grad · keep / (1 − p), with the saved mask."""
    keep = keep_mask(x.shape, p, current_key(), site, full, per_sample, shard, x.device)
    return _apply(x, keep, p), keep


keyed_dropout.register_fake(lambda x, p, site, full, per_sample, shard: (torch.empty_like(x),
                                                                          torch.empty_like(x, dtype=torch.bool)))


def _dropout_setup(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])


eager.register_autograd(keyed_dropout, lambda ctx, g, _: (_apply(g, ctx.saved_tensors[0], ctx.p), *[None] * 5),
                        setup_context=_dropout_setup)


# --- parc::keyed_attention --------------------------------------------------------------

def _attention(q, k, v, mask, p, causal, scale, gqa, site, full, per_sample, shard, key):
    """torch's reference math for scaled_dot_product_attention, with the keyed dropout."""
    if gqa:  # (B, nkv, S, E) → (B, nh, S, E)
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, L, S)
    if causal:
        att = att.masked_fill(~torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril(),
                              float("-inf"))
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else att + mask
    att = att.softmax(-1)
    if key is None:  # traced by `compile`: the key is read when the compiled backward runs, not baked in
        keep = torch.ops.parc.keyed_keep(att, p, site, full, per_sample, shard)
    else:
        keep = keep_mask(att.shape, p, key, site, full, per_sample, shard, att.device)
    return _apply(att, keep, p) @ v


@torch.library.custom_op("parc::keyed_keep", mutates_args=())
def keyed_keep(like: Tensor, p: float, site: int, full: list[int], per_sample: int, shard: list[int]) -> Tensor:
    """`keep_mask` of `like`'s shape under the key set now: what a compiled backward of keyed attention
    calls, since its key (the step's) must be read at run time (runtime/compiled.py)."""
    return keep_mask(like.shape, p, current_key(), site, full, per_sample, shard, like.device)


keyed_keep.register_fake(lambda like, p, site, full, per_sample, shard: torch.empty_like(like, dtype=torch.bool))


@eager.custom_op("parc::keyed_attention")
def keyed_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, p: float, causal: bool,
                    scale: float | None, gqa: bool, site: int, full: list[int], per_sample: int,
                    shard: list[int]) -> Tensor:
    """Forward: softmax(q·kᵀ·scale + mask), keyed dropout, ·v. Backward: that math re-run under autograd."""
    return _attention(q, k, v, mask, p, causal, scale, gqa, site, full, per_sample, shard, current_key())


keyed_attention.register_fake(lambda q, k, v, *rest: q.new_empty((*q.shape[:-1], v.shape[-1])))


def _attention_setup(ctx, inputs, output):
    q, k, v, mask = inputs[:4]
    # eager: the key of this forward; traced by `compile` (fake tensors): None, and the backward reads the
    # key then, which the runtime sets to the same micro-batch's around its backward (see key_scope)
    ctx.rest = (*inputs[4:], None if is_fake(q) else current_key())
    ctx.save_for_backward(q, k, v, mask)
    dev = q.device.type
    ctx.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))  # bf16: re-run as forward ran


def _attention_backward(ctx, g):
    q, k, v, mask = ctx.saved_tensors
    diff = mask is not None and mask.is_floating_point() and ctx.needs_input_grad[3]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([mask.detach().requires_grad_()] if diff else [])
    dev, on, dtype = ctx.autocast
    with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=on):
        out = _attention(*leaves[:3], leaves[3] if diff else mask, *ctx.rest)
    grads = torch.autograd.grad(out, leaves, g)
    return (*grads[:3], grads[3] if diff else None, *[None] * 8)


eager.register_autograd(keyed_attention, _attention_backward, setup_context=_attention_setup)


# --- the serial reference: the user's eager model, keyed the same way ---------------------

class serial_keys(TorchFunctionMode):
    """Run the eager model with every dropout keyed as the compiled programs key it.

    `sites` is plan.json's `dropout.sites` (passes/dropout.py); `batch` the samples per call (the
    global batch). Module hooks keep the path of the module running; each `F.dropout` /
    `torch.dropout` / attention with dropout becomes the keyed op for (path, occurrence), with the
    traced shape scaled from the micro-batch to `batch` samples. A call the trace did not see, or
    with another shape, raises: a mask that cannot be matched is never drawn silently.
    """

    def __init__(self, model: torch.nn.Module, sites: list[dict], batch: int, micro: int):
        super().__init__()
        self.paths = {id(m): name for name, m in model.named_modules()}
        self.sites = {(s["module"], s["occurrence"]): s for s in sites}
        self.batch, self.micro = batch, micro
        self.stack: list[str] = [""]
        self.seen: dict[str, int] = {}
        self.hooks = []

    def __enter__(self):
        from torch.nn.modules import module as mm

        def pre(m, args):
            self.stack.append(self.paths.get(id(m), self.stack[-1]))

        def post(m, args, out):
            self.stack.pop()

        self.hooks = [mm.register_module_forward_pre_hook(pre), mm.register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def new_forward(self) -> None:
        self.seen.clear()
        del self.stack[1:]

    def _site(self, kind: str, shape: list[int]) -> tuple[int, list[int], int]:
        path = self.stack[-1]
        k = self.seen[path] = self.seen.get(path, -1) + 1
        site = self.sites.get((path, k))
        where = f"dropout #{k} of module `{path or '<top level>'}`"
        if site is None or site["kind"] != kind:
            raise RuntimeError(f"verify: the serial model ran {where} ({kind}), which the compiled trace does "
                               "not have; its mask cannot be matched")
        full = site["shape"]
        want = [full[0] * self.batch // self.micro, *full[1:]]
        if list(shape) != want:
            raise RuntimeError(f"verify: {where} has shape {list(shape)} in the serial model, not the traced "
                               f"{full} with dim 0 scaled by batch {self.batch} / micro {self.micro} = {want}: "
                               "its dim 0 does not carry the samples, so its masks cannot be matched")
        return site_id(path, k), list(shape), math.prod(shape) // self.batch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.nn.functional.dropout, torch.dropout):
            x = args[0]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
            if train and p > 0:
                site, full, per_sample = self._site("dropout", list(x.shape))
                return keyed_dropout(x, float(p), site, full, per_sample, [])[0]
        if func is torch.nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            a = {**dict(zip(names, args)), **kwargs}
            if a.get("dropout_p", 0.0) > 0:
                q, k = a["query"], a["key"]
                site, full, per_sample = self._site("attention", [*q.shape[:-1], k.shape[-2]])
                return keyed_attention(q, k, a["value"], a.get("attn_mask"), float(a["dropout_p"]),
                                       bool(a.get("is_causal", False)), a.get("scale"),
                                       bool(a.get("enable_gqa", False)), site, full, per_sample, [])
        return func(*args, **kwargs)
