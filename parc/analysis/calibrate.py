"""`parc calibrate`: measure this device for the cost model and write a preset file.

Start at `calibrate(device, out)`. It runs short probes and writes the fields of
`parc.analysis.cost.Hardware` as JSON, which `--preset FILE` accepts wherever a
preset name is (report, check, plan); `parc.analysis.preset_file.read_preset` reads it back.

- matmul: a sweep of (m, n, k) shapes in the plan dtypes the device runs (CPU:
  fp32; CUDA: bf16 and fp32). The peak is the best FLOP/s seen (or
  `--peak-tflops`); each shape's efficiency is its FLOP/s over that peak.
- attention: causal scaled_dot_product_attention at a few (T, head size),
  forward and backward timed apart; FLOPs as parc.analysis.compute counts them
  (the masked half skipped, the backward 2.5× the forward).
- memory bandwidth: an elementwise add over tensors far larger than the caches
  (bytes read and written / time).
- memory-bound ops (`mem_times`): one op of each kind parc.analysis.compute
  prices (an add, GELU, tanh GELU, SiLU, tanh, layer norm, RMS norm, softmax,
  cross-entropy, an embedding, a linear's bias), forward and backward apart, at
  sizes from no work (dispatch alone) to beyond the caches: on a CPU a GELU
  costs several times an add of the same bytes, which one bandwidth cannot say.
- op overhead: a chain of tiny autograd ops, forward and backward, per kernel:
  what dispatch costs when there is no work. CPU: also per kind of op
  (`op_overheads`: a linear without bias, an attention, views, forward and
  backward apart, at a size where the work is nothing), which is what a rank of
  a small model spends most of its compute on; and the optimizer's per-tensor
  loop (`optimizer_per_tensor`, AdamW over small tensors).
- CPU only, among `--ranks` processes on this host (as many as the plans will
  run: they share the cores), all measured with every process at once:
  - a gloo all-reduce, small and large, for latency and bandwidth, and small
    among concurrent pairs (as tp=2 groups issue them), which with the whole
    world's separates a fixed cost per call from the cost per ring step (the
    fallback for group sizes the table lacks);
  - `collectives`: seconds per call of all-reduce, all-gather, reduce-scatter
    (groups of 2, 4, … ranks, all groups at once) and a pipeline send/recv, at
    three sizes, each measured *under load*: every rank computes a probe between
    calls (a few ops' worth, and a whole step's worth), and what a call adds over
    the same loop without it is its cost. On shared cores a peer a collective
    waits for is often not running, so a call costs several times what it costs
    with every rank idle inside the collective;
  - `contention`: the probe's slowdown with every rank computing at once, over
    ranks / cores (what core sharing alone explains); `cores`;
  - `p2p_post`: the mean time a rank spends posting a send or receive
    (`batch_isend_irecv`, small messages) in those loops, on its own timeline.
- CPU only, last, against the tables above: a probe model's training step timed
  in place, one process (`in_step`, `step_overhead`: calibrate_step.py).

Every figure is the median of repeats: the machine may be shared.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from parc.errors import ParcError

CPU_SHAPES = [(m, n, k) for m in (64, 512, 4096) for n in (64, 256, 1024) for k in (64, 256, 1024)]
CUDA_SHAPES = [(m, n, k) for m in (256, 1024, 4096, 16384) for n in (256, 1024, 4096, 16384)
               for k in (256, 1024, 4096, 16384)]
CPU_ATTN = [(t, hs) for t in (32, 128, 512) for hs in (16, 64)]
CUDA_ATTN = [(t, hs) for t in (512, 1024, 2048, 4096, 8192) for hs in (64, 128)]


def _timer(device: str):
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn, budget: float = 0.05, repeats: int = 5) -> float:
        """Median seconds of one call, each sample a loop of calls filling about `budget`."""
        fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        once = max(time.perf_counter() - t0, 1e-7)
        loops = max(1, min(1000, int(budget / once)))
        samples = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(loops):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / loops)
        return statistics.median(samples)
    return timed


def _matmuls(device: str, dtype, shapes, timed) -> list[tuple[int, int, int, float]]:
    import torch

    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = timed(lambda: a @ b)
        out.append((m, n, k, 2 * m * n * k / t))
    return out


def _attention(device: str, dtype, shapes, timed, peak: float) -> list[tuple]:
    import torch
    import torch.nn.functional as F

    rows = []
    for t, hs in shapes:
        bh = max(1, int(2 ** 22 // (t * hs)))  # about 4M elements per tensor
        q, k, v = (torch.randn(1, bh, t, hs, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        flops = 4 * bh * t * t * hs * 0.5
        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

        def both():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        bwd = max(timed(both) - fwd, 1e-9)
        rows.append((t, hs, flops / (fwd * peak), 2.5 * flops / (bwd * peak)))
    return rows


def _bandwidth(device: str, timed) -> float:
    import torch

    n = (2 ** 28 if device == "cuda" else 2 ** 24)  # 1 GiB / 64 MiB of fp32 per tensor
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    out = torch.empty(n, device=device)
    t = timed(lambda: torch.add(a, b, out=out), budget=0.2)
    return 3 * 4 * n / t


def _overhead(device: str, timed) -> float:
    import torch

    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()
    return timed(chain) / (50 * 3)  # 50 forward kernels, about 2 per op in backward


def _probe_step():
    """The compute probe whose slowdown under `--ranks` concurrent processes is measured: a small MLP's
    forward and backward (matmuls, an elementwise op, a norm; dispatch and cache as a rank's step has them)."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(256, 64)
    w1 = torch.randn(256, 64, requires_grad=True)
    w2 = torch.randn(64, 256, requires_grad=True)

    def step():
        F.layer_norm(F.linear(F.gelu(F.linear(x, w1)), w2), (64,)).sum().backward()
    return step


def _probe_alone() -> float:
    import torch

    torch.set_num_threads(1)   # as every rank runs (OMP_NUM_THREADS=1)
    return _timer("cpu")(_probe_step(), budget=0.1, repeats=7)


# one message per call, bytes of the whole tensor: the all-reduce's buffer, the all-gather's output, the
# reduce-scatter's input (what parc.analysis.cost._collective calls `size`); a send/recv's message
COLLECTIVE_BYTES = (1024, 2 ** 18, 2 ** 22)


# compute between two collective calls in the loaded measurement, in probe steps (about 0.6 ms each alone):
# a few ops (tp's all-reduces, ZeRO-3's gathers, a pipeline's sends) and a whole step's (dp's all-reduce)
BETWEEN = (1, 16)


def _per_call(fn, probe, between: int, samples: int = 5) -> tuple[float, float]:
    """(compute between calls, seconds one call of the collective `fn` adds to a rank's step), measured as
    ranks run it: every process computes `between` probe steps, then calls `fn`, over and over, and the
    same loop without the call is timed in alternation; the difference per call, averaged over the ranks.
    The compute between is the loop without calls (wall seconds, the cores shared as in a step). On cores
    the ranks share, a peer a collective waits for is often not running (another rank's compute is), and
    the longer ranks compute between calls the further apart they arrive: in isolation (every rank
    inside the collective, the cores idle) a call is several times cheaper than this."""
    import torch
    import torch.distributed as dist

    loops = max(2, 32 // between)

    def loop(call: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(loops):
            for _ in range(between):
                probe()
            if call:
                fn()
        return (time.perf_counter() - t0) / loops

    loop(True)
    with_call, without = [], []
    for _ in range(samples):
        with_call.append(loop(True))
        without.append(loop(False))
    mine = torch.tensor([statistics.median(without), statistics.median(with_call) - statistics.median(without)],
                        dtype=torch.float64)
    dist.all_reduce(mine)
    gap, call = (float(v) / dist.get_world_size() for v in mine)
    return gap, max(call, 0.0)


def _optimizer_per_tensor(tensors: int = 64, numel: int = 256) -> float:
    """Seconds per parameter tensor of an AdamW step over small tensors, where the bytes cost nothing: the
    per-tensor loop torch runs on a CPU (a dozen kernels a tensor), which a model of many small
    parameters pays. The per-tensor loop is what runtime/optim_step.py runs on CPU (no fused kernel)."""
    import torch

    torch.set_num_threads(1)
    params = [torch.zeros(numel, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.ones(numel)
    opt = torch.optim.AdamW(params, lr=1e-3)
    return _timer("cpu")(opt.step, budget=0.1, repeats=7) / tensors


def _op_overheads(timed) -> list[tuple[str, float, float]]:
    """(kind, forward s, backward s) of one op at a size where its work is nothing: what dispatch, autograd
    and the op's own bookkeeping cost, per kind parc.analysis.compute prices (a linear's forward is a
    transpose and a matmul, its backward two matmuls; its bias is a memory-bound op of its own, timed by
    `_mem_times` with the others). `view` is the mean of a view and a transpose. The backward is timed as
    the op's output summed and back-propagated, less the same for its input alone."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(2, 4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    q = torch.randn(1, 2, 4, 4, requires_grad=True)
    aten = torch.ops.aten   # as the generated programs call every op (codegen.py): ~1 µs more than F.*
    kinds = {"mm": [lambda: aten.linear.default(x, w)],
             "attn": [lambda: aten.scaled_dot_product_attention.default(q, q, q, is_causal=True)],
             "view": [lambda: aten.view.default(x, [2, 32]), lambda: aten.transpose.int(x, 1, 2)]}
    base = timed(lambda: x.sum().backward(), budget=0.05, repeats=9)
    rows = []
    for kind, fns in kinds.items():
        fwd = bwd = 0.0
        for fn in fns:
            f = timed(fn, budget=0.05, repeats=9)
            both = timed(lambda: fn().sum().backward(), budget=0.05, repeats=9)
            fwd, bwd = fwd + f / len(fns), bwd + max(both - f - base, 0.0) / len(fns)
        rows.append((kind, fwd, bwd))
    return rows


# elements per tensor of the memory-bound probes: no work (dispatch alone), in the caches, beyond them
CPU_MEM_SIZES = (64, 2 ** 12, 2 ** 14, 2 ** 16, 2 ** 18, 2 ** 21)
CUDA_MEM_SIZES = (2 ** 10, 2 ** 16, 2 ** 20, 2 ** 24, 2 ** 27)


def _mem_probe(kind: str, numel: int, device: str):
    """(op, the tensors its backward differentiates, bytes as compute.op_table counts them) of one memory-bound
    op of `kind` (compute.KINDS) over `numel` elements, in rows of 256 (a hidden dimension) when there are
    that many, called as the generated programs call it (`torch.ops.aten`, codegen.py). `act` (the
    transcendental ops without a kind of their own) is timed as a tanh; `bias` as a linear adds and
    differentiates its bias (the add over the output; the gradient, a sum over its rows)."""
    import torch

    aten = torch.ops.aten
    c = min(numel, 256)
    rows = numel // c
    x = torch.randn(rows, c, device=device, requires_grad=True)
    w, b = (torch.full((c,), v, device=device, requires_grad=True) for v in (1.0, 0.0))
    e = 4 * rows * c   # bytes of one fp32 tensor of the op's size
    if kind == "ew":
        y = torch.randn_like(x, requires_grad=True)
        return (lambda: aten.add.Tensor(x, y)), (x, y), 3 * e
    act = {"gelu": lambda: aten.gelu.default(x), "gelu_tanh": lambda: aten.gelu.default(x, approximate="tanh"),
           "silu": lambda: aten.silu.default(x), "act": lambda: aten.tanh.default(x)}
    if kind in act:
        return act[kind], (x,), 2 * e
    if kind == "layer_norm":
        return (lambda: aten.layer_norm.default(x, [c], w, b, 1e-5, False)), (x, w, b), 2 * e + 8 * c
    if kind == "rms_norm":
        return (lambda: aten.rms_norm.default(x, [c], w, 1e-6)), (x, w), 2 * e + 4 * c
    if kind == "softmax":
        return (lambda: aten.softmax.int(x, -1)), (x,), 2 * e
    if kind == "cross_entropy":
        target = torch.randint(c, (rows,), device=device)
        return (lambda: aten.cross_entropy_loss.default(x, target)), (x,), 3 * e
    if kind == "embedding":
        table, idx = torch.randn(256, c, device=device, requires_grad=True), torch.randint(256, (rows,), device=device)
        return (lambda: aten.embedding.default(table, idx)), (table,), 2 * e
    if kind == "bias":
        out = x.detach()
        return (lambda: aten.add.Tensor(out, b)), (b,), 2 * e + 4 * c
    raise ValueError(f"no probe for memory-bound kind {kind}")


def _mem_times(device: str, timed) -> list[tuple[str, int, float, float]]:
    """(kind, bytes, forward s, backward s) of one memory-bound op of each kind compute.py prices, at the sizes
    above. The backward is the forward and `torch.autograd.grad` of its output for a dense gradient (as a
    model's is; nothing accumulates into .grad between calls), less the forward and less the same call for
    a view of a leaf (the engine's start, which a model's backward pays once, not per op). CUDA: no `bias`
    (cuBLAS adds it in the matmul's epilogue; compute.py prices none without rows)."""
    import torch

    from parc.analysis.compute import KINDS

    if device == "cpu":
        torch.set_num_threads(1)
    rows = []
    for kind in KINDS:
        if kind == "bias" and device == "cuda":
            continue
        for numel in (CPU_MEM_SIZES if device == "cpu" else CUDA_MEM_SIZES):
            fn, inputs, nbytes = _mem_probe(kind, numel, device)
            grad = torch.randn_like(fn())
            leaf = torch.zeros_like(grad, requires_grad=True)
            fwd = timed(fn, budget=0.02, repeats=7)
            both = timed(lambda: torch.autograd.grad(fn(), inputs, grad), budget=0.02, repeats=7)
            engine = timed(lambda: torch.autograd.grad(leaf.view_as(leaf), leaf, grad), budget=0.02, repeats=7)
            rows.append((kind, nbytes, fwd, max(both - fwd - engine, 0.0)))
    return rows


def _gloo_worker(rank: int, port: int, out, world: int) -> None:
    import torch
    import torch.distributed as dist

    from parc.runtime.parallel.zero import quiet_renamed_collectives

    quiet_renamed_collectives()   # the all-gather and reduce-scatter below, as ZeRO calls them

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    probe = _probe_step()
    for size in (1024, 2 ** 22):
        x = torch.ones(size // 4)
        for _ in range(3):
            dist.all_reduce(x)
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(x)
            samples.append((time.perf_counter() - t0) / 5)
        res[size] = statistics.median(samples)
    # a small all-reduce as tp issues it: every pair of ranks in its own group, all pairs at once
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)] if world >= 4 else []
    if pairs and rank < 2 * len(pairs):
        x, group = torch.ones(256), pairs[rank // 2]
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(x, group=group)
            samples.append((time.perf_counter() - t0) / 5)
        res["pair"] = statistics.median(samples)
    # seconds per call of each collective kind, per group size n (world // n groups of consecutive ranks,
    # all at once: as a mesh axis's groups run), per message size, per compute between calls
    table, n = [], 2
    while n <= world:
        groups = [dist.new_group(list(range(g, g + n))) if n < world else None for g in range(0, world - n + 1, n)]
        if world % n == 0:
            group = groups[rank // n]
            for size in COLLECTIVE_BYTES:
                full, part = torch.ones(size // 4), torch.ones(size // 4 // n)
                calls = {"all-reduce": lambda: dist.all_reduce(full, group=group),
                         "all-gather": lambda: dist.all_gather_into_tensor(full, part, group=group),
                         "reduce-scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group)}
                for kind, fn in calls.items():
                    for between in BETWEEN:
                        table.append((kind, n, size, *_per_call(fn, probe, between)))
        n *= 2
    # a pipeline's send/recv: pairs (0→1, 2→3, …) at once, one way = half a round trip, as the
    # executor posts them (batch_isend_irecv, waited)
    posts: list[float] = []
    if world >= 2:
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        for size in COLLECTIVE_BYTES:
            buf = torch.ones(size // 4)

            def post(op):   # as runtime/parallel/pipeline.py posts a send or a receive
                t0 = time.perf_counter()
                works = dist.batch_isend_irecv([dist.P2POp(op, buf, peer)])
                if size == COLLECTIVE_BYTES[0]:   # the set-up, not a large message's copy (in the hop)
                    posts.append(time.perf_counter() - t0)   # the poster's own time, before any wait
                for work in works:
                    work.wait()

            def ping():
                if peer >= world:   # an odd world's last rank computes alone
                    return
                first, then = (dist.isend, dist.irecv) if rank % 2 == 0 else (dist.irecv, dist.isend)
                post(first)
                post(then)
            for between in BETWEEN:
                gap, call = _per_call(ping, probe, between)
                table.append(("send/recv", 2, size, gap, call / 2))
    # a post's time on its rank's own timeline: the mean over the smallest messages' posts above (a post the
    # scheduler interrupts costs its rank that time too; the median would drop it), averaged over the ranks
    mine = torch.tensor([statistics.fmean(posts) if posts else 0.0], dtype=torch.float64)
    dist.all_reduce(mine)
    res["post"] = float(mine) / world
    res["table"] = table
    # compute as the ranks run it, every process at once on the cores they share: the probe's time in the
    # loops without calls above (their median over every row: many samples, spread over the whole run)
    res["probe"] = statistics.median(gap / b for (*_, gap, _), b in zip(table, _betweens(table)))
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _betweens(table: list) -> list[int]:
    """The probe steps between calls of each row of the worker's table (rows come in BETWEEN order)."""
    return [BETWEEN[i % len(BETWEEN)] for i in range(len(table))]


def _gloo(world: int) -> dict:
    """Gloo among `world` processes on this host, every process at once: `latency` per ring step, `call`
    (fixed cost per collective call), `bw` (bytes/s), `table` (kind, group size, bytes, compute between
    calls, seconds per call) and `probe` (seconds of the compute probe while every process runs it). A small all-reduce costs
    a + 2(n - 1)·l on a ring of n: with concurrent pairs (n = 2) and the whole world measured, a and l are
    fitted from the two (one ring size only: a = 0)."""
    import torch.multiprocessing as mp

    from parc.runtime.launch import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, port, q, world)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    small, big = res[1024], res[2 ** 22]
    steps, share = 2 * (world - 1), 2 * (world - 1) / world   # a ring's latency steps and volume per rank
    bw = share * 2 ** 22 / max(big - small, 1e-9)
    out = {"bw": bw, "table": res["table"], "probe": res["probe"], "post": res["post"]}
    if "pair" not in res:
        return {**out, "latency": small / steps, "call": 0.0}
    step = max((small - res["pair"]) / (steps - 2), 0.0)
    return {**out, "latency": step, "call": max(res["pair"] - 2 * step, 0.0)}


def calibrate(device: str, out: Path, *, peak_tflops: float | None = None, ranks: int = 2, log=print) -> dict:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ParcError("parc calibrate --device cuda: no CUDA device here", hint="use --device cpu")
    timed = _timer(device)
    dtypes = {"fp32": torch.float32} if device == "cpu" else {"bf16": torch.bfloat16, "fp32": torch.float32}
    shapes, attn = (CPU_SHAPES, CPU_ATTN) if device == "cpu" else (CUDA_SHAPES, CUDA_ATTN)
    flops, table, attention = {}, [], []
    for name, dt in dtypes.items():
        log(f"matmul {name}: {len(shapes)} shapes")
        got = _matmuls(device, dt, shapes, timed)
        peak = peak_tflops * 1e12 if peak_tflops else max(f for *_, f in got)
        flops[name] = peak
        table += [(name, m, n, k, f / peak) for m, n, k, f in got]
        log(f"  best {max(f for *_, f in got) / 1e9:.1f} GFLOP/s at peak {peak / 1e9:.1f}")
        if name == ("fp32" if device == "cpu" else "bf16"):
            log(f"attention {name}: {len(attn)} shapes")
            attention += [(name, *row) for row in _attention(device, dt, attn, timed, peak)]
    for missing in ("bf16", "fp16", "fp32"):
        flops.setdefault(missing, flops.get("bf16", flops["fp32"]))
    mem_bw = _bandwidth(device, timed)
    log(f"memory bandwidth {mem_bw / 1e9:.1f} GB/s")
    overhead = _overhead(device, timed)
    log(f"op overhead {overhead * 1e6:.1f} µs")
    per_kind = _op_overheads(timed) if device == "cpu" else []   # the GPU presets: max(work, launch) per kernel
    for kind, f, b in per_kind:
        log(f"  {kind:<5} forward {f * 1e6:.1f} µs, backward {b * 1e6:.1f} µs per op")
    mem_times = _mem_times(device, timed)
    log("memory-bound ops, forward / backward µs per op at (bytes):")
    for kind in dict.fromkeys(k for k, *_ in mem_times):
        log(f"  {kind:<13} " + ", ".join(f"{f * 1e6:.1f}/{b * 1e6:.1f} ({n})" for k, n, f, b in mem_times if k == kind))
    preset = {
        "name": f"{device}:{_device_name(device)}", "memory": _memory(device), "flops": flops,
        "achievable": statistics.median(e for *_, e in table), "mem_bw": mem_bw, "matmul": table,
        "attention": attention, "op_overhead": overhead, "async_launch": device == "cuda",
        **({"op_overheads": [list(r) for r in per_kind]} if per_kind else {}),
        "mem_times": [list(r) for r in mem_times],
        "source": f"parc calibrate --device {device}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
    }
    if device == "cpu":
        cores = len(os.sched_getaffinity(0))
        alone = _probe_alone()
        g = _gloo(ranks)
        lat, call, bw = g["latency"], g["call"], g["bw"]
        log(f"gloo all-reduce over {ranks} processes: {call * 1e6:.0f} µs per call + {lat * 1e6:.0f} µs per ring "
            f"step, {bw / 1e9:.2f} GB/s")
        for kind, n, size, gap, sec in g["table"]:
            log(f"  {kind:<14} n={n} {size:>8} B, {gap * 1e3:5.1f} ms compute between: {sec * 1e3:.2f} ms per call")
        # the probe's slowdown with every rank computing at once, beyond sharing the cores (ranks / cores)
        share = max(1.0, ranks / cores)
        contention = g["probe"] / alone / share
        log(f"compute probe {alone * 1e3:.2f} ms alone, {g['probe'] * 1e3:.2f} ms with {ranks} processes at once "
            f"on {cores} cores: ×{g['probe'] / alone:.2f} (×{share:.2g} sharing, ×{contention:.2f} contention)")
        preset.update(intra_bw=bw, inter_bw=bw, latency_intra=lat, latency_inter=lat, collective_overhead=call,
                      gpus_per_node=1024, cores=cores, contention=contention,
                      collectives=[list(row) for row in g["table"]],
                      optimizer_per_tensor=_optimizer_per_tensor(), p2p_post=g["post"])
        log(f"posting a send or receive (batch_isend_irecv), on the poster's timeline: {g['post'] * 1e3:.2f} ms")
        log(f"optimizer (AdamW, per parameter tensor): {preset['optimizer_per_tensor'] * 1e6:.1f} µs")
        preset.update(_in_step(preset, log))
    else:  # one device: the interconnect is not measured here; NVLink/network figures of an H100 node (the h100
        # preset's), and the shipped presets' cited slowdown of compute beside a collective (presets.py)
        from parc.analysis.cost import PRESETS
        from parc.analysis.presets import OVERLAP_SLOWDOWN

        h100 = PRESETS["h100"]
        preset.update(intra_bw=h100.intra_bw, intra_allreduce_bw=h100.intra_allreduce_bw, inter_bw=h100.inter_bw,
                      gpus_per_node=8, overlap_slowdown=OVERLAP_SLOWDOWN)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(preset, indent=1))
    return preset


def _in_step(preset: dict, log) -> dict:
    """`in_step` and `step_overhead` (calibrate_step.py): a probe model trained in place, against these tables."""
    import tempfile

    from parc.analysis import calibrate_step
    from parc.analysis.cost import Hardware
    from parc.analysis.preset_file import as_fields

    with tempfile.TemporaryDirectory(prefix="parc-calibrate-") as work:
        fields, pairs = calibrate_step.in_step(Hardware(**as_fields(dict(preset))), Path(work))
    log("a step in place (parc/analysis/probe_model.py, one process), measured / the tables' price, ms:")
    for (g, m), (got, want) in pairs.items():
        log(f"  global {g} micro {m}: " + ", ".join(f"{k} {got[k] * 1e3:.2f} / {want[k] * 1e3:.2f}" for k in want)
            + f"; whole step {got['step'] * 1e3:.2f}")
    f, b, o = fields["in_step"]
    a, per_micro = fields["step_overhead"]
    log(f"  in a step: forward ×{f:.2f}, backward ×{b:.2f}, optimizer ×{o:.2f} the tables; beyond them "
        f"{a * 1e3:.2f} ms a step + {per_micro * 1e3:.2f} ms a micro-batch")
    return fields


def _device_name(device: str) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())


def _memory(device: str) -> float:
    import torch

    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
