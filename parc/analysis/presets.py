"""The shipped hardware figures: matmul and attention efficiency tables, memory bandwidth (docs/cost-model.md).

Start at `TABLES`. Each GPU preset in parc.analysis.cost.PRESETS takes its tables
from here; `parc calibrate` writes the same fields, measured, to a preset file.

- Matmul (H100, H200: the same GH100 die and clocks, so one table): achieved
  bf16 FLOP/s of cuBLAS on sm_90 from XLA's measured default table
  (openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h, "sm_90",
  b = 1 entries), plus the largest-shape anchor from Stas Bekman's Maximum
  Achievable Matmul FLOPS table (H100 SXM 792.1 TFLOPS at 6144×17920×2816).
  Efficiency = achieved / 989 TFLOPS.
- A100 (issue 27: no per-shape A100 measurement was found; XLA's table has
  sm_90 and sm_100 only, so this is a derivation from two cited measurements,
  not a table): a matmul's efficiency is set by how its tiles fill the GPU's
  SMs in waves, relative to each SM's own rate, and the A100 (108 SMs, same
  tile shapes) fills them as the H100 (132) does, so a shape keeps its H100
  efficiency, scaled by the ratio of the two GPUs' best measured efficiencies
  (Stas Bekman's MAMF table: A100 SXM 267.9 of 312 = 0.86, H100 SXM 792.1 of
  989 = 0.80): efficiency = min(H100 achieved / 989 × 0.86 / 0.80, 0.86). The
  rule before (min(H100 achieved / 312, 0.86): each matmul as long on an A100 as
  on an H100) holds only for launch-bound shapes and put nearly every
  transformer matmul at the 0.86 cap, where the H100 table gives 0.29–0.72 for
  the same shapes. docs/cost-model.md (c) has both rules' errors on the
  published runs.
- Attention (scaled_dot_product_attention, flash, causal, FLOPs counted with the
  masked half skipped): forward+backward throughput read off FlashAttention-2's
  benchmark figures (Dao 2023, arXiv:2307.08691, figs. 4–7: A100 and H100,
  head dim 64 and 128), the same figure used for forward and backward.
- cuDNN's fused attention on the H100 (`attention_cudnn`, `--attention cudnn`:
  Transformer Engine's FusedAttention, what NVIDIA's NeMo recipes select with
  NVTE_FUSED_ATTN=1 and NVTE_FLASH_ATTN=0): the FlashAttention-2 table above
  times cuDNN's speed over FlashAttention-2's, both measured side by side on an
  H100 80GB SXM5 in the FlashAttention-3 paper (Shah et al. 2024,
  arXiv:2407.08608, Fig. 5 (b) and (d), forward with causal mask, bf16/fp16;
  the figure is assets/flash3_fp16_fwd.png of Dao-AILab/flash-attention,
  commit 7ef24848): head dim 64, 1.25–1.30×; head dim 128, 1.58–1.65×. The
  figure is of the forward; the same ratio is taken for the backward, an
  assumption (no backward figure was read here). The A100 presets have none:
  no measurement of cuDNN's kernel beside FlashAttention-2 on an A100 was found,
  so `--attention cudnn` prices the A100 as flash and says so.
- Sustained matmul (H100, H200): a large matmul in a training step draws the
  board's full power (700 W) and the SM clock settles below boost, so no matmul
  is priced above the Maximum *Sustainable* Matmul FLOPS: H200 SXM bf16 708.5
  TFLOP/s (71.6% of 989) at 8192×8448×20480, ~693 W at 1465 MHz, against 841.9
  (the boost-clock burst, ~176 W at 1980 MHz) on the same GPU and software
  (torch 2.13+cu130): Stas Bekman's ml-engineering, compute/accelerator/README.md,
  branch fast-mamf, commit 082816f (2026-08-10). H100 SXM: the same die, clocks
  and 700 W, taken as the same. A100: not measured there, no cap.
- A100 40GB (`a100_40gb`): the same GA100 die, SM count, clocks and bf16 peak as
  the 80GB part, with 40 GB of HBM2 at 1,555 GB/s instead of 80 GB of HBM2e at
  2,039 GB/s (NVIDIA A100 Tensor Core GPU datasheet, "A100 40GB SXM" and "A100
  80GB SXM" columns). Its matmul and attention tables are the a100's: no entry
  is bandwidth-bound, so none scales with the slower memory. Each entry's
  achieved FLOP/s over its arithmetic intensity (FLOPs per byte of its least
  traffic: a matmul's A and B read and C written once in bf16; attention's
  Q, K, V, O read or written once forward, Q, K, V, O, dO read and dQ, dK, dV
  written once backward: `bandwidth_demand`) needs at most 0.69 of the 40GB
  part's 0.8 × 1,555 GB/s: attention at T = 512, head size 128, forward (the
  largest matmul demand is 0.47, 4096 × 4096 × 256). Flash attention's re-reads
  of K and V for each block of queries stay in the 40 MB L2 (one head's K and
  V at T = 512, d = 128: 256 KiB), and at long T, where a head's K and V
  outgrow it, the demand is under 0.16. Only memory-bound ops (`mem_bw`) move
  their bytes at 0.8 × 1,555 GB/s.
- Memory bandwidth: 80% of the HBM figure (A100-80GB 2.04 TB/s, A100-40GB
  1.555 TB/s, H100 SXM 3.35 TB/s, H100 SXM 96 GB HBM2e 2.4 TB/s, H200 4.8
  TB/s): what an unfused elementwise kernel reaches. Every
  kind of memory-bound op (elementwise, GELU, norms, softmax, the loss) moves
  its bytes at this rate: no `mem_times` here (`parc calibrate --device cuda`
  measures them); on a GPU those ops are bandwidth-bound at a model's sizes,
  and a linear's bias is not priced (cuBLAS adds it in the matmul's epilogue;
  the row sum that is its gradient is left out, as before kinds existed).
- Kernel launch overhead 5 µs, hidden behind longer kernels (the host runs ahead).
- Compute beside a collective (`overlap_slowdown`): a communication kernel
  running beside a matmul or attention holds SMs and memory bandwidth, so the
  compute under a hidden collective is slower than alone. Lee et al.,
  "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed
  Deep Learning: Performance and Power Implications" (arXiv:2507.03114, 2025),
  ran GPT and Llama training on 4 A100s, H100s, MI250s and MI210s: compute
  overlapped with communication took 18.9% longer on average (40.0% at most)
  than the same compute with no communication beside it. Every GPU preset
  takes the mean; the paper's per-GPU figures are not used (its mean is the
  one figure it states for all of them). `cost.beside` turns it into step time.
"""

from __future__ import annotations

# (m, n, k, achieved bf16 TFLOP/s) on sm_90
_SM90 = (
    (256, 512, 256, 11.5), (512, 256, 512, 21.8), (256, 1024, 256, 22.7), (256, 2048, 256, 41.8),
    (1024, 256, 1024, 68.3), (256, 512, 4096, 91.7), (512, 256, 4096, 91.1), (1024, 2048, 256, 139.5),
    (2048, 256, 1024, 135.8), (256, 1024, 4096, 172.3), (1024, 512, 2048, 220.0), (512, 2048, 1024, 232.6),
    (4096, 512, 512, 238.8), (256, 2048, 4096, 285.9), (4096, 256, 2048, 304.7), (256, 4096, 2048, 324.6),
    (4096, 1024, 512, 343.7), (2048, 512, 2048, 347.7), (1024, 1024, 2048, 350.0), (4096, 512, 1024, 370.8),
    (512, 4096, 1024, 373.3), (4096, 4096, 256, 392.2), (4096, 2048, 512, 447.0), (2048, 1024, 2048, 523.3),
    (1024, 2048, 2048, 524.3), (2048, 2048, 2048, 632.0), (4096, 4096, 4096, 783.3), (6144, 17920, 2816, 792.1),
)
_A100_MAX = 0.86  # 267.9 / 312
_GH100_SUSTAINED = 708.5 / 989  # H200 SXM MSMF, bf16 (above)
OVERLAP_SLOWDOWN = 0.189  # compute beside a collective, mean of Lee et al. 2025 (above)

# (T, head size, fwd+bwd TFLOP/s) of FlashAttention-2, causal
_FA2_A100 = ((512, 64, 90), (1024, 64, 130), (2048, 64, 155), (4096, 64, 170), (8192, 64, 175),
             (512, 128, 110), (1024, 128, 150), (2048, 128, 180), (4096, 128, 195), (8192, 128, 200))
_FA2_H100 = ((512, 64, 150), (1024, 64, 215), (2048, 64, 265), (4096, 64, 295), (8192, 64, 305),
             (512, 128, 180), (1024, 128, 255), (2048, 128, 305), (4096, 128, 325), (8192, 128, 335))

# FlashAttention-3 paper, Fig. 5 (b) and (d): forward, causal, H100 80GB SXM5, TFLOP/s of FlashAttention-2 and
# cuDNN at each (T, head size), as the figure prints them
_FA3_FIG5_CAUSAL = {(512, 64): (180, 225), (1024, 64): (229, 288), (2048, 64): (262, 334), (4096, 64): (284, 363),
                    (8192, 64): (295, 379), (512, 128): (191, 315), (1024, 128): (260, 410), (2048, 128): (298, 484),
                    (4096, 128): (319, 518), (8192, 128): (333, 529)}


def _matmul(peak: float, cap: float) -> tuple:
    return tuple(("bf16", m, n, k, min(t * 1e12 / peak, cap)) for m, n, k, t in _SM90)


def _attention(rows, peak: float) -> tuple:
    return tuple(("bf16", t, hs, f * 1e12 / peak, f * 1e12 / peak) for t, hs, f in rows)


def _cudnn_attention(rows, peak: float) -> tuple:
    """The FlashAttention-2 table `rows` with each entry times cuDNN's speed over FlashAttention-2's at its (T,
    head size) in the FlashAttention-3 paper's figure (`_FA3_FIG5_CAUSAL`), forward and backward alike."""
    return _attention([(t, hs, f * _FA3_FIG5_CAUSAL[t, hs][1] / _FA3_FIG5_CAUSAL[t, hs][0]) for t, hs, f in rows],
                      peak)


# ZeRO-Offload (parc/analysis/offload_cost.py). PCIe x16, one direction: Gen4 (A100) 32 GB/s, Gen5 (H100/H200
# SXM hosts) 64 GB/s, spec figures; a pinned copy is taken at 80% of them, as `mem_bw` is of HBM. Host DRAM: a
# two-socket host of 8 channels of DDR5-4800 a socket, 2 × 8 × 38.4 = 614 GB/s spec, shared by the node's 8
# ranks and taken at half (a CPU Adam's streams are not the STREAM benchmark's): 38 GB/s a rank. These are
# spec-sheet assumptions, not measurements; a preset file (`parc calibrate`) may state its own.
_PCIE4, _PCIE5 = 32e9, 64e9
_HOST_DRAM = 0.5 * 2 * 8 * 38.4e9 / 8

def _a100_matmul() -> tuple:
    """The A100's table: each sm_90 shape's efficiency, scaled by the two GPUs' best (MAMF) efficiencies."""
    scale = _A100_MAX / (792.1 / 989)
    return tuple(("bf16", m, n, k, min(t / 989 * scale, _A100_MAX)) for m, n, k, t in _SM90)


# every GPU preset: the launch overhead, and compute's slowdown beside a collective (above)
_EVERY_GPU = {"op_overhead": 5e-6, "overlap_slowdown": OVERLAP_SLOWDOWN}

TABLES = {
    "a100": {"matmul": _a100_matmul(), "attention": _attention(_FA2_A100, 312e12),
             "mem_bw": 0.8 * 2.039e12, **_EVERY_GPU, "pcie_bw": 0.8 * _PCIE4, "host_mem_bw": _HOST_DRAM},
    "a100_40gb": {"matmul": _a100_matmul(), "attention": _attention(_FA2_A100, 312e12),
                  "mem_bw": 0.8 * 1.555e12, **_EVERY_GPU, "pcie_bw": 0.8 * _PCIE4, "host_mem_bw": _HOST_DRAM},
    "h100": {"matmul": _matmul(989e12, 1.0), "attention": _attention(_FA2_H100, 989e12),
             "attention_cudnn": _cudnn_attention(_FA2_H100, 989e12),
             "mem_bw": 0.8 * 3.35e12, **_EVERY_GPU, "matmul_sustained": _GH100_SUSTAINED,
             "pcie_bw": 0.8 * _PCIE5, "host_mem_bw": _HOST_DRAM},
    "h100_hbm2e": {"matmul": _matmul(989e12, 1.0), "attention": _attention(_FA2_H100, 989e12),
                   "attention_cudnn": _cudnn_attention(_FA2_H100, 989e12),
                   "mem_bw": 0.8 * 2.4e12, **_EVERY_GPU, "matmul_sustained": _GH100_SUSTAINED,
                   "pcie_bw": 0.8 * _PCIE5, "host_mem_bw": _HOST_DRAM},
    "h200": {"matmul": _matmul(989e12, 1.0), "attention": _attention(_FA2_H100, 989e12),
             "attention_cudnn": _cudnn_attention(_FA2_H100, 989e12),
             "mem_bw": 0.8 * 4.8e12, **_EVERY_GPU, "matmul_sustained": _GH100_SUSTAINED,
             "pcie_bw": 0.8 * _PCIE5, "host_mem_bw": _HOST_DRAM},
}


def bandwidth_demand(tables: dict, peak: float) -> float:
    """The largest fraction of `tables`' memory bandwidth (`mem_bw`) any matmul or attention entry needs to move
    its least traffic at its tabled efficiency of `peak` FLOP/s: above 1, that entry would be bandwidth-bound on
    this memory and should scale with it. Least traffic: a matmul reads A (m × k) and B (k × n) and writes C
    (m × n) once, 2 bytes each (bf16), for 2mnk FLOPs; causal attention (one head, one sequence of T, head size
    d: 2 · 2T²d / 2 FLOPs forward, 2.5 times that backward, as compute.py counts them) reads Q, K, V and writes O
    forward (4Td elements), reads Q, K, V, O, dO and writes dQ, dK, dV backward (8Td)."""
    need = [e * peak / (2 * m * n * k / (2 * (m * k + k * n + m * n))) for _, m, n, k, e in tables["matmul"]]
    for _, t, d, fwd, bwd in tables["attention"]:
        flops = 2 * t * t * d
        need += [fwd * peak / (flops / (2 * 4 * t * d)), bwd * peak / (2.5 * flops / (2 * 8 * t * d))]
    return max(need) / tables["mem_bw"]
