"""Compute time per operation: the part of the cost model that says how long a stage's F and B take.

Start at `stage_seconds(ops, hw, dtype, tp)`. `ops` is one pipeline stage's
operations of ONE micro-batch, collected from the traced graph by `op_table`
(stored in graph_stats as `stages[s]["ops"]`, JSON-ready):

- `mm`: matmuls as [batch, m, n, k, split, recomputed, count]. `split` says which
  dimension tensor parallelism divides: 0 none, 1 n (column, vocab), 2 k (row),
  3 batch (the attention core's heads). Time: 2·b·m·n·k / (peak · e), e from the
  preset's efficiency table at (b·m, n, k) and the dtype (`matmul_efficiency`; a batched
  kernel fills the GPU with the tiles of all b instances, `_mm_work`). The
  backward is the two matmuls dX = dY·Wᵀ (m, k, n) and dW = Xᵀ·dY (n, k, m),
  each looked up at its own shape.
- `attn`: scaled_dot_product_attention as [b·heads, T, hs, causal, split,
  recomputed, kv repeat, count] (`attn_rows`; kv repeat: how many query heads share
  each K/V head, GQA's repetition before the kernel (`kv_repeat`), 1 without; rows
  written before it have 7 fields and read as 1). FLOPs 4·b·h·T²·hs (halved when causal: a flash kernel skips
  the masked half), the backward 2.5× the forward (flash recomputes QKᵀ: five
  matmuls to the forward's two); efficiency from the preset's attention table.
  `attention="materialized"` prices a system that writes the scores out instead
  (`materialized_attention`: pre-2022 Megatron and DeepSpeed runs); `"flash-triton"`
  the FlashAttention written in Triton (`TRITON_FLASH_SLOWER`: MosaicML's MPT runs);
  `"flash-unpad"` the flash kernel between flash_attn's unpad and pad gathers
  (`unpad_seconds`: llm-foundry's attn_impl "flash"); `"cudnn"` cuDNN's fused
  attention at the preset's `attention_cudnn` table (NVIDIA's NeMo recipes).
- `mem`: every other op that makes a value, as [kind, bytes, sharded, recomputed,
  count]: bytes read and written by the op in the forward (dtypes as autocast
  runs them); `kind` (`mem_kind`) says what work the op does per byte: an
  elementwise op (`ew`), an activation (`gelu`, `gelu_tanh`, `silu`, `act` for
  the other transcendental ones), a normalisation or softmax (`layer_norm`,
  `rms_norm`, `softmax`), the loss (`cross_entropy`), a gather (`embedding`),
  and the bias of a linear (`bias`: its add in the forward, the row sum that is
  its gradient in the backward). With the preset's measured times per kind
  (`mem_times`: forward and backward seconds of one op at a few sizes, `parc
  calibrate`) an op's time is read off its kind's rows at its bytes
  (`mem_seconds`); a kind the preset has no rows for uses `ew`'s. Without them
  (the shipped GPU presets) every kind is memory traffic, bytes / the preset's
  memory bandwidth, the backward twice the forward's bytes (it reads the output
  gradient and what it saved and writes the input gradient), and a bias is
  not priced (cuBLAS adds it in the matmul's epilogue; its gradient's row sum
  is left out). Rows of four (no kind: statistics stored before kinds existed)
  are `ew`.

Every kernel also costs the preset's `op_overhead` (launch and dispatch): on a
GPU the host runs ahead (`async_launch`), so a kernel costs max(work, overhead);
on a CPU the two add. The backward is taken as 2 kernels per forward kernel.
A calibrated CPU preset measures the overhead per kind of op instead
(`op_overheads`: seconds of a linear without bias, an attention, a view, forward
and backward apart, each at a size where the work is nothing; an older preset
file's `mem` row prices memory-bound ops without `mem_times`): there an op
costs its work plus its kind's overhead (a memory-bound op's measured time
holds its own), and the views (`views`: the count of view/reshape/split/getitem
nodes, which move no bytes but are dispatched and have autograd nodes) cost the
view overhead each.
Recomputed ops run their forward again inside the backward.

A preset without tables (or statistics without `ops`, e.g. an artifact compiled
before they existed) falls back to FLOPs / (peak · achievable): `fallback`.
"""

from __future__ import annotations

import math

# ops that copy or repeat their input along the way from a K projection to the attention kernel (`kv_repeat`)
REPEATS = ("aten.repeat_interleave.", "aten.clone.", "aten.contiguous.", "aten._to_copy.", "aten.expand.")

# ---------------------------------------------------------------- efficiency tables


def _nearest(table, point: tuple[float, ...], k: int = 4) -> float:
    """Inverse-distance weighted mean of the k nearest entries, in log2 space: table rows (*coords, value)."""
    lp = [math.log2(max(x, 1)) for x in point]
    dist = []
    for row in table:
        d = math.sqrt(sum((math.log2(max(c, 1)) - x) ** 2 for c, x in zip(row[:-1], lp)))
        dist.append((d, row[-1]))
    dist.sort()
    near = dist[:k]
    if near[0][0] < 1e-9:
        return near[0][1]
    w = [1 / d ** 2 for d, _ in near]
    return sum(wi * v for wi, (_, v) in zip(w, near)) / sum(w)


_LOOKED_UP: dict = {}   # id(a table) → (the table, {key: efficiency}): a planner asks again and again


def _looked_up(table: tuple, key: tuple, find) -> float:
    """`find()`, memoized per efficiency table (held with its answers, so its id names it while they live) and
    `key`: the lookups are pure functions of the table and the shape."""
    held, answers = _LOOKED_UP.get(id(table), (None, None))
    if held is not table:
        held, answers = _LOOKED_UP[id(table)] = (table, {})
    if key not in answers:
        answers[key] = find()
    return answers[key]


def matmul_efficiency(hw, dtype: str, m: float, n: float, k: float) -> float:
    """Fraction of `hw.flops[dtype]` one (m×k)·(k×n) matmul reaches, from the preset's table, at most
    the preset's `matmul_sustained`: the tables time a matmul in a short loop, at the boost clock; a
    large one inside a training step draws the board's full power and runs at the clock that power
    allows (presets.py: H200 708.5 sustained against 841.9 TFLOP/s in a burst). Memoized (`_looked_up`)."""
    return _looked_up(hw.matmul, ("mm", dtype, m, n, k, hw.matmul_sustained, hw.achievable),
                      lambda: _matmul_efficiency(hw, dtype, m, n, k))


def _matmul_efficiency(hw, dtype: str, m: float, n: float, k: float) -> float:
    rows = [r[1:] for r in hw.matmul if r[0] == dtype] or [r[1:] for r in hw.matmul]
    e = _nearest(rows, (m, n, k)) if rows else hw.achievable
    return min(e, hw.matmul_sustained) if hw.matmul_sustained else e


def attention_efficiency(hw, dtype: str, t: float, hs: float, backward: bool, kernel: str = "flash") -> float:
    """Fraction of peak one causal attention of sequence `t`, head size `hs` reaches, from the preset's table for
    `kernel` ("cudnn": `attention_cudnn` where the preset has it; else the flash table, `attention`). Memoized
    (`_looked_up`)."""
    table = hw.attention_cudnn if kernel == "cudnn" and hw.attention_cudnn else hw.attention
    return _looked_up(table, ("attn", dtype, t, hs, backward, hw.achievable),
                      lambda: _attention_efficiency(table, dtype, t, hs, backward, hw.achievable))


def _attention_efficiency(table: tuple, dtype: str, t: float, hs: float, backward: bool, achievable: float) -> float:
    rows = [r for r in table if r[0] == dtype] or list(table)
    if not rows:
        return achievable
    return _nearest([(r[1], r[2], r[4 if backward else 3]) for r in rows], (t, hs))


def mem_seconds(hw, kind: str, nbytes: float) -> tuple[float, float] | None:
    """(forward, backward) seconds of one memory-bound op of `kind` moving `nbytes`, from the preset's measured
    rows (kind, bytes, forward s, backward s; `ew`'s for a kind without rows): linear between the two measured
    sizes around it, the smallest's time below them (what dispatch costs at no work), the largest's seconds
    per byte beyond. None when the preset has no rows (the shipped GPU presets)."""
    rows = sorted(r[1:] for r in hw.mem_times if r[0] == kind) or sorted(r[1:] for r in hw.mem_times if r[0] == "ew")
    if not rows:
        return None
    if nbytes <= rows[0][0]:
        return rows[0][1], rows[0][2]
    for (b0, f0, k0), (b1, f1, k1) in zip(rows, rows[1:]):
        if nbytes <= b1:
            w = (nbytes - b0) / (b1 - b0)
            return f0 + w * (f1 - f0), k0 + w * (k1 - k0)
    b1, f1, k1 = rows[-1]
    return f1 * nbytes / b1, k1 * nbytes / b1


# ---------------------------------------------------------------- per stage


# FlashAttention in Triton (flash_attn_triton.py of Dao-AILab/flash-attention, after Tillet's Triton tutorial;
# llm-foundry's attn_impl "triton" runs a copy of it), priced against the FlashAttention-2 table it is measured
# beside: "FlashAttention-2 is around 1.3-1.5× faster than FlashAttention in Triton in the forward pass and around
# 2× faster in the backward pass" (Dao, FlashAttention-2, arXiv:2307.08691 §4.1, A100 80GB SXM4, causal and not,
# head sizes 64 and 128, sequences 512 to 16k). (forward, backward) divisors of the table's efficiency: the
# forward range's middle, and the backward's figure. Measured on the A100; an H100 preset applies them as they
# are (no measurement of the Triton kernel on an H100 beside FlashAttention-2 was found).
TRITON_FLASH_SLOWER = (1.4, 2.0)

# FlashAttention-2's variable-length kernel between flash_attn's `unpad_input` and `pad_input` (flash_attn/
# bert_padding.py at v2.4.2; llm-foundry's attn_impl "flash", llmfoundry/models/layers/attention.py `flash_attn_fn`
# at 5e85bd62d, calls them whether or not a sample is padded): the kernel as "flash", and around it, each a kernel
# of its own (`unpad_seconds`). Forward: q, k and v each gathered into a new tensor (`IndexFirstAxis`: torch.gather,
# read and write), the output scattered into a zeroed one (`IndexPutFirstAxis`: zeros, then an index_put that reads
# and writes); and per unpad_input five kernels on the (b, T) mask (sum, nonzero, max, cumsum, pad) plus the mask's
# ones_like: no bytes to speak of, each a launch. Backward: each gather's gradient a zeroed tensor and a scatter_
# into it, the output's a gather. In elements of a row of q, k, v, o: forward 2(q + k + v) + 3o, backward
# 3(q + k + v) + 2o.
UNPAD_INDEX_KERNELS = 3 * 5 + 1


def unpad_seconds(hw, dtype: str, bh: float, t: float, hs: float, repeat: int) -> tuple[float, float]:
    """(forward, backward) seconds of the gathers and scatters flash_attn's `unpad_input` and `pad_input` put
    around one attention of b·heads `bh` rows of T × hs (`UNPAD_INDEX_KERNELS`' comment): q and the output at the
    query heads, k and v at theirs (1/`repeat`: the gathers run before any repetition to the query heads)."""
    act = 4 if dtype == "fp32" else 2
    q = o = bh * t * hs * act
    kv = 2 * q / repeat
    # each gather, scatter and zero fill one elementwise kernel moving those bytes: an `ew` op's forward
    fwd = sum(_mem_op(hw, "ew", b)[0] for b in (2 * q, kv, kv, o, 2 * o)) + UNPAD_INDEX_KERNELS * _kernel(hw, 0.0)
    bwd = sum(_mem_op(hw, "ew", b)[0] for b in (q, 2 * q, kv / 2, kv, kv / 2, kv, 2 * o))
    return fwd, bwd


def _peak(hw, dtype: str) -> float:
    return hw.flops.get(dtype, hw.flops["fp32"])


def _kernel(hw, work: float) -> float:
    return max(work, hw.op_overhead) if hw.async_launch else work + hw.op_overhead


def _mm_work(hw, dtype, b, m, n, k) -> float:
    """Seconds of b (m×k)·(k×n) matmuls in one batched kernel. Its efficiency is the table's at (b·m, n, k): the
    kernel launches the tiles of all b instances at once, so it fills the SMs in waves as one matmul of b·m rows
    does, each tile running the same k loop (the table holds single matmuls: XLA's b = 1 entries)."""
    flops = 2 * b * m * n * k
    return flops / (_peak(hw, dtype) * matmul_efficiency(hw, dtype, b * m, n, k)) if flops else 0.0


def _mm_time(hw, dtype, b, m, n, k) -> float:
    return _kernel(hw, _mm_work(hw, dtype, b, m, n, k)) if b * m * n * k else 0.0


def _overheads(hw, kind: str) -> tuple[float, float] | None:
    """The preset's measured (forward, backward) dispatch seconds of an op of `kind`; None without
    (a handful of rows on a calibrated CPU preset, none on the GPU presets)."""
    return next((tuple(row[1:3]) for row in hw.op_overheads if row[0] == kind), None)


def _op(hw, kind: str, fwd_work: float, bwd_work: list[float]) -> tuple[float, float]:
    """(forward, backward) seconds of one op: its work, and its dispatch overhead. With the preset's
    per-kind overheads (calibrated CPU) the two add, the backward's kernels under one figure; without,
    each kernel is `_kernel` (GPU: max(work, overhead))."""
    if (over := _overheads(hw, kind)) is not None:
        return fwd_work + over[0], sum(bwd_work) + over[1]
    return _kernel(hw, fwd_work), sum(_kernel(hw, w) for w in bwd_work)


def _tp_share(b: float, n: float, k: float, split: int, tp: int) -> tuple[float, float, float]:
    """A matmul row's (batch, n, k) on one tp rank: `split` 1 cuts n (column-parallel), 2 k (row-parallel), 3 the
    batch (heads); 0 none."""
    if tp == 1 or not split:
        return b, n, k
    return (b / tp if split == 3 else b), (n / tp if split == 1 else n), (k / tp if split == 2 else k)


def stage_seconds(ops: dict, hw, dtype: str, tp: int, attention: str = "flash",
                  attention_dropout: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on one tp rank of a stage; recompute inside backward.

    `attention`: the kernel the run's attention uses: "flash" (a fused kernel, what
    scaled_dot_product_attention runs on a GPU: the attention table), "flash-triton" (FlashAttention
    written in Triton: the table's efficiency over `TRITON_FLASH_SLOWER`, forward and backward apart),
    "flash-unpad" (the flash kernel with flash_attn's unpad and pad gathers around it: `unpad_seconds`),
    "cudnn" (cuDNN's fused attention: the preset's `attention_cudnn` table where it has one) or
    "materialized" (the scores written out, as every system before FlashAttention, 2022:
    `materialized_attention`), with a dropout on the probabilities when `attention_dropout`."""
    fwd = bwd = 0.0
    for b, m, n, k, split, rec, count in ops.get("mm", ()):
        b, n, k = _tp_share(b, n, k, split, tp)
        if not b * m * n * k:
            continue
        f, bk = _op(hw, "mm", _mm_work(hw, dtype, b, m, n, k),
                    [_mm_work(hw, dtype, b, m, k, n), _mm_work(hw, dtype, b, n, k, m)])
        fwd += count * f
        bwd += count * (bk + (f if rec else 0.0))
    for bh, t, hs, causal, split, rec, repeat, count in attn_rows(ops):
        if tp > 1 and split:
            bh = bh / tp
        if attention == "materialized":
            f, bk = materialized_attention(hw, dtype, bh, t, hs, attention_dropout)
            fwd += count * f
            bwd += count * (bk + (f if rec else 0.0))
            continue
        flops = 4 * bh * t * t * hs * (0.5 if causal else 1.0)
        slower = TRITON_FLASH_SLOWER if attention == "flash-triton" else (1.0, 1.0)
        eff = [attention_efficiency(hw, dtype, t, hs, back, attention) for back in (False, True)]
        f, bk = _op(hw, "attn", slower[0] * flops / (_peak(hw, dtype) * eff[0]),
                    [slower[1] * 2.5 * flops / (_peak(hw, dtype) * eff[1])])
        if attention == "flash-unpad":
            uf, ub = unpad_seconds(hw, dtype, bh, t, hs, repeat)
            f, bk = f + uf, bk + ub
        fwd += count * f
        bwd += count * (bk + (f if rec else 0.0))
    for kind, nbytes, sharded, rec, count in _mem_rows(ops):
        if tp > 1 and sharded:
            nbytes = nbytes / tp
        f, bk = _mem_op(hw, kind, nbytes)
        fwd += count * f
        bwd += count * (bk + (f if rec else 0.0))
    views = _overheads(hw, "view")
    if views:   # only a calibrated per-kind table prices them: elsewhere a view is free
        fwd += ops.get("views", 0) * views[0]
        bwd += ops.get("views", 0) * views[1]
    return fwd, bwd


def tp_gemm_seconds(ops: dict, hw, dtype: str, tp: int) -> tuple[float, float, float, float]:
    """Kernel seconds of one micro-batch's tp-split linears on one tp rank of a stage (column- and row-parallel
    matmuls, those whose collectives tp runs): (forward, backward, the backward's weight-gradient part, the
    forward run again in the backward under recompute). The windows another system overlaps tp's collectives
    with (`cost.System.tp_overlap`)."""
    fwd = bwd = wgrad = again = 0.0
    for b, m, n, k, split, rec, count in ops.get("mm", ()):
        if tp == 1 or split not in (1, 2):
            continue
        b, n, k = _tp_share(b, n, k, split, tp)
        if not b * m * n * k:
            continue
        f, w = _mm_work(hw, dtype, b, m, n, k), _mm_work(hw, dtype, b, n, k, m)
        fwd += count * f
        bwd += count * (_mm_work(hw, dtype, b, m, k, n) + w)
        wgrad += count * w
        again += count * f if rec else 0.0
    return fwd, bwd, wgrad, again


def materialized_attention(hw, dtype: str, bh: float, t: float, hs: float, dropout: bool) -> tuple[float, float]:
    """(forward, backward) seconds of attention that writes its scores out (Megatron-LM and
    Megatron-DeepSpeed before FlashAttention: two batched matmuls and a fused scale-mask-softmax kernel).

    Q·Kᵀ (t × t × hs) and P·V (t × hs × t) per head at the matmul table's efficiency, over the whole
    t × t square (the causal mask is applied to the scores, not skipped), each with its dX and dW in the
    backward. The scores are memory-bound traffic: the softmax reads and writes them (16-bit), its
    backward reads probabilities and gradient and writes one; a dropout on the probabilities
    (`dropout`) reads and writes them and writes a one-byte mask, its backward reads gradient and mask
    and writes one.
    """
    act = 4 if dtype == "fp32" else 2
    scores = bh * t * t
    f = _mm_time(hw, dtype, bh, t, t, hs) + _mm_time(hw, dtype, bh, t, hs, t)
    b = (2 * _mm_time(hw, dtype, bh, t, hs, t)                                      # d(QKᵀ): dQ, dK
         + _mm_time(hw, dtype, bh, t, t, hs) + _mm_time(hw, dtype, bh, t, hs, t))     # d(PV): dP, dV
    f_bytes, b_bytes = 2 * act * scores, 3 * act * scores
    if dropout:
        f_bytes += (2 * act + 1) * scores
        b_bytes += (2 * act + 1) * scores
    bw = hw.mem_bw or 1e30
    return f + _kernel(hw, f_bytes / bw), b + _kernel(hw, b_bytes / bw)


def _mem_op(hw, kind: str, nbytes: float) -> tuple[float, float]:
    """(forward, backward) seconds of one memory-bound op: measured for its kind, else bytes over bandwidth."""
    if (measured := mem_seconds(hw, kind, nbytes)) is not None:
        return measured
    if kind == "bias" or not (hw.mem_bw or hw.op_overheads):
        return 0.0, 0.0   # a bias in the matmul's epilogue; no bandwidth: nothing to price it with
    work = nbytes / hw.mem_bw if hw.mem_bw else 0.0
    return _op(hw, "mem", work, [work, work])


def _mem_rows(ops: dict) -> list[list]:
    """The memory-bound rows as [kind, bytes, sharded, recomputed, count]; a row of four (stored before kinds
    existed) is `ew`."""
    return [row if len(row) == 5 else ["ew", *row] for row in ops.get("mem", ())]


def has_model(hw, stage: dict) -> bool:
    """True when the per-op model applies: the preset has tables and the statistics have ops."""
    return bool(hw.matmul) and "ops" in stage


def fallback(hw, dtype: str, flops: float, recomputed: float) -> tuple[float, float]:
    """FLOPs at one efficiency for everything (presets without tables, statistics without ops)."""
    peak = _peak(hw, dtype) * hw.achievable
    return flops / peak, (2 * flops + recomputed) / peak


def step_seconds(hw, params_local: float, optimizer: str, dtype: str, micro_batches: int, tensors: int = 0,
                 params_grads: float | None = None) -> float:
    """Per-step memory-bound work outside the micro-batches, per rank: the optimizer update over the
    parameters this rank updates (`params_local`), grad clipping, bf16 casts, and gradient accumulation
    over the parameters whose whole gradient this rank accumulates (`params_grads`, default
    `params_local`: under ZeRO-0/1 every parameter of the stage, under ZeRO-2/3 the rank's shard).

    Bytes per parameter: AdamW reads param, grad and two moments and writes param and moments
    (16 + 12); SGD 8 + 4; clipping reads the grads for their norm and scales them (4 + 8); bf16 casts
    each weight once per step (4 read + 2 written). Accumulation, per micro-batch: under 16-bit compute
    the gradient the matmuls make is 16-bit and is added into the fp32 accumulator (Megatron's
    `main_grad.add_`, DeepSpeed's bf16 `update_hp_grads`, parc's cast into `.grad`): 2 read + 4 written
    for the first micro-batch, 2 + 4 read + 4 written for each later one; in fp32 the first gradient
    becomes `.grad` as it is, each later one is added (4 + 4 read + 4 written). `tensors`: parameter
    tensors the optimizer loops over, each at the preset's `optimizer_per_tensor` (a CPU's per-tensor
    loop, calibrated; 0 on the GPU presets, whose fused optimizer is one kernel).
    """
    if not hw.mem_bw:
        return 0.0
    extra = max(micro_batches - 1, 0)
    accumulate = 12 * extra if dtype == "fp32" else 6 + 10 * extra
    per = {"sgd": 12}.get(optimizer, 28) + 12 + (6 if dtype != "fp32" else 0)
    grads = params_local if params_grads is None else params_grads
    return (params_local * per + grads * accumulate) / hw.mem_bw + 4 * hw.op_overhead \
        + tensors * hw.optimizer_per_tensor


def deepspeed_accumulate_seconds(hw, params: float, precision: str, micro_batches: int) -> float:
    """Seconds one micro-batch's backward spends accumulating its gradient under DeepSpeed's pipeline engine, on
    `params` parameters (the stage's, one tp rank's share). The engine runs the accumulation right after each
    micro-batch's backward, on its stage (deepspeed/runtime/pipe/engine.py `_exec_backward_pass`), so it is part
    of every backward slot of the pipeline, not work after the last one:

    - bf16 (DeepSpeed's BF16_Optimizer, 2022: deepspeed/runtime/bf16_optimizer.py `update_hp_grads`, which the
      engine calls after every backward): `hp_grad.add_(lp.grad.to(fp32))`, two kernels: the cast (2 bytes read,
      4 written) and the add (4 + 4 read, 4 written), 18 bytes a parameter, on every micro-batch (the fp32
      gradients are zeroed after each step, so the first micro-batch adds too);
    - fp16 and fp32 (its FP16 and ZeRO-1 optimizers keep the gradients in the parameters' dtype): autograd adds
      each micro-batch's gradient into `.grad` in place (fp16: 2 + 2 read, 2 written; fp32: 4 + 4, 4) on every
      micro-batch but the first, whose gradient is written by its matmul: priced on each backward at
      (m − 1)/m of an add, their mean over the step."""
    if not params:
        return 0.0
    if precision == "bf16":
        return _mem_op(hw, "ew", params * 6)[0] + _mem_op(hw, "ew", params * 12)[0]
    width = 2 if precision == "fp16" else 4
    extra = (micro_batches - 1) / micro_batches if micro_batches > 1 else 0.0
    return extra * _mem_op(hw, "ew", params * 3 * width)[0]


def zero_grad_seconds(hw, params: float, grad_b: int, wire_b: int, low_acc: bool = False) -> float:
    """Seconds of the copies ZeRO-2/3 make of one micro-batch's whole gradient before reduce-scattering it, on
    `params` parameters (the stage's, one tp rank's share), as runtime/parallel/zero.py runs them in the backward
    (`_launch`, `_flat_grad`, `_reduce_scatter`), each a memory-bound op on the full gradient, not on the shard:

    - the bucket's gradients laid into one flat tensor (`torch.cat`): `grad_b` read and written per parameter;
    - 16-bit gradients cast to fp32 (`.float()`: 2 read, 4 written), unless accumulated in 16 bits (`low_acc`);
    - the average's pre-divide (`div_`, read and written in that dtype; with one dp rank, the copy into the
      shard that stands in for the reduce-scatter, the same bytes);
    - the cast to a narrower wire dtype (`reduce=bf16`: 4 read, 2 written).

    bf16 with the fp32 reduction: 4 + 6 + 8 = 18 bytes a parameter a micro-batch. FSDP2 (what torchtitan runs;
    torch/distributed/_composable/fsdp/_fsdp_collectives.py as of 2024) does like work in other ops, all on the
    compute stream: `foreach_reduce` chunk-cats the bf16 gradients into an fp32 reduce-scatter input (2 read,
    4 written; NCCL averages, no divide), and each all-gather's copy-out (`split_with_sizes_copy`) writes the
    unsharded parameters (2 read, 2 written, twice a micro-batch under `reshard_after_forward`): 14 bytes."""
    ops = [2 * grad_b]
    f = grad_b
    if f != 4 and not low_acc:
        ops.append(f + 4)
        f = 4
    ops.append(2 * f)
    if wire_b != f:
        ops.append(f + wire_b)
    return sum(_mem_op(hw, "ew", params * b)[0] for b in ops) if params else 0.0


# ---------------------------------------------------------------- from the traced graph


def _shape(n):
    val = n.meta.get("val") if hasattr(n, "meta") else None
    return tuple(val.shape) if hasattr(val, "shape") else None


def matmul_dims(node) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a matmul-like aten node from its traced shapes, else None."""
    name = str(node.target)
    ins = [_shape(a) for a in node.args if hasattr(a, "meta")]
    out = _shape(node)
    if out is None or not ins or ins[0] is None or not len(ins[0]):
        return None
    if "aten.linear." in name or "aten.addmm." in name or "aten.mm." in name:
        k = ins[0][-1] if "aten.addmm." not in name else ins[1][-1]
        n = out[-1]
        return 1, math.prod(out) // max(n, 1), n, k
    if "aten.bmm." in name or "aten.matmul." in name or "aten.baddbmm." in name:
        a = ins[1] if "aten.baddbmm." in name else ins[0]
        k, n = a[-1], out[-1]
        m = out[-2] if len(out) > 1 else 1
        return math.prod(out[:-2]) or 1, m, n, k
    return None


# memory-bound aten ops by the work they do per byte, as `parc calibrate` times them (calibrate._mem_probe):
# the aten name's base -> kind; any other op is elementwise arithmetic, `ew`; a tanh GELU is `gelu_tanh`
_KINDS = {
    "gelu": "gelu", "silu": "silu", "embedding": "embedding", "rms_norm": "rms_norm",
    **dict.fromkeys(("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "batch_norm",
                     "native_batch_norm", "instance_norm"), "layer_norm"),
    **dict.fromkeys(("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"), "softmax"),
    **dict.fromkeys(("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"), "cross_entropy"),
    **dict.fromkeys(("tanh", "sigmoid", "exp", "expm1", "erf", "log", "log1p", "softplus", "mish", "elu", "selu",
                     "celu", "sin", "cos", "rsqrt", "sqrt", "pow", "logsumexp"), "act"),
}
KINDS = ("ew", "bias", "gelu_tanh", *sorted(set(_KINDS.values())))


def mem_kind(node) -> str:
    """The kind of a memory-bound aten op (module docstring): `_KINDS` by its name, a tanh GELU apart."""
    parts = str(node.target).split(".")
    kind = _KINDS.get(parts[1], "ew") if parts[0] == "aten" and len(parts) > 1 else "ew"
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return "gelu_tanh" if kind == "gelu" and approximate == "tanh" else kind


def _bias(node):
    """The bias node a linear or addmm adds to its output, else None."""
    name = str(node.target)
    if "aten.linear." in name:
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    else:
        bias = node.args[0] if "aten.addmm." in name else None
    return bias if hasattr(bias, "meta") and _shape(bias) is not None else None


def attn_rows(ops: dict):
    """`ops`' attention rows as (b·heads, T, hs, causal, split, recomputed, kv repeat, count): a row of 7
    fields (written before the kv repeat was counted) reads as kv repeat 1."""
    for bh, t, hs, causal, split, rec, *repeat, count in ops.get("attn", ()):
        yield bh, t, hs, causal, split, rec, (repeat[0] if repeat else 1), count


def kv_repeat(sdpa) -> int:
    """How many query heads share each of an attention's K heads: K's elements over the fewest its values had
    on their way to the kernel through views, copies and repeats (`repeat_interleave`, or `expand` + reshape:
    grouped-query attention's K/V heads repeated to the query heads, torchtitan's and HF's `repeat_kv`). 1 when
    K reaches the kernel as computed. A system that moves K and V between ranks before that repetition
    (all-gather context parallelism, `cp_cost`) moves 1/repeat of the kernel's K and V."""
    from parc.analysis.activations import _is, is_alias

    k = sdpa.args[1] if len(sdpa.args) > 1 else None
    if not hasattr(k, "meta") or _shape(k) is None:
        return 1
    full = fewest = math.prod(_shape(k))
    node = k
    while (node.op == "call_function" and (is_alias(node) or _is(node, REPEATS)) and node.all_input_nodes
           and _shape(node.all_input_nodes[0]) is not None):
        node = node.all_input_nodes[0]
        fewest = min(fewest, math.prod(_shape(node)))
    return max(1, round(full / fewest)) if fewest else 1


def op_table(nodes, *, size_of, split_of, sharded_of, recomputed_of, bf16: bool = False,
             fused_loss: bool = False) -> dict:
    """One stage's ops, aggregated by identical shape (layers repeat): see the module docstring.

    `size_of(node)`: bytes per element as the runtime computes it; `split_of(node)`: which
    dimension tp divides (0–3) for a matmul or attention; `sharded_of(node)`: whether a
    memory-bound op's tensors are 1/tp per rank; `recomputed_of(node)`: inside a recompute region.
    Under `bf16`, autocast's cast of each fp32 activation a matmul reads is a memory-bound op of its
    own (4 bytes read, 2 written per element); weights are cast once per step (`step_seconds`).
    `fused_loss`: the loss is one fused kernel (`System.loss`), reading its logits once as they are.
    """
    from parc.analysis.activations import LOWERED, _is, is_alias

    mm, attn, mem, views = {}, {}, {}, 0
    for n in nodes:
        if n.op == "call_function" and is_alias(n) and not str(n.target).startswith("parc."):
            views += 1   # no bytes, but dispatched (and an autograd node): `views`, priced by the view overhead
            continue
        if n.op != "call_function" or _shape(n) is None:
            continue
        name, rec = str(n.target), int(bool(recomputed_of(n)))
        if name.startswith("parc."):   # collectives: timed by the communication model
            continue
        if bf16 and _is(n, LOWERED):
            for a in n.all_input_nodes:
                if a.op != "placeholder" and _shape(a) is not None and size_of(a) == 4:
                    key = ("ew", 6 * math.prod(_shape(a)), int(bool(sharded_of(a))), rec)
                    mem[key] = mem.get(key, 0) + 1
        if "scaled_dot_product" in name:
            q = _shape(n.args[0])
            causal = bool(n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False))
            key = (math.prod(q[:-2]), q[-2], q[-1], int(causal), split_of(n), rec, kv_repeat(n))
            attn[key] = attn.get(key, 0) + 1
            continue
        dims = matmul_dims(n) if _is(n, LOWERED) else None
        if dims is not None:
            key = (*dims, split_of(n), rec)
            mm[key] = mm.get(key, 0) + 1
            if (bias := _bias(n)) is not None:   # reads and writes the output, reads the bias; 1/tp in a column layer
                nbytes = 2 * math.prod(_shape(n)) * size_of(n) + math.prod(_shape(bias)) * size_of(bias)
                key = ("bias", int(nbytes), int(split_of(n) == 1), rec)
                mem[key] = mem.get(key, 0) + 1
            continue
        out_b = math.prod(_shape(n)) * size_of(n)
        if "embedding" in name:
            nbytes = 2 * out_b                    # gathers rows: reads and writes the output's size
        elif "cross_entropy" in name or "nll_loss" in name:
            logits = n.args[0]
            # eager: reads logits, writes and reads the fp32 log-softmax; fused: reads the logits once
            nbytes = math.prod(_shape(logits)) * (size_of(logits) if fused_loss else 3 * 4)
        else:
            nbytes = out_b + sum(math.prod(_shape(a)) * size_of(a) for a in n.all_input_nodes
                                 if _shape(a) is not None and a.op != "get_attr")
        key = (mem_kind(n), int(nbytes), int(bool(sharded_of(n))), rec)
        mem[key] = mem.get(key, 0) + 1
    return {"mm": [[*k, c] for k, c in mm.items()], "attn": [[*k, c] for k, c in attn.items()],
            "mem": [[*k, c] for k, c in mem.items()], "views": views}


def merge_ops(tables: list[dict]) -> dict:
    """The ops of several stages run as one (the planner's groups of per-layer stages): counts of
    identical rows add."""
    out = {}
    for kind in ("mm", "attn", "mem"):
        rows: dict = {}
        for t in tables:
            for *key, count in t.get(kind, ()):
                rows[tuple(key)] = rows.get(tuple(key), 0) + count
        out[kind] = [[*k, c] for k, c in rows.items()]
    out["views"] = sum(t.get("views", 0) for t in tables)
    return out


def scale_ops(ops: dict, micro: int) -> dict:
    """`ops` traced at ONE sample per micro-batch, as they are at `micro` samples.

    Assumes the sample is the leading dimension of every activation (parc traces inputs (B, ...)):
    a matmul's batch (bmm, attention's b·heads) grows by `micro` when it is over 1, else its m (a
    linear's rows B·T; a 3-d matmul of one sample by a weight, which the runtime runs as one mm of
    B·T rows); memory-bound bytes grow by `micro`. Rows whose shape grows alike merge.
    """
    if micro == 1:
        return ops
    mm = [[b * micro, m, n, k, *rest] if b > 1 else [b, m * micro, n, k, *rest]
          for b, m, n, k, *rest in ops.get("mm", ())]
    attn = [[bh * micro, *rest] for bh, *rest in ops.get("attn", ())]
    mem = [[kind, nbytes * micro, *rest] for kind, nbytes, *rest in _mem_rows(ops)]
    return merge_ops([{"mm": mm, "attn": attn, "mem": mem, "views": ops.get("views", 0)}])
