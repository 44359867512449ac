"""Published large-scale training throughput against parc's cost model (issue 27, item 7).

    python bench/published.py               # the table (markdown) for docs/cost-model.md, then the statistics
    python bench/published.py --rows 2      # only the first rows (each traces a model on meta: ~1-5 s)

Each row is a published run: the model's shape, the parallel plan it ran, its cluster, and the
throughput it reports (per-GPU teraFLOP/s as the source counts them, or tokens per second per GPU).
parc traces a model of that architecture at that shape (bench/gpt_sized.py: Megatron's GPT;
bench/llama_sized.py: torchtitan's Llama), writes the plan as a .par, and prices it through exactly
what `parc report --model M --plan P --preset X [flags]` does: the CLI's own argument parser and
`parc.analysis.report.build_from_args`. What the source's system did differently from parc's runtime
(materialised attention, Megatron's scatter/gather pipeline sends, no dp overlap, the gradients' wire
dtype, NICs per node) is stated per source as those documented CLI flags (`FLAGS`), chosen from the
source's description, never to fit a figure. One preset per GPU type; no constant is tuned per row.

After the table: mean |error|, the worst row, the trend of the signed error with model size (least-squares
slope per decade of parameters, and Spearman's rank correlation of error with size), and Spearman's
rank correlation of predicted with published throughput inside each source's sweep.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT_MODEL = ROOT / "bench" / "gpt_sized.py"
LLAMA_MODEL = ROOT / "bench" / "llama_sized.py"
# bench/gpt_sized.py under Megatron's tensor parallelism: the attention's qkv and the MLP's first projection by
# columns, their output projections by rows, the token embedding and the output layer over the vocabulary
TP_RULES = (' "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
            ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n "wte" : vocab\n "lm_head" : vocab\n')
# bench/llama_sized.py under Megatron's tensor parallelism: q, k, v and the SwiGLU's two input projections by columns
# (heads and ffn split over tp), the attention's output and the MLP's down projection by rows, the token embedding and
# the output layer over the vocabulary
LLAMA_TP_RULES = (' "layers.*.attention.wq" : column\n "layers.*.attention.wk" : column\n'
                  ' "layers.*.attention.wv" : column\n "layers.*.attention.wo" : row\n'
                  ' "layers.*.feed_forward.w1" : column\n "layers.*.feed_forward.w3" : column\n'
                  ' "layers.*.feed_forward.w2" : row\n "tok_embeddings" : vocab\n "output" : vocab\n')

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# SC21 (arXiv:2104.04473), Table 1: A100-80GB (Selene: 8 per node, 8 × 200 Gbit/s HDR), vocab 51200,
# sequence 2048, mixed precision, full activation recompute; TFLOP/s per GPU counts the recompute
# (their eq. 3: 96·B·s·l·h²·(1 + s/6h + V/16lh)). Each row's run as the paper's authors launched it:
# examples/sc21/run_table_1.sh in NVIDIA/Megatron-LM ("some of the scripts that were used to produce the results
# in the Megatron paper", examples/sc21/README.md), one case per row: TP, PP, GBS, layers (NLS), hidden (HS) and heads
# (NAH) as the rows state them (which checks the 3.6B and 7.5B rows, unverified before against a text copy of
# the table), and what the table does not say: the micro-batch (MBS: 16, 16, 16, 8, 4, 2, 2, 1, 1, 1), the
# interleaved schedule (`--num-layers-per-virtual-pipeline-stage` 5, 5, 3, 1 on the 76B, 145B, 310B and 530B: 3, 2,
# 2 and 3 virtual stages a pp rank; none on the 1T), and the data-parallel wrapper (DDP=torch on the four pp-1
# rows: PyTorch's DistributedDataParallel, whose bucket all-reduces run under the backward of the last
# micro-batch (Megatron's schedules run the others under `no_sync`); DDP=local on the others, Megatron's own
# wrapper, which all-reduces after the backward). `--recompute-method uniform` on every row: full recompute.
MEGATRON = "Megatron-LM 2021 Table 1"
BLOOM = "BLOOM (BigScience 2022)"
MTNLG = "MT-NLG (Smith et al. 2022)"
# torchtitan's performance page (github.com/pytorch/torchtitan, docs/performance.md, 2024): Llama 2 and 3 under
# FSDP2 (ZeRO-3: parameters, gradients and optimizer state sharded over all 64 ranks) on 64 A100-80GB, bf16
# compute with fp32 gradient reduction (torchtitan's mixed_precision_reduce default), SDPA (flash) attention,
# "WPS" tokens per second per GPU, sequence 8192 (Llama 3) / 4096 (Llama 2). Activation checkpointing "full":
# every layer; "selective layer": every second layer (torchtitan's selective_ac_option "2"); "no": none. Its
# "selective op" rows are priced with `--recompute-saves` (OP_SAC below: what that policy saves and recomputes).
# The page does not name its cluster. The repository's multi-node script at the commit that wrote the figures
# (multinode_trainer.slurm at 1ea476e9f: "This script is optimized for AWS with EFA", "# Enable for A100"
# FI_PROVIDER=efa, NCCL_IB_DISABLE=1, 96 CPUs a task of 8 GPUs) is AWS's p4de.24xlarge, the 8 × A100-80GB
# host with 96 vCPUs and 400 Gbit/s of EFA in 4 × 100 Gbit/s links: `--nics 4` at inter=12.5GB/s. Taken as the
# cluster the figures ran on (an inference from that script, not a statement of the page).
TITAN_A100 = "torchtitan docs/performance.md (A100)"
# torchtitan's H100 benchmark (benchmarks/llama3_h100_202412_torchtitan.md, 2024-12): Llama 3.1 8B, FSDP (ZeRO-3)
# on 8 and on 128 H100s (8 a host, 400 Gbit/s per GPU between hosts), local batch 2, sequence 8192, bf16 without
# torch.compile or Float8, "selective activation checkpointing" (train_configs/llama3_8b.toml: mode 'selective',
# selective_ac_option 'op'; OP_SAC below). Their H100s are "96GB HBM2e with 2.4 TB/sec peak memory bandwidth"
# (the page's hardware list): the shipped h100_hbm2e preset, the h100's tables with that memory. They ran at a
# 500 W power limit; the preset's sustained-matmul cap is the one measured at 700 W (no figure at 500 W was
# found), so the rows stay optimistic by whatever the lower limit costs.
TITAN_H100 = "torchtitan benchmarks (H100, 2024-12)"
# MosaicML's MPT benchmarks (github.com/mosaicml/llm-foundry, scripts/train/benchmarking/README.md, tables "H100
# 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", written by commit b2a43a147, 2023-10-19,
# unchanged since): MPT trained by Composer under PyTorch FSDP, "Sharding Strategy FULL_SHARD" (ZeRO-3 over all the
# run's GPUs), "Throughput (T/s/GPU)" tokens per second per GPU, each row's MicroBatchSize, GradAccum and
# GlobalBatchSize (global = GPUs × micro × accum on every row taken) and "Activation Checkpointing" True (every
# MPTBlock: `recompute "blocks.*"`) or False. The shapes: scripts/train/yamls/pretrain/mpt-{1b,3b,7b,13b,30b,70b}.yaml
# at that commit (d_model, n_heads, n_layers: 2048/16/24, 2560/20/32, 4096/32/32, 5120/40/40, 7168/56/48,
# 8192/64/80; expansion_ratio 4, vocab_size 50368), llm-foundry's MPT of then: GELU MLP, learned positions
# (max_seq_len × d_model of them: why the table's NumParams grows with SeqLen), biases, LayerNorm, the output
# layer tied to the token embedding: examples/gpt.py's GPT with `tied` (bench/gpt_sized.py) has exactly the
# table's NumParams (1b at 2048: 1,315,950,592). submit_benchmarks.py at that commit sets attn_impl "triton"
# (llmfoundry/models/layers/flash_attn_triton.py: a copy of the FlashAttention written in Triton, which skips the
# causal mask's blocks as FlashAttention-2 does but runs slower: `--attention flash-triton`, compute.py's
# TRITON_FLASH_SLOWER from the FlashAttention-2 paper) and norm_type "low_precision_layernorm" (a LayerNorm run in
# bf16, one memory-bound op either way here). FSDP as Composer configured it: the yamls' limit_all_gathers true;
# prefetching at Composer's defaults (neither the yamls nor sweep.sh set them): in mosaicml 0.16.4 (llm-foundry's
# setup.py at that commit: >=0.16.4,<0.17; 0.14 and 0.15 the same) composer/trainer/dist_strategy.py
# `set_fsdp_default`: backward_prefetch BACKWARD_POST (each backward gather issued after the layer before it:
# `--zero-prefetch post`) and forward_prefetch False (FSDP's forward gathers still run ahead of the compute as the
# host issues them: parc's forward overlap); and the gradients reduced in the table's "MP Mode": DEFAULT (Composer: params bf16, reduce_dtype fp32: `--dp-wire fp32`)
# on the rows measured in 2023-10 with sweep.sh's image mosaicml/pytorch:2.1.0_cu121; the A100 table's two 70b rows
# are older (unchanged from commit 300cc5c58, 2023-05, submit_benchmarks.py's then default image
# mosaicml/pytorch:1.13.1), "bf16" "PURE" (everything in bf16, the gradients reduced in bf16: `wire="bf16"`).
# Clusters: 8 GPUs a node; the A100 table's 1600 Gbit/s a node is the a100 preset's 8 × 25 GB/s. The H100 table
# does not name its network: taken as the h100 preset's 8 × 50 GB/s (3200 Gbit/s a node, one 400 Gbit/s NIC a GPU,
# the usual H100 cluster of 2023), an assumption; 30 of its 43 rows ran on one node of 8, where it does not enter.
# Rows of 1b and larger only; every row of the two tables at those sizes is here.
MPT_H100 = "MosaicML MPT benchmarks (H100)"
MPT_A100 = "MosaicML MPT benchmarks (A100)"
# The same README's table "H100 80GB BF16 (Large Scale, >= 128 GPUs)", written by commit 5e85bd62d (2024-01-06,
# "Shashank/new benchmarks", unchanged since): 1b to 70b on 128, 256 and 512 H100s, sequence 2048, GradAccum 1,
# "Precision" amp_bf16 and "MP Mode" DEFAULT (params bf16, gradients reduced in fp32: `--dp-wire fp32`). The same
# commit added scripts/train/benchmarking/sweep.py, the sweep that ran them (its 18 configurations are the table's:
# each model's micro-batch 12, 8, 6, 16, 8, 8 and GPU counts 128, 256, 512), and what it sets differs from the
# tables above: fsdp_config_forward_prefetch true and backward_prefetch BACKWARD_PRE (each backward gather issued
# before the current layer's gradients: parc's default `--zero-prefetch pre`), limit_all_gathers true; attn_impl
# "flash" for 1b, 3b, 7b and 70b (the `gpu-flash2` extra of setup.py at that commit, which the commit's
# submit_benchmarks.py installs: flash-attn 2.4.2, FlashAttention-2, parc's default `--attention flash`) and "triton"
# for 13b and 30b (`attention="flash-triton"`); "Sharding Strategy" FULL_SHARD with checkpointing on 7b and up
# (7b without), SHARD_GRAD_OP without on 1b and 3b: PyTorch FSDP's ZeRO-2 (gradients and optimizer state sharded,
# the whole bf16 weights gathered for the step: `zero stage=2`). sweep.py's `--fsdp_config_mixed_precision PURE`
# does not reach the runs: submit_benchmarks.py at that commit leaves it out of its mod_parameters call, whose
# default is 'DEFAULT', which is what the table records (collect_results.py reads the run's fsdp_config). The
# software: torch 2.1.0 (setup.py: >=2.1,<2.1.1) and Composer 0.17 (>=0.17.2,<0.18); the image is not named
# ("<insert_image_name>"). The network is not named either: taken, as for the H100 table, as the h100 preset's
# 8 × 50 GB/s per node. These are the rows where that assumption matters most: every row spans 16 to 64 nodes,
# so each FSDP gather and reduce-scatter crosses the network.
MPT_H100_LARGE = "MosaicML MPT benchmarks (H100, ≥128 GPUs)"
# The README's "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" (the header's interconnect added by
# b2a43a147; the figures unchanged since the earliest copy in llm-foundry, llmfoundry/throughput/README.md at
# c4f8c7540, 2023-04-28, which brought them from mosaicml/examples): 1b to 70b on 8 to 128 A100-40GB, every row
# "Precision" bf16, "MP Mode" PURE (Composer's get_mixed_precision: params, gradient reduction and buffers in
# bf16: `--dp-wire bf16`), FULL_SHARD. The sweep that ran them, llmfoundry/throughput/sweep.sh at c4f8c7540 (its
# "# A100 40GB" half), used IMAGE mosaicml/pytorch:1.13.1_cu117 and GIT_COMMIT v0.0.4 of mosaicml/examples, whose
# setup.py then pinned mosaicml==0.13.4 and torch==1.13.1: Composer 0.13.4's set_fsdp_default has backward_prefetch
# BACKWARD_POST and forward_prefetch False (`--zero-prefetch post`, as the tables above), submit_benchmarks.py's
# attn_impl default "triton" (`--attention flash-triton`) and limit_all_gathers True. Its micro-batches are
# partly not the table's (7b at 2048 on 8 GPUs: 16 there, 12 in the table): the table's, which collect_results.py
# reads from each run's log, are the ones taken. The a100_40gb preset: the a100 with 40 GiB of HBM2 at 1,555 GB/s
# (parc/analysis/cost.py); its network the a100's 8 × 25 GB/s, the header's 1600 Gbit/s a node.
MPT_A100_40 = "MosaicML MPT benchmarks (A100 40GB)"
# NVIDIA NeMo AutoModel's performance summary (github.com/NVIDIA-NeMo/Automodel, docs/performance-summary.md as commit
# 2013a4dd6 wrote it, 2026-04-10; docs.nvidia.com/nemo/automodel/latest/performance/performance-summary.html),
# "Pre-Training Performance, System: DGX-H100, Precision: BF16": its one dense model, Llama3 70B on 64 GPUs, GBS 128,
# local batch 1, GA 4, sequence 8192, TP 1, PP 1, CP 2, FSDP 32, 18.90 s a global step, 866.77 tokens/s/GPU (128 ×
# 8192 / 18.90 / 64 = 866.8: the step and the figure agree). Its recipe at that commit
# (examples/llm_pretrain/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml, meta-llama/Llama-3.1-70B: Llama 3's 70B
# shape): 8 nodes of 8, strategy fsdp2, dp 32 (auto) × cp 2, activation_checkpointing True (what it wraps: the row, below),
# SDPA attention under cp (PyTorch's ring attention over SDPA's fused kernels), enable_compile True (each decoder
# layer compiled by torch.compile), enable_fsdp2_prefetch True (backward prefetch depth 2, before the current
# layer's gradients: parc's default) and no mp_policy, so FSDP2Config's default MixedPrecisionPolicy
# (nemo_automodel/components/distributed/config.py at that commit: param, reduce and output dtype bfloat16): bf16
# gradients on the wire. FSDP2 shards over the flattened dp_shard × cp mesh ("dp_shard_cp"): ZeRO-3 over all 64
# ranks, what parc's ZeRO does under cp (docs/context-parallel.md). The page names no network: DGX H100's
# 8 × 400 Gbit/s, the h100 preset's. Megatron-Bridge's own performance summary, which was looked for first, lists
# dense Llama 3 / 3.1 on DGX-H100 only in FP8 in every release from 25.09 to 26.08 (docs/cost-model.md (c)).
AUTOMODEL_H100 = "NeMo AutoModel performance summary (H100)"
# What each system ran beyond the plan, as `parc report` flags (its "another system's run" group), and its ZeRO
# stage. Megatron 2021 all-reduced fp16 gradients (its own DDP after the backward; PyTorch's DDP on the pp-1 rows,
# above), sent pipeline values as scatter/gather, and computed attention materialised with dropout on the
# probabilities (every Megatron / DeepSpeed row predates FlashAttention, May 2022: megatron/model/transformer.py's
# baddbmm, fused scale-mask-softmax, --attention-dropout 0.1). BLOOM's Megatron-DeepSpeed ran DeepSpeed's bf16
# optimizer ("ZERO_STAGE=0 # bf16 must use z0! it implements its own zero stage 1 equivalent", tr11-176B-ml.slurm):
# fp32 gradients, a ZeRO-1 sharded step; Jean Zay has 4 × 100 Gbit/s Omni-Path links per node of 8 GPUs. MT-NLG:
# DeepSpeed's fp16 ZeRO-1 (assumed: the stage is not in the quoted section), fp16 gradients, Selene's 8 HDR NICs per
# node. torchtitan: parc's own defaults (flash attention, overlapped FSDP collectives, fp32 reduce); its A100 page's
# hosts have 4 EFA links of 100 Gbit/s (above). Whether dp's reduction overlaps the backward is a row's
# `dp_overlap`: False for every GPT row but Megatron's DDP=torch ones (DeepSpeed's pipeline engine, BLOOM's and
# MT-NLG's, also reduces after the backward).
OLD_MEGATRON = ["--attention", "materialized-dropout", "--pp-sends", "scatter-gather"]
# BLOOM and MT-NLG ran DeepSpeed's pipeline engine (Megatron-DeepSpeed's GPTModelPipe): its TrainSchedule's order,
# each send and receive blocking both ranks (deepspeed/runtime/pipe/schedule.py and p2p.py, 2021; its activations
# and gradients sent 1/tp per tp rank and all-gathered, engine.py `is_pipe_partitioned`: the scatter/gather above),
# and its gradients as that engine handles them: each micro-batch's accumulated right after its backward on its
# stage (BLOOM's bf16: the BF16_Optimizer's update_hp_grads, a cast and an add into fp32; MT-NLG's fp16: autograd's
# add into the fp16 .grad) and, under bf16, all-reduced in fp32 (engine.py `_bf16_reduce_grads`, the DeepSpeed
# branch BLOOM ran: microsoft/DeepSpeed 819abe2a7, 2022-02, olruwase's bf16 work merged in #1801)
DEEPSPEED_PIPE = ["--pp-engine", "deepspeed"]
# Their ranks as DeepSpeed placed them: Megatron-DeepSpeed builds PipeModelDataParallelTopology(num_pp, num_mp,
# num_dp), axes ['pipe', 'data', 'model'] laid out row-major (deepspeed/runtime/pipe/topology.py): tp innermost,
# then dp, pp outermost. BLOOM's tp 4 puts two dp ranks of one stage on each node of 8 (parc's default, tp,pp,dp,
# would put two stages there); MT-NLG's tp 8 fills a node either way
DEEPSPEED_ORDER = "tp,dp,pp"
# Their output layer is the token embedding: GPTModelPipe lists TiedLayerSpec('embed', EmbeddingPipe, ...) first and
# last (megatron/model/gpt_model.py, microsoft/Megatron-DeepSpeed 0d887558 and the bigscience fork 4c13c617), so the
# first and last stages each hold it and the engine all-reduces its gradient between them after the pipeline
# (`_exec_reduce_tied_grads`): bench/gpt_sized.py's `tied`
# MosaicML's MPT runs (above): llm-foundry's Triton FlashAttention, FSDP's BACKWARD_POST, fp32 gradient reduction
# (Composer's "DEFAULT" mixed precision; the two older 70b A100 rows' "PURE" is their own `wire`), and its loss:
# model.loss_fn defaults to "fused_crossentropy" (llmfoundry/models/mpt/modeling_mpt.py at 3e5b9604e, mosaic_gpt.py
# at 300cc5c58; no yaml sets it), flash-attn's CrossEntropyLoss (setup.py's gpu extra installs its xentropy lib)
MOSAIC = ["--attention", "flash-triton", "--zero-prefetch", "post", "--dp-wire", "fp32", "--loss", "fused"]
# The large-scale H100 rows' sweep.py: BACKWARD_PRE, FlashAttention-2 (13b and 30b: Triton, the row's `attention`)
# as llm-foundry calls it: `flash_attn_fn` (llmfoundry/models/layers/attention.py at 5e85bd62d) unpads q, k and v
# with flash_attn's bert_padding.unpad_input (an all-ones mask when the batch has none), runs
# flash_attn_varlen_func and pads the output back with pad_input: `--attention flash-unpad`; the fused loss as above
# (modeling_mpt.py at 5e85bd62d: loss_fn defaults to "fused_crossentropy" and raises when flash_attn's
# CrossEntropyLoss cannot be imported, so the runs had it: flash-attn 2.4.2's own, the gpu-flash2 extra installing no
# xentropy lib; it keeps the logits and a log-sum-exp a row, its gradient in the logits' dtype)
MOSAIC_LARGE = ["--attention", "flash-unpad", "--dp-wire", "fp32", "--loss", "fused"]
# The A100 40GB rows: MOSAIC's kernels, prefetch and loss (mosaic_gpt.py at c4f8c7540: "fused_crossentropy", its
# setup.py's gpu extra installing xentropy-cuda-lib), Composer's PURE: gradients reduced in bf16
MOSAIC_PURE = MOSAIC + ["--dp-wire", "bf16"]   # the last --dp-wire wins
FLAGS = {MEGATRON: (0, OLD_MEGATRON + ["--dp-wire", "fp16"], ""),
         BLOOM: (1, OLD_MEGATRON + DEEPSPEED_PIPE + ["--dp-wire", "fp32", "--nics", "4"], " inter=12.5GB/s"),
         MTNLG: (1, OLD_MEGATRON + DEEPSPEED_PIPE + ["--dp-wire", "fp16"], ""),
         TITAN_A100: (3, ["--nics", "4"], " inter=12.5GB/s"),
         TITAN_H100: (3, [], ""),
         MPT_H100: (3, MOSAIC, ""),
         MPT_A100: (3, MOSAIC, ""),
         MPT_H100_LARGE: (3, MOSAIC_LARGE, ""),
         MPT_A100_40: (3, MOSAIC_PURE, ""),
         AUTOMODEL_H100: (3, ["--dp-wire", "bf16"], "")}


@dataclass(frozen=True)
class Row:
    name: str
    source: str
    arch: str              # "gpt" (layers, hidden, heads, vocab, seq) or "llama" (layers, dim, heads, kv, ffn, vocab, seq)
    shape: tuple
    tp: int
    pp: int
    gpus: int
    batch: int
    micro: int
    published: float       # per GPU: TFLOP/s (the source's count) or tokens/s, as `unit`
    unit: str              # "TFLOP/s" or "tokens/s"
    preset: str
    recompute: str = "blocks.*"   # the .par's recompute patterns, space-separated ("" none)
    fused_norm: bool = False      # llama: torchtitan's norm_type "fused_rmsnorm" (else its unfused "rmsnorm")
    saves: str = ""               # op-level checkpointing in the recomputed regions (`--recompute-saves`)
    virtual: int = 1              # virtual stages a pp rank (the interleaved 1F1B schedule when > 1)
    dp_overlap: bool = True       # dp's gradient reduction under the backward (else after it: `--no-dp-overlap`)
    tied: bool = False            # gpt: the output layer tied to the token embedding (bench/gpt_sized.py's `tied`)
    wire: str = ""                # the row's own gradient wire dtype (`--dp-wire`), over its source's
    cp: int = 1                   # context parallel ranks (`mesh ... cp=N`: each sequence split over them)
    zero: int | None = None       # the row's own ZeRO stage, over its source's (`FLAGS`)
    attention: str = ""           # the row's own attention kernel (`--attention`), over its source's
    cuts: tuple = ()              # the pipeline's stages as the source cut them (`cut after` each path), else auto
    sp: bool = False              # under tp: Megatron's sequence parallelism (`sequence_parallel`)
    fused_ops: bool = False       # llama: rotary and SwiGLU one kernel each (Transformer Engine's; inductor's)
    precision: str = "bf16"       # the plan's `precision` (16-bit compute over fp32 masters: bf16, or fp16)
    order: str = ""               # the mesh's rank placement (`mesh ... order=`, inner to outer), else parc's default
    variant: tuple = ()           # llama: bench/llama_sized.py's other fields (Nemotron-4's layernorm, relu2, half_rotary)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the row ran: its own, else its source's."""
        return FLAGS[self.source][0] if self.zero is None else self.zero

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the GPUs over tp × pp × cp."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def params(self) -> float:
        """Parameters of the model (the trend's x axis)."""
        if self.arch == "gpt":
            layers, h, _, vocab, seq = self.shape
            return 12 * layers * h * h + (vocab + seq) * h
        layers, d, heads, kv, ffn, vocab, _ = self.shape
        mlp = 2 if "relu2" in self.variant else 3   # squared-ReLU has no gate: w1 and w2 only
        return layers * (2 * d * d + 2 * d * kv * (d // heads) + mlp * d * ffn) + 2 * vocab * d


def _gpt(name, source, shape, tp, pp, gpus, batch, micro, tflops, virtual=1, dp_overlap=False):
    """A row of Megatron's GPT (Megatron-LM's, and Megatron-DeepSpeed's GPTModelPipe for BLOOM and MT-NLG: see
    DEEPSPEED_ORDER's comment). Its output layer is the word embedding's weight (megatron/model/gpt_model.py's logits
    from `word_embeddings_weight()`), and with pp > 1 the first and last stages' copies have their gradients
    all-reduced once a step (megatron/training.py `train_step`: "All-reduce word_embeddings' grad across first and
    last stages"): bench/gpt_sized.py's `tied`."""
    return Row(name, source, "gpt", shape, tp, pp, gpus, batch, micro, tflops, "TFLOP/s", "a100",
               virtual=virtual, dp_overlap=dp_overlap, tied=True)


LLAMA3_8B = (32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA3_70B = (80, 8192, 64, 8, 28672, 128256, 8192)
LLAMA2_13B = (40, 5120, 40, 40, 13824, 32000, 4096)
LLAMA2_70B = (80, 8192, 64, 8, 28672, 32000, 4096)
# torchtitan's selective layer AC: the 2nd, 4th, ... layer (its _count % 2 == 0), i.e. the odd layer indices, as two
# globs (space-separated: one quoted pattern each in the .par). A glob's `*` also matches dots, so one pattern
# "layers.*[13579]" would also take every layer's `feed_forward.w1` and `w3` (names ending in an odd digit) as
# recomputed modules of their own: 45% of the other layers' matmul FLOPs recomputed that torchtitan did not
EVERY_SECOND = "layers.[13579] layers.[1-9][13579]"
# torchtitan's selective *op* AC (torchtitan/parallelisms/parallelize_llama.py at 1ea476e9f, `_custom_policy`, the
# same in later versions): each block is checkpointed with a policy that saves the outputs of aten.mm and of the
# flash / efficient attention ("Saves output of all compute ops, except every second mm": its per-block mm count
# % 2 == 0 is recomputed) and recomputes every other op. A block's mms run wq, wk, wv, wo, w1, w3, w2: wq, wv, w1
# and w2 are saved with the attention's outputs, and wk, wo, w3, the norms, rotary, SiLU and the SwiGLU product
# run again. Priced as `recompute "layers.*"` with `parc report --recompute-saves matmul-odd,attention`
# (activations.saved_ops), what those rows' `saves` field states.
OP_SAC = "layers.*"
TITAN_OP_SAVES = "matmul-odd,attention"

ROWS = [
    # name, source, (layers, hidden, heads, vocab, seq), tp, pp, gpus, global batch, micro, published TFLOP/s
    # run_table_1.sh's MBS, virtual stages (NLS / PP / --num-layers-per-virtual-pipeline-stage) and DDP=torch
    _gpt("GPT 1.7B", MEGATRON, (24, 2304, 24, 51200, 2048), 1, 1, 32, 512, 16, 137, dp_overlap=True),
    _gpt("GPT 3.6B", MEGATRON, (30, 3072, 32, 51200, 2048), 2, 1, 64, 512, 16, 138, dp_overlap=True),
    _gpt("GPT 7.5B", MEGATRON, (36, 4096, 32, 51200, 2048), 4, 1, 128, 512, 16, 142, dp_overlap=True),
    _gpt("GPT 18.4B", MEGATRON, (40, 6144, 48, 51200, 2048), 8, 1, 256, 1024, 8, 135, dp_overlap=True),
    _gpt("GPT 39.1B", MEGATRON, (48, 8192, 64, 51200, 2048), 8, 2, 512, 1536, 4, 138),
    _gpt("GPT 76.1B", MEGATRON, (60, 10240, 80, 51200, 2048), 8, 4, 1024, 1792, 2, 140, virtual=3),
    _gpt("GPT 145.6B", MEGATRON, (80, 12288, 96, 51200, 2048), 8, 8, 1536, 2304, 2, 148, virtual=2),
    _gpt("GPT 310.1B", MEGATRON, (96, 16384, 128, 51200, 2048), 8, 16, 1920, 2160, 1, 155, virtual=2),
    # micro-batch 1: pp 35 × 280 × virtual 3 and pp 64 × 512 schedule slots
    _gpt("GPT 529.6B", MEGATRON, (105, 20480, 128, 51200, 2048), 8, 35, 2520, 2520, 1, 163, virtual=3),
    _gpt("GPT 1008B", MEGATRON, (128, 25600, 160, 51200, 2048), 8, 64, 3072, 3072, 1, 163),
    # BigScience, BLOOM-176B (bigscience.notion.site "BigScience 176B Model"; Le Scao et al. 2022,
    # arXiv:2211.05100 §3.4): 384 A100-80GB on Jean Zay (48 nodes of 8, 4 × 100 Gbit/s Omni-Path per
    # node), tp 4 × pp 12 × dp 8, global batch 2048, bf16, ZeRO-1, "about 150 TFLOPs" per GPU.
    replace(_gpt("BLOOM 176B", BLOOM, (70, 14336, 112, 250880, 2048), 4, 12, 384, 2048, 2, 150),
            order=DEEPSPEED_ORDER),
    # Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990) §2.4,
    # as quoted by llm-analysis (github.com/cli99/llm-analysis, examples/megatron-turing-nlg): 105 × 20480,
    # 128 heads, sequence 2048, global batch 1920, tp 8 × pp 35 on 280 / 350 / 420 DGX A100 (Selene),
    # 60.1 / 50.2 / 44.4 s per iteration = 126 / 121 / 113 TFLOP/s per GPU (eq. 3 over those times gives
    # 125.7 / 120.4 / 113.5: the same count). Vocab: GPT-2's 50257 padded as Megatron pads (51200).
    # The paper does not state the micro-batch; the three published steps do (`fill_slots`, printed after the
    # table): a 1F1B step is (m + pp − 1) slots and the work after the last one, m = 1920 / (dp × micro), so
    # fitted against m the published steps' intercept over their slope is the pipeline's fill and drain, pp − 1
    # = 34 slots. At micro-batch 2 it is 34.3 (33.1 from the paper's seconds, 60.1 / 50.2 / 44.4); at 1 it is
    # twice that (the fill and drain paid twice, which DeepSpeed's engine does not: docs/cost-model.md (c)), at
    # 4 half; 3 does not divide dp 12's 160 sequences. Micro-batch 2.
    # fp16: DeepSpeed of the time had no bf16 (v0.5.4, 2021-10-06, the week MT-NLG was announced: neither
    # deepspeed/runtime/engine.py nor pipe/engine.py knows bfloat16; the pipeline engine allocates its buffers
    # in fp16 or fp32, `_allocate_zeros`), so the runs were fp16 under its ZeRO-1 optimizer: the gradients kept
    # and accumulated in fp16 `.grad` by autograd (`--pp-engine deepspeed` prices that accumulation)
    *(replace(_gpt("MT-NLG 530B", MTNLG, (105, 20480, 128, 51200, 2048), 8, 35, gpus, 1920, 2, tflops),
              precision="fp16", order=DEEPSPEED_ORDER)
      for gpus, tflops in ((2240, 126), (2800, 121), (3360, 113))),
    # torchtitan, 64 A100-80GB, FSDP2 over all 64 (local batch × 64 = global batch): WPS per GPU
    # the 8B and 13B configs of then (train_configs/llama3_8b.toml, llama2_13b.toml at 1ea476e9f, 2024-04-24, the
    # commit that wrote these figures) set norm_type = "fused_rmsnorm"; the 70B ones "rmsnorm"
    Row("Llama 3 8B", TITAN_A100, "llama", LLAMA3_8B, 1, 1, 64, 64, 1, 2904, "tokens/s", "a100", EVERY_SECOND, True),
    Row("Llama 3 8B", TITAN_A100, "llama", LLAMA3_8B, 1, 1, 64, 64, 1, 2973, "tokens/s", "a100", OP_SAC, True,
        TITAN_OP_SAVES),
    Row("Llama 3 70B", TITAN_A100, "llama", LLAMA3_70B, 1, 1, 64, 64, 1, 331, "tokens/s", "a100", "layers.*"),
    Row("Llama 2 13B", TITAN_A100, "llama", LLAMA2_13B, 1, 1, 64, 128, 2, 2162, "tokens/s", "a100", "", True),
    Row("Llama 2 13B", TITAN_A100, "llama", LLAMA2_13B, 1, 1, 64, 128, 2, 1914, "tokens/s", "a100", EVERY_SECOND, True),
    Row("Llama 2 13B", TITAN_A100, "llama", LLAMA2_13B, 1, 1, 64, 128, 2, 1904, "tokens/s", "a100", OP_SAC, True,
        TITAN_OP_SAVES),
    # the page's footnote: selective op AC at local batch 2 ran out of memory, so its row is local batch 1
    Row("Llama 2 70B", TITAN_A100, "llama", LLAMA2_70B, 1, 1, 64, 64, 1, 355, "tokens/s", "a100", OP_SAC,
        saves=TITAN_OP_SAVES),
    Row("Llama 2 70B", TITAN_A100, "llama", LLAMA2_70B, 1, 1, 64, 128, 2, 353, "tokens/s", "a100", "layers.*"),
    # torchtitan, Llama 3.1 8B (Llama 3's shape), FSDP over 8 and over 128 H100s, local batch 2: TPS per GPU
    Row("Llama 3.1 8B", TITAN_H100, "llama", LLAMA3_8B, 1, 1, 8, 16, 2, 5762, "tokens/s", "h100_hbm2e", OP_SAC,
        saves=TITAN_OP_SAVES),
    Row("Llama 3.1 8B", TITAN_H100, "llama", LLAMA3_8B, 1, 1, 128, 256, 2, 5605, "tokens/s", "h100_hbm2e", OP_SAC,
        saves=TITAN_OP_SAVES),
]

# The same paper's Table 2 ("Comparison of PTD Parallelism to ZeRO-3 (without model parallelism)", §5.2), its PTD
# Parallelism rows: "174.6" B at model-parallel size 96, batch 1536, micro-batch 1 on 384 / 768 / 1536 GPUs: 153 /
# 149 / 141 teraFLOP/s per GPU; "529.6" B at model-parallel size 280, batch 2240, micro-batch 1 on 560 / 1120 /
# 2240 GPUs: 171 / 167 / 159. The shapes: "the standard GPT-3 model architecture" (96 layers × 12288, 96 heads: the
# 174.6B of eq. 2) and "the 530-billion-parameter model from Table 1" (105 × 20480, 128 heads); sequence 2048, vocab
# 51200 and the throughput's count (eq. 3) as Table 1's. Model-parallel size 96 = tp 8 × pp 12 and 280 = tp 8 × pp 35
# (tp 8 within a DGX node, Table 1's rule and its 530B's pp 35). What the table does not state is inferred from the
# authors' own scripts at the same shape (examples/sc21/, as Table 1's rows above), not from the table: the 175B on pp
# 12 as run_figure_12.sh and run_figure_18.sh run it (`--num-layers-per-virtual-pipeline-stage 2`: 96 / 12 / 2 = 4
# virtual stages, DDP=local), the 530B as run_table_1.sh's 530B case (1 layer a virtual stage: 3 virtual stages,
# DDP=local). §5.1 states "we use the interleaved pipeline schedule with the scatter/gather optimization enabled"
# for Table 1 only. The interleaved schedule needs the micro-batches a pipeline (1536 / dp, 2240 / dp) to be a
# multiple of pp, which every row's are. Priced as Table 1 (its `FLAGS`: fp16 wire, scatter/gather sends,
# materialised attention with dropout; Megatron's own DDP: its all-reduce after the backward). The 529.6B on 560 GPUs
# runs 1120 micro-batches a pipeline at dp 2: pp 35 × virtual 3 × 1120 = 117,600 schedule slots (grammar/validate.py's
# MAX_SCHEDULE_SLOTS, 262,144, was 65,536 until this row showed a published plan beyond it).
# The table's ZeRO-3 rows are DeepSpeed's ZeRO-3 of early 2021, not parc's runtime, and no `parc report` flag
# describes that implementation: they are not rows (bench/megatron_figures.py prices them for comparison).
MEGATRON_T2 = "Megatron-LM 2021 Table 2"
FLAGS[MEGATRON_T2] = FLAGS[MEGATRON]
GPT3_175B = (96, 12288, 96, 51200, 2048)
GPT_530B = (105, 20480, 128, 51200, 2048)
TABLE_2 = [_gpt("GPT 174.6B", MEGATRON_T2, GPT3_175B, 8, 12, gpus, 1536, 1, tflops, virtual=4)
           for gpus, tflops in ((384, 153), (768, 149), (1536, 141))] + \
          [_gpt("GPT 529.6B", MEGATRON_T2, GPT_530B, 8, 35, gpus, 2240, 1, tflops, virtual=3)
           for gpus, tflops in ((560, 171), (1120, 167), (2240, 159))]
_END_OF_TABLE_1 = max(i for i, r in enumerate(ROWS) if r.source == MEGATRON) + 1
ROWS[_END_OF_TABLE_1:_END_OF_TABLE_1] = TABLE_2   # read beside Table 1; `--rows 10` is still Table 1

MPT_SHAPES = {"1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40),
              "30b": (48, 7168, 56), "70b": (80, 8192, 64)}   # n_layers, d_model, n_heads (the yamls above)


MPT_PRESETS = {MPT_H100: "h100", MPT_A100: "a100", MPT_H100_LARGE: "h100", MPT_A100_40: "a100_40gb"}


def _mpt(source, size, seq, gpus, micro, accum, batch, tokens, ckpt, wire="", zero=None, attention=""):
    """One row of MosaicML's tables: model, SeqLen, # GPUs, MicroBatchSize, GradAccum, GlobalBatchSize,
    Throughput (T/s/GPU), Activation Checkpointing; FULL_SHARD over all the GPUs (`zero=2`: SHARD_GRAD_OP), on its
    table's GPU (`MPT_PRESETS`)."""
    if gpus * micro * accum != batch:
        raise ValueError(f"MPT {size} seq {seq}: {gpus} GPUs × micro {micro} × accum {accum} != global {batch}")
    layers, d, heads = MPT_SHAPES[size]
    return Row(f"MPT {size.upper()} s{seq}", source, "gpt", (layers, d, heads, 50368, seq), 1, 1, gpus, batch, micro,
               tokens, "tokens/s", MPT_PRESETS[source], "blocks.*" if ckpt else "", tied=True, wire=wire, zero=zero,
               attention=attention)


T, F = True, False
ROWS += [_mpt(MPT_H100, *r) for r in [
    # model, SeqLen, # GPUs, MicroBatchSize, GradAccum, GlobalBatchSize, T/s/GPU, Activation Checkpointing
    ("70b", 2048, 64, 8, 4, 2048, 1039, T), ("70b", 2048, 32, 2, 16, 1024, 882, T),
    ("30b", 8192, 8, 1, 21, 168, 1384, T), ("30b", 4096, 8, 1, 21, 168, 1802, T),
    ("30b", 2048, 32, 14, 3, 1344, 2308, T), ("30b", 2048, 16, 10, 3, 480, 2263, T),
    ("30b", 2048, 8, 3, 21, 504, 2002, T), ("30b", 1024, 8, 6, 21, 1008, 2084, T),
    ("13b", 32768, 8, 1, 3, 24, 1976, T), ("13b", 16384, 8, 3, 3, 72, 2985, T), ("13b", 4096, 8, 10, 3, 240, 4717, T),
    ("13b", 2048, 64, 2, 1, 128, 4800, F), ("13b", 2048, 32, 2, 1, 64, 4811, F), ("13b", 2048, 16, 2, 1, 32, 4767, F),
    ("13b", 2048, 8, 2, 1, 16, 4792, F), ("13b", 1024, 8, 40, 3, 960, 5502, T),
    ("7b", 65536, 8, 1, 2, 16, 1956, T), ("7b", 32768, 8, 2, 2, 32, 3318, T), ("7b", 8192, 8, 8, 2, 128, 6935, T),
    ("7b", 4096, 8, 16, 2, 256, 8611, T), ("7b", 2048, 8, 6, 1, 48, 10643, F), ("7b", 1024, 8, 64, 2, 1024, 10203, T),
    ("3b", 65536, 8, 1, 2, 16, 3262, T), ("3b", 32768, 8, 3, 6, 144, 5873, T), ("3b", 16384, 8, 1, 6, 48, 11152, F),
    ("3b", 8192, 8, 3, 6, 144, 16578, F), ("3b", 4096, 8, 5, 6, 240, 20964, F), ("3b", 2048, 64, 6, 3, 1152, 22525, F),
    ("3b", 2048, 32, 6, 3, 576, 23021, F), ("3b", 2048, 16, 10, 3, 480, 24142, F), ("3b", 1024, 8, 20, 6, 960, 27046, F),
    ("3b", 512, 8, 40, 6, 1920, 27965, F),
    ("1b", 65536, 8, 1, 2, 16, 5506, T), ("1b", 32768, 8, 1, 4, 32, 12025, F), ("1b", 16384, 8, 2, 4, 64, 19649, F),
    ("1b", 8192, 8, 3, 4, 96, 29157, F), ("1b", 4096, 8, 7, 4, 224, 38535, F), ("1b", 2048, 64, 20, 1, 1280, 44402, F),
    ("1b", 2048, 32, 20, 1, 640, 45130, F), ("1b", 2048, 16, 20, 1, 320, 46037, F), ("1b", 2048, 8, 14, 1, 112, 45455, F),
    ("1b", 1024, 8, 18, 4, 576, 48910, F), ("1b", 512, 8, 56, 4, 1792, 52275, F)]]
ROWS += [_mpt(MPT_A100, *r) for r in [
    ("70b", 2048, 64, 8, 4, 2048, 410, T, "bf16"), ("70b", 2048, 32, 2, 16, 1024, 373, T, "bf16"),
    ("30b", 8192, 8, 1, 21, 168, 574, T), ("30b", 4096, 8, 1, 21, 168, 814, T), ("30b", 2048, 8, 3, 21, 504, 916, T),
    ("30b", 1024, 8, 6, 21, 1008, 946, T), ("30b", 512, 8, 12, 21, 2016, 967, T),
    ("13b", 32768, 8, 1, 3, 24, 1016, T), ("13b", 16384, 8, 3, 3, 72, 1431, T), ("13b", 8192, 8, 5, 3, 120, 1795, T),
    ("13b", 4096, 8, 10, 3, 240, 2060, T), ("13b", 2048, 8, 2, 3, 48, 2262, F), ("13b", 1024, 8, 40, 3, 960, 2330, T),
    ("7b", 65536, 8, 1, 2, 16, 1013, T), ("7b", 32768, 8, 2, 2, 32, 1672, T), ("7b", 16384, 8, 4, 2, 64, 2453, T),
    ("7b", 8192, 8, 8, 2, 128, 3206, T), ("7b", 4096, 8, 16, 2, 256, 3684, T), ("7b", 2048, 8, 6, 2, 96, 4641, F),
    ("7b", 1024, 8, 64, 2, 1024, 4357, T),
    ("3b", 65536, 8, 1, 2, 16, 1767, T), ("3b", 32768, 8, 3, 6, 144, 3029, T), ("3b", 16384, 8, 1, 6, 48, 5529, F),
    ("3b", 8192, 8, 3, 6, 144, 7695, F), ("3b", 4096, 8, 5, 6, 240, 9457, F), ("3b", 2048, 8, 10, 2, 160, 10811, F),
    ("3b", 1024, 8, 20, 6, 960, 11580, F), ("3b", 512, 8, 40, 6, 1920, 12127, F),
    ("1b", 65536, 8, 1, 2, 16, 3044, T), ("1b", 32768, 8, 1, 4, 32, 6275, F), ("1b", 16384, 8, 2, 4, 64, 9956, F),
    ("1b", 8192, 8, 3, 4, 96, 13814, F), ("1b", 4096, 8, 7, 4, 224, 17807, F), ("1b", 2048, 8, 14, 4, 448, 20513, F),
    ("1b", 1024, 8, 18, 4, 576, 22112, F), ("1b", 512, 8, 56, 4, 1792, 23148, F)]]
TRITON, SGO = {"attention": "flash-triton"}, {"zero": 2}   # attn_impl triton; SHARD_GRAD_OP
ROWS += [_mpt(MPT_H100_LARGE, *r, **kw) for *r, kw in [
    ("70b", 2048, 512, 8, 1, 4096, 1007, T, {}), ("70b", 2048, 256, 8, 1, 2048, 1035, T, {}),
    ("70b", 2048, 128, 8, 1, 1024, 1058, T, {}),
    ("30b", 2048, 512, 8, 1, 4096, 2115, T, TRITON), ("30b", 2048, 256, 8, 1, 2048, 2148, T, TRITON),
    ("30b", 2048, 128, 8, 1, 1024, 2199, T, TRITON),
    ("13b", 2048, 512, 16, 1, 8192, 4952, T, TRITON), ("13b", 2048, 256, 16, 1, 4096, 4989, T, TRITON),
    ("13b", 2048, 128, 16, 1, 2048, 5080, T, TRITON),
    ("7b", 2048, 512, 6, 1, 3072, 9670, F, {}), ("7b", 2048, 256, 6, 1, 1536, 10119, F, {}),
    ("7b", 2048, 128, 6, 1, 768, 10475, F, {}),
    ("3b", 2048, 512, 8, 1, 4096, 21664, F, SGO), ("3b", 2048, 256, 8, 1, 2048, 22772, F, SGO),
    ("3b", 2048, 128, 8, 1, 1024, 23422, F, SGO),
    ("1b", 2048, 512, 12, 1, 6144, 39837, F, SGO), ("1b", 2048, 256, 12, 1, 3072, 42555, F, SGO),
    ("1b", 2048, 128, 12, 1, 1536, 44123, F, SGO)]]
ROWS += [_mpt(MPT_A100_40, *r) for r in [
    ("70b", 2048, 128, 4, 1, 512, 376, T), ("70b", 2048, 64, 2, 1, 128, 276, T), ("30b", 2048, 128, 6, 1, 768, 865, T),
    ("30b", 2048, 32, 4, 1, 128, 857, T), ("13b", 8192, 8, 1, 16, 128, 1407, T), ("13b", 4096, 8, 2, 16, 256, 1603, T),
    ("13b", 2048, 128, 16, 1, 2048, 1972, T), ("13b", 2048, 64, 16, 1, 1024, 1976, T),
    ("13b", 2048, 32, 14, 1, 448, 1998, T), ("13b", 2048, 16, 10, 1, 160, 1993, T),
    ("13b", 2048, 8, 4, 16, 512, 1668, T), ("13b", 1024, 8, 8, 16, 1024, 1727, T),
    ("13b", 512, 8, 16, 16, 2048, 1763, T), ("7b", 16384, 8, 1, 4, 32, 2249, T), ("7b", 8192, 8, 3, 4, 96, 2887, T),
    ("7b", 4096, 8, 6, 4, 192, 3366, T), ("7b", 2048, 128, 18, 1, 2304, 3623, T),
    ("7b", 2048, 64, 18, 1, 1152, 3665, T), ("7b", 2048, 32, 18, 1, 576, 3725, T),
    ("7b", 2048, 16, 16, 1, 256, 3645, T), ("7b", 2048, 8, 12, 4, 384, 3679, T), ("7b", 1024, 8, 24, 4, 768, 3854, T),
    ("7b", 512, 8, 48, 4, 1536, 3895, T), ("3b", 32768, 8, 1, 4, 32, 2955, T), ("3b", 16384, 8, 2, 8, 128, 4465, T),
    ("3b", 8192, 8, 1, 8, 64, 7149, F), ("3b", 4096, 8, 2, 8, 128, 8777, F), ("3b", 2048, 128, 6, 1, 768, 9538, F),
    ("3b", 2048, 64, 6, 1, 384, 9736, F), ("3b", 2048, 32, 6, 1, 192, 9914, F), ("3b", 2048, 16, 5, 1, 80, 9750, F),
    ("3b", 2048, 8, 5, 8, 320, 10065, F), ("3b", 1024, 8, 10, 8, 640, 10731, F), ("3b", 512, 8, 20, 8, 1280, 11324, F),
    ("1b", 32768, 8, 1, 4, 32, 5095, T), ("1b", 16384, 8, 1, 8, 64, 9715, F), ("1b", 8192, 8, 2, 8, 128, 13474, F),
    ("1b", 4096, 8, 4, 8, 256, 16856, F), ("1b", 2048, 128, 10, 1, 1280, 18647, F),
    ("1b", 2048, 64, 10, 1, 640, 19001, F), ("1b", 2048, 32, 10, 1, 320, 15555, F),
    ("1b", 2048, 16, 8, 1, 128, 19085, F), ("1b", 2048, 8, 8, 8, 512, 19271, F),
    ("1b", 1024, 8, 16, 8, 1024, 20959, F), ("1b", 512, 8, 32, 8, 2048, 21782, F)]]

# NeMo AutoModel, Llama 3.1 70B on 64 H100s, FSDP2 (ZeRO-3) over dp 32 × cp 2. Checkpointing under enable_compile
# (DefaultParallelizationStrategy.parallelize at 2013a4dd6): each layer's self_attn and mlp wrapped apart
# (NO_REENTRANT), the norms and residual adds not: `recompute "layers.*.attention" "layers.*.feed_forward"`
# (bench/llama_sized.py's names for them). Each decoder layer compiled by torch.compile, so its fp32 RMSNorm
# (BackendConfig rms_norm torch_fp32) runs as one generated kernel: priced as the one-kernel norm (`fused_norm`), not
# as the op-by-op eager one, and for the same reason its rotary and SwiGLU products as one kernel each (`fused_ops`)
AUTOMODEL_AC = "layers.*.attention layers.*.feed_forward"
ROWS += [Row("Llama 3.1 70B", AUTOMODEL_H100, "llama", LLAMA3_70B, 1, 1, 64, 128, 1, 866.77, "tokens/s", "h100",
             AUTOMODEL_AC, True, cp=2, fused_ops=True)]

# Llama Team, AI @ Meta, "The Llama 3 Herd of Models" (Dubey et al. 2024, arXiv:2407.21783). Table 4 ("Scaling
# configurations and MFU for each stage of Llama 3 405B pre-training"): GPUs, TP, CP, PP, DP, sequence, batch size /
# DP, tokens / batch, TFLOPs/GPU, BF16 MFU: 8,192 8 1 16 64 8,192 32 16M 430 43%; 16,384 8 1 16 128 8,192 16 16M 400
# 41%; 16,384 8 16 16 8 131,072 16 16M 380 38%. (The third row's DP is 4 in arXiv v1 and 8 in v3: 8 is the one its own
# GPUs, 8·16·16·8 = 16,384, and its tokens, 8 × 16 × 131,072 = 16.8M, agree with.) Table 3, the 405B: 126 layers,
# model dimension 16,384, FFN 53,248, 128 heads, 8 key/value heads, vocabulary "128,000" (the released tokenizer's
# 128,256, the other Llama 3 rows' shape: bench/llama_sized.py). What §3.3 says of the system, as parc plan and flags:
# - §3.3.1: H100 80GB HBM3 at 700 W, 8 a server joined by NVLink, 400 Gbit/s a GPU between servers (RoCE): the h100
#   preset (8 × 50 GB/s a node). Its pods of 3,072 GPUs are joined 1:7 oversubscribed; the paper's placement keeps
#   traffic inside pods ("optimized to be aware of network topology"): not modelled.
# - §3.3.2, parallelism order [TP, CP, PP, DP] (inner to outer): parc's default order under cp (tp,cp,pp,dp), and
#   tp,pp,dp without. Tensor parallelism as Korthikanti et al. (2023) (the paper's citation), i.e. with sequence
#   parallelism: `sequence_parallel` (an inference from that citation: the text does not name it).
# - FSDP that "shards optimizer states and gradients, but for model shards we do not reshard after forward
#   computation", with "FP32 gradient accumulation during backward computation over multiple micro-batches" and
#   gradients reduce-scattered "in FP32": the weights all-gathered once a step, the gradients accumulated over the
#   micro-batches and reduce-scattered once, in fp32. parc's ZeRO-1 communicates exactly that (one fp32
#   reduce-scatter under the last micro-batch's backward, the bf16 weights all-gathered for the next forward);
#   parc's ZeRO-2 reduce-scatters every micro-batch's gradients, which this FSDP does not. `zero stage=1`,
#   `--dp-wire fp32`. (`parc compile` refuses ZeRO with virtual stages; `parc report` says so and prices it.)
# - The pipeline: an interleaved schedule with V stages a rank, "we reduce one Transformer layer each from the first
#   and the last stages ... the first model chunk on the first stage has only the embedding, and the last model chunk
#   on the last stage has only output projection and loss calculation". A first chunk left with the embedding alone
#   after one layer is taken from it is a chunk of one layer: 126 layers + the embedding's and the output's chunks =
#   128 chunks = pp 16 × V 8 (V is not printed; this is what the sentence implies). The cuts: after the embedding and
#   after every layer. Their schedule's tunable N (micro-batches run back to back on a stage) is not parc's
#   interleaved 1F1B, and their pipeline sends are asynchronous (parc's engine overlaps its sends with compute too).
# - Micro-batch: not stated; 1 sequence (the batch / DP is then M = 32, 16 and 16 micro-batches a pipeline, the M
#   of the paper's bubble (PP − 1) / (V·M)), an assumption.
# - "we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing": no recompute at 8K;
#   none stated at 128K either (none here). The attention: flash (2024; parc's default). Context parallelism:
#   "we first all-gather the key (K) and value (V) tensors, and then compute attention output for the local query
#   (Q) tensor chunk", "the communicated K and V tensors are much smaller than Q tensor due to the use of GQA":
#   `--cp-attention allgather` (K and V at their 8 kv heads, 1 a tp rank, in bf16; the backward, not described,
#   priced as gathering them again and reduce-scattering dK, dV). Priced as parc's own ring instead (the kv heads
#   repeated to a tp rank's 16 query heads, fp32 blocks), the 128K row's cp traffic is 32× the bytes: 15.5 s of a
#   28.0 s step, −45% (docs/cost-model.md (c)).
# - TFLOPs/GPU = BF16 MFU × 989 (the H100's dense bf16 peak: 43% × 989 = 425, 41% → 405, 38% → 376, the table's
#   430 / 400 / 380 rounded), MFU as Chowdhery et al. (2023) count model FLOPs (the paper's citation):
#   `palm_flops`, 6N + 12·L·H·Q·T a token. Whether Meta's count took the causal (or document) mask's half of the
#   attention is not said: at 8K the attention term is 8% of the count, at 128K 57%, so the third row's published
#   figure is uncertain by up to that much.
LLAMA3 = "Llama 3 405B (Dubey et al. 2024)"
FLAGS[LLAMA3] = (1, ["--dp-wire", "fp32", "--cp-attention", "allgather"], "")
LLAMA3_405B = (126, 16384, 128, 8, 53248, 128256, 8192)
LLAMA3_405B_CUTS = ("tok_embeddings",) + tuple(f"layers.{i}" for i in range(126))


def _llama3(seq, gpus, cp, dp, per_dp, tflops):
    """One row of Table 4: sequence, GPUs, CP, DP, batch size / DP, TFLOPs/GPU (TP 8, PP 16 on every row)."""
    row = Row(f"Llama 3 405B s{seq}", LLAMA3, "llama", LLAMA3_405B[:-1] + (seq,), 8, 16, gpus, dp * per_dp, 1,
              tflops, "TFLOP/s", "h100", "", virtual=8, cp=cp, cuts=LLAMA3_405B_CUTS, sp=True)
    if row.dp != dp:
        raise ValueError(f"Llama 3 405B: {gpus} GPUs / (tp 8 × pp 16 × cp {cp}) = dp {row.dp}, the table says {dp}")
    return row


ROWS += [_llama3(8192, 8192, 1, 64, 32, 430), _llama3(8192, 16384, 1, 128, 16, 400),
         _llama3(131072, 16384, 16, 8, 16, 380)]

# Megatron-LM's README (NVIDIA/Megatron-LM README.md, "GPT-3 Example", the same words in its 2021 text, the one
# bigscience-workshop/Megatron-DeepSpeed forked, and at commit 0010ab748, 2024): "With full global batch size of 1536
# on 1024 A100 GPUs, each iteration takes around 32 seconds resulting in 138 teraFLOPs per GPU which is 44% of the
# theoretical peak FLOPs" (eq. 3's count over 32 s: 137.7). The script the 2021 text names for it,
# examples/pretrain_gpt3_175B.sh (at 090e141cc; 128 nodes of 8, container nvcr.io/nvidia/pytorch:20.12):
# tp 8, pp 16 (dp 8), 96 layers, hidden 12288, 96 heads, sequence 2048, micro-batch 1, global batch 1536, fp16,
# `--checkpoint-activations` (every layer recomputed), no virtual stages, Megatron's own DDP (the default then: its
# all-reduce after the backward), GPT-2's vocabulary padded to 51200: the system of the Table 1 rows above, so their
# flags. The README does not name the A100's memory: Selene's 80 GB (the SC21 paper's cluster), the a100 preset.
MEGATRON_README = "Megatron-LM README (GPT-3 175B)"
FLAGS[MEGATRON_README] = FLAGS[MEGATRON]
ROWS += [_gpt("GPT-3 175B", MEGATRON_README, (96, 12288, 96, 51200, 2048), 8, 16, 1024, 1536, 1, 138)]

# Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023, arXiv:2205.05198):
# Megatron-LM in 2022 on Selene (8 A100-80GB a node, 8 × 200 Gbit/s HDR: the a100 preset), "mixed precision",
# sequence 2048, vocabulary 51,200. Table 3, the configurations: 22B (64 heads, hidden 6144, 48 layers, tp 8, pp 1, 8
# GPUs, global batch 4, micro-batch 4), 175B (96, 12288, 96, tp 8, pp 8, 64 GPUs, batch 64, micro 1), 530B (128,
# 20480, 105, tp 8, pp 35, 280 GPUs, batch 280, micro 1) and 1T (160, 25600, 128, tp 8, pp 64, 512 GPUs, batch 512,
# micro 1); §6: "the interleaving schedule with three interleaving stages" on 175B and 530B, no data parallelism.
# Table 5, the end-to-end iteration time in seconds, "Full Recompute" / "Present Work": 22B 1.42 / 1.10, 175B
# 18.13 / 13.75, 530B 49.05 / 37.83, 1T 94.42 / 71.49; and §6.3: the 530B at 8-way data parallelism (2240 GPUs, the
# batch × 8) "increases slightly from 37.83 seconds to 39.15 seconds", with "no overlapping of gradient all-reduces
# with back-propagation". Each row's throughput is that time's: batch × 2048 tokens / seconds / GPUs.
# - "Full Recompute": every transformer layer recomputed, no sequence parallelism: `recompute "blocks.*"`.
# - "Present Work": sequence parallelism (`sequence_parallel`) and selective activation recomputation (§5): only
#   the attention's core (QK^T, softmax, its dropout, the attention over V) is recomputed, the rest of the layer
#   kept. As parc plan and flags: the attention module recomputed (`recompute "blocks.*.attn"`) with its
#   matmuls' outputs saved (`--recompute-saves matmul`: qkv and the output projection), so what runs again is
#   the attention op alone, priced by the source's `--attention materialized-dropout`.
# The system is Megatron's of the Table 1 rows above (its materialised attention, scatter/gather pipeline sends
# where tp runs without sequence parallelism, its dp all-reduce after the backward): their flags, and one more:
# by then a column-parallel linear's backward ran its input gradient's all-reduce (under sequence parallelism its
# reduce-scatter) asynchronously under the weight-gradient matmul (NVIDIA/Megatron-LM megatron/mpu/layers.py
# `LinearWithGradAccumulationAndAsyncCommunication` at cfd2e2160, 2022-04-28, the commit that added
# sequence_parallel; the all-reduce since 16c90445e, 2021-09, after the 2021 paper): `--tp-overlap backward`.
KORTHIKANTI = "Megatron-LM 2022 (Korthikanti et al.)"
FLAGS[KORTHIKANTI] = (FLAGS[MEGATRON][0], FLAGS[MEGATRON][1] + ["--tp-overlap", "backward"], FLAGS[MEGATRON][2])
SELECTIVE = "blocks.*.attn"


def _korthikanti(size, shape, pp, gpus, batch, micro, seconds, virtual=1, present=False):
    """One row of Table 5 (tp 8): the model's shape (layers, hidden, heads) and its iteration time, full recompute
    or the paper's sequence parallelism with selective recompute (`present`)."""
    layers, hidden, heads = shape
    return Row(f"GPT {size} " + ("selective + sp" if present else "full recompute"), KORTHIKANTI, "gpt",
               (layers, hidden, heads, 51200, 2048), 8, pp, gpus, batch, micro, batch * 2048 / seconds / gpus,
               "tokens/s", "a100", SELECTIVE if present else "blocks.*", saves="matmul" if present else "",
               virtual=virtual, dp_overlap=False, sp=present, tied=True)


ROWS += [_korthikanti(size, shape, pp, gpus, batch, micro, t, virtual, present)
         for size, shape, pp, gpus, batch, micro, virtual, times in [
             ("22B", (48, 6144, 64), 1, 8, 4, 4, 1, (1.42, 1.10)),
             ("175B", (96, 12288, 96), 8, 64, 64, 1, 3, (18.13, 13.75)),
             ("530B", (105, 20480, 128), 35, 280, 280, 1, 3, (49.05, 37.83)),
             ("1T", (128, 25600, 160), 64, 512, 512, 1, 1, (94.42, 71.49))]
         for present, t in zip((False, True), times)]
ROWS += [_korthikanti("530B", (105, 20480, 128), 35, 2240, 2240, 1, 39.15, virtual=3, present=True)]


def megatron_cuts(layers: int, chunks: int, prefix: str) -> tuple:
    """Megatron-core's pipeline split as `cut after` paths: layers // (pp × virtual) decoder layers a model chunk
    (megatron/core/transformer/transformer_block.py `get_num_layers_to_build`: num_layers // pp, then // virtual),
    the embedding in the first chunk and the output layer and loss in the last, counted in neither (its
    num_layers_in_first/last_pipeline_stage and account_for_* options unset: NVIDIA's recipes set none)."""
    per, rest = divmod(layers, chunks)
    if rest:
        raise ValueError(f"Megatron-core splits {layers} layers evenly: not into {chunks} chunks")
    return tuple(f"{prefix}.{per * (i + 1) - 1}" for i in range(chunks - 1))


# NVIDIA's DGX Cloud benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking), NeMo Megatron's GPT-3 175B on H100s
# in BF16: nemo_megatron/README_175b.md at 0b71cfda5 ("NeMo Megatron BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)":
# training step time 8.309 / 8.408 / 8.42 / 8.453 / 8.49 s on 128 / 256 / 512 / 1024 / 2048 H100s at global batch
# 256 / 512 / 1024 / 2048 / 4096, "nodes × 16" in configure.sh at 143b90dd9), tokens/s per GPU = 2048 × batch /
# step / GPUs (the table's throughput column over the GPUs). The run's config, gpt3_175b_hydra.yaml at 35a9aecc8 with
# configure.sh's overrides (`model.fp8=false` for BF16): Megatron-core's GPT (`mcore_gpt`, its output layer the
# embedding's: `tied`) on Transformer Engine, 96 × 12288, 96 heads, FFN 49152, sequence 2048, vocabulary GPT-2's
# 50,257 padded as Megatron pads (megatron/training/vocab_utils.py: to a multiple of make_vocab_size_divisible_by 128
# × tp 4: 50,688), tp 4, pp 8, 12 virtual stages, micro-batch 1, `sequence_parallel: true`, no activation
# checkpointing, `ub_tp_comm_overlap: true` (each tp all-gather and reduce-scatter pipelined with its linear's
# matmul: `--tp-overlap gemm`),
# `distributed_fused_adam` with `overlap_grad_sync`, `overlap_param_sync` and `grad_sync_dtype: bf16` (the optimizer
# state sharded over dp, the gradients reduce-scattered once a step under the last backward and the parameters
# gathered under the next forward: parc's ZeRO-1, `--dp-wire bf16`), `overlap_p2p_comm: true` (parc's engine
# posts its sends eagerly too), and cuDNN's fused attention: configure.sh at 0b71cfda5 (v25.02.01; the table's
# figures first appear at v25.02, 8f5cbb3) exports NVTE_FUSED_ATTN=1, Transformer Engine's FusedAttention
# (`--attention cudnn`; at v25.01, 143b90dd9, it was 0 and the table printed 8.91 s at 128 GPUs). Not priced: the
# config's dropout (hidden and attention 0.1; the traced GPT has none). The DGX Cloud H100 nodes: 8 × 400 Gbit/s
# InfiniBand (the h100 preset), taken as the cluster the table ran on.
NEMO_175B = "NVIDIA DGXC benchmarks: NeMo GPT-3 175B (H100)"
FLAGS[NEMO_175B] = (1, ["--tp-overlap", "gemm", "--dp-wire", "bf16", "--attention", "cudnn"], "")
# distributed_fused_adam's gradient buffer (`grad_sync_dtype: bf16`): each micro-batch's gradients accumulate in
# bf16, reduce-scattered in bf16 once a step, into the fp32 optimizer state: parc's `accumulate=bf16`
NEMO_PRECISION = "bf16 reduce=bf16 accumulate=bf16"
GPT3_175B_NEMO = (96, 12288, 96, 50688, 2048)
ROWS += [Row("GPT-3 175B", NEMO_175B, "gpt", GPT3_175B_NEMO, 4, 8, gpus, 2 * gpus, 1, 2048 * 2 * gpus / step / gpus,
             "tokens/s", "h100", "", virtual=12, tied=True, sp=True, precision=NEMO_PRECISION,
             cuts=megatron_cuts(96, 8 * 12, "blocks"))
         for gpus, step in ((128, 8.309), (256, 8.408), (512, 8.42), (1024, 8.453), (2048, 8.49))]


# The same repository's Llama 3.1 recipes, NeMo on H100s in BF16 (llama3.1/README_8b.md, README_70b.md and
# README_405b.md at 0b71cfda5: each table's "Training step time (seconds per step)"; tokens/s per GPU = 8192 ×
# global batch / step / GPUs). The run's config: llama3.1/llama3.1_{8b,70b,405b}.yaml at 0b71cfda5 with
# configure.sh's overrides there (the global batch scaled with the GPUs: 128 per 8 GPUs on the 8B, 128 per 64 on the
# 70B, 252 per 576 on the 405B): Megatron-core's Llama on Transformer Engine (`mcore_gpt`, rmsnorm: TE's fused
# kernel, `fused_norm`; swiglu, rope, no biases, the output layer untied), sequence 8192, micro-batch 1, no activation
# checkpointing, tp × pp × cp as the tables' headers state them (8B: 1 × 1 × 2; 70B: 4 × 4 × 2 with 5 virtual
# stages; 405B: 8 × 9 × 2 with 7), `sequence_parallel: true`, `ub_tp_comm_overlap: true` (`--tp-overlap gemm`),
# `distributed_fused_adam` with `overlap_grad_sync`, `overlap_param_sync` and `grad_sync_dtype: bf16` (parc's ZeRO-1,
# `--dp-wire bf16`), context parallelism by Transformer Engine's ring of K/V exchanges (the cp_comm_type it defaults
# to, p2p: `--cp-attention te-ring`), NVTE_FLASH_ATTN=0 and NVTE_FUSED_ATTN=1 in configure.sh (cuDNN's fused
# attention, each ring step's kernel too: `--attention cudnn`, the source's flags above), no dropout. The 405B
# table's runs on 32, 96 and 192 GPUs cut the model to 7, 21 and 42 layers: not this model, so not rows. The
# yamls' `apply_rope_fusion: true` (TE's fused RoPE) and `bias_activation_fusion: true` with `activation:
# fast-swiglu` (Megatron-core's fused SwiGLU): rotary and the SwiGLU product one kernel each (`fused_ops`,
# bench/llama_sized.py's `fused_ops`). Gradients accumulate in bf16 as NeMo's bucket keeps them
# (`NEMO_PRECISION`), and sequence parallelism keeps each layer input's slice, gathered again in the backward, as
# Megatron and parc's runtime do. Each model chunk holds Megatron-core's even share of the layers (`megatron_cuts`:
# 70B 4, 405B 2; parc's own split would balance the 70B's large output layer against them).
NEMO_LLAMA31 = "NVIDIA DGXC benchmarks: NeMo Llama 3.1 (H100)"
FLAGS[NEMO_LLAMA31] = (1, FLAGS[NEMO_175B][1] + ["--cp-attention", "te-ring"], "")
ROWS += [Row(f"Llama 3.1 {size}", NEMO_LLAMA31, "llama", shape, tp, pp, gpus, batch * gpus // per, 1,
             8192 * (batch * gpus // per) / step / gpus, "tokens/s", "h100", "", fused_norm=True, fused_ops=True,
             virtual=virtual, sp=tp > 1, cp=2, precision=NEMO_PRECISION,
             cuts=megatron_cuts(shape[0], pp * virtual, "layers") if pp > 1 else ())
         for size, shape, tp, pp, virtual, batch, per, steps in [
             ("8B", LLAMA3_8B, 1, 1, 1, 128, 8, ((8, 12.78), (16, 12.99), (32, 13.00), (64, 13.00), (128, 13.16))),
             ("70B", LLAMA3_70B, 4, 4, 5, 128, 64, ((64, 14.61), (128, 14.70), (256, 14.72), (512, 14.80),
                                                    (1024, 14.86), (2048, 14.84))),
             ("405B", LLAMA3_405B, 8, 9, 7, 252, 576, ((576, 17.50), (1152, 17.60), (2304, 17.70)))]
         for gpus, step in steps]


# The same repository's Nemotron-4 recipes, NeMo on H100s in BF16 (nemotron/README_15b.md and README_340b.md: each
# table's "Training step time (seconds per step)", first printed at 35a9aec (v24.11.1) and unchanged through
# 0b71cfda5; tokens/s per GPU = 4096 × global batch / step / GPUs). The run's config: nemotron4-{15b,340b}-synth.yaml
# with configure.sh's overrides, both at 35a9aec, the commit the tables appeared with (8f5cbb3, v25.02, later set
# the 340B's BF16 runs to cp 2 without changing the table or its header's "GA=16", which only cp 1 gives: not the
# runs the table timed). Nemotron-4 as the yamls build it: Megatron-core's GPT on Transformer Engine (`mcore_gpt`), `normalization: layernorm1p` (TE's fused LayerNorm: the
# `layernorm` variant with `fused_norm`), `activation: squared-relu` with `bias_activation_fusion: false` (the
# `relu2` variant: w2(relu(w1 x)²), its relu and square a kernel each), no biases, rotary positions on half of each
# head (`rotary_percentage: 0.5`, `apply_rope_fusion: true`: `half_rotary` with `fused_ops`), 8 query groups, the
# output layer untied, no dropout, sequence 4096, vocabulary 256,000 (nemotron_2_256k.model; a multiple of 128 × tp
# already, so unpadded).
# - 15B: 32 layers × 6144, 48 heads, FFN 24,576; tp 4, pp 1, micro-batch 4, global batch 4 a GPU (GA 4), no
#   activation checkpointing, NVTE_FUSED_ATTN=1 (taken as cuDNN's fused attention, `--attention cudnn`; the recipe
#   enables that backend without disabling FlashAttention, and which one Transformer Engine then ran is not stated:
#   priced as FlashAttention-2 instead, the rows come out 3.9 points lower at 16 and at 2,048 GPUs, docs/cost-model.md
#   (c)).
# - 340B: 96 layers × 18,432, 96 heads (head size 192, beyond the attention table's 64 and 128: priced at its
#   nearest entries), FFN 73,728; tp 8, pp 8, 12 virtual stages (one layer a model chunk: `megatron_cuts`), micro-
#   batch 1, global batch 2 a node, NVTE_FUSED_ATTN=0 (FlashAttention, `--attention flash`),
#   `activations_checkpoint_granularity: selective` (Megatron-core's checkpointed core attention: parc's
#   `recompute "layers.*.attention"` with `--recompute-saves matmul`, which also runs the rotary and the kv heads'
#   copy again: two small memory-bound ops over-counted), `overlap_p2p_comm`. Not priced:
#   `defer_embedding_wgrad_compute` (the output layer's weight gradient deferred under the pipeline's drain).
# - Both: `ub_tp_comm_overlap=True` and `sequence_parallel=True` (configure.sh; `--tp-overlap gemm`),
#   `distributed_fused_adam` with `overlap_grad_sync`, `overlap_param_sync` and `grad_sync_dtype: bf16` (parc's
#   ZeRO-1, `--dp-wire bf16`, `NEMO_PRECISION`). `cross_entropy_loss_fusion: true` is priced as the NeMo Llama 3.1
#   rows price the same option: parc's eager loss.
NEMOTRON = "NVIDIA DGXC benchmarks: NeMo Nemotron-4 (H100)"
LLAMA_SELECTIVE = "layers.*.attention"   # with saves "matmul": Megatron's selective recompute in the Llama model
FLAGS[NEMOTRON] = (1, ["--tp-overlap", "gemm", "--dp-wire", "bf16"], "")
NEMOTRON4_15B = (32, 6144, 48, 8, 24576, 256000, 4096)
NEMOTRON4_340B = (96, 18432, 96, 8, 73728, 256000, 4096)
NEMOTRON_VARIANT = ("layernorm", "relu2", "half_rotary")
ROWS += [Row("Nemotron-4 15B", NEMOTRON, "llama", NEMOTRON4_15B, 4, 1, gpus, 4 * gpus, 4, 4096 * 4 / step,
             "tokens/s", "h100", "", fused_norm=True, fused_ops=True, sp=True, precision=NEMO_PRECISION,
             attention="cudnn", variant=NEMOTRON_VARIANT)
         for gpus, step in ((16, 2.812), (32, 2.824), (64, 2.845), (128, 2.859), (256, 2.852), (512, 2.875),
                            (1024, 2.895), (2048, 2.887))]
ROWS += [Row("Nemotron-4 340B", NEMOTRON, "llama", NEMOTRON4_340B, 8, 8, gpus, gpus // 4, 1,
             4096 * (gpus // 4) / step / gpus, "tokens/s", "h100", LLAMA_SELECTIVE, saves="matmul",
             fused_norm=True, fused_ops=True, sp=True, precision=NEMO_PRECISION, attention="flash", virtual=12,
             cuts=megatron_cuts(96, 8 * 12, "layers"), variant=NEMOTRON_VARIANT)
         for gpus, step in ((128, 4.61), (256, 4.67), (512, 4.7), (1024, 4.73), (2048, 4.84))]


def recompute_label(row: Row) -> str:
    """The table's name for a row's activation checkpointing."""
    if row.recompute == SELECTIVE or (row.recompute, row.saves) == (LLAMA_SELECTIVE, "matmul"):
        return "selective (the attention's core)"
    if row.saves:
        return f"op (saves {row.saves})"
    return {"": "none", "blocks.*": "full", "layers.*": "full", EVERY_SECOND: "every 2nd layer",
            AUTOMODEL_AC: "attention and MLP of every layer"}.get(
        row.recompute, row.recompute)


def kernels_label(row: Row) -> str:
    """The table's note of the row's fused kernels (after its checkpointing)."""
    swiglu = "" if "relu2" in row.variant else ", fused SwiGLU"   # a squared-ReLU MLP has no SwiGLU to fuse
    return (", fused norm" if row.fused_norm else "") + (f", fused rotary{swiglu}" if row.fused_ops else "")


def megatron_flops(layers, hidden, vocab, seq, batch) -> float:
    """FLOPs per step as Megatron counts them (recompute included): eq. 3 of the paper."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def palm_flops(row: Row) -> float:
    """FLOPs per step as PaLM's model FLOPs count them (Chowdhery et al. 2023, arXiv:2204.02311, Appendix B):
    6N + 12·L·H·Q·T a token (N parameters, L layers, H heads of Q dims, T the sequence), the attention's score and
    value matmuls counted over the whole T × T square; no recompute."""
    layers, dim, heads, _, _, _, seq = row.shape
    return row.batch * seq * (6 * row.params + 12 * layers * dim * seq)


def source_flops(row: Row) -> float:
    """FLOPs per step as the row's source counts them for its TFLOP/s figure: Megatron's eq. 3 (the GPT rows)
    or PaLM's model FLOPs (the llama rows)."""
    if row.arch == "gpt":
        layers, hidden, _, vocab, seq = row.shape
        return megatron_flops(layers, hidden, vocab, seq, row.batch)
    return palm_flops(row)


def published_step(row: Row) -> float:
    """The step's seconds the row's published throughput implies."""
    if row.unit == "TFLOP/s":
        return source_flops(row) / (row.published * 1e12 * row.gpus)
    return row.batch * row.shape[-1] / (row.published * row.gpus)


def fill_slots(rows: list[Row], micro: int) -> float:
    """A pipeline sweep's fill and drain in slots as its published steps show them, were its micro-batch
    `micro`: a 1F1B step is (m + pp − 1) slots of one micro-batch plus the work after the last (small), with
    m = batch / (dp × micro) the micro-batches a pipeline runs; fitted as a + b·m over rows that differ only in
    dp, a / b is pp − 1 plus that work in slots. Only the rows' published figures enter, no prediction."""
    ms = [r.batch / (r.dp * micro) for r in rows]
    b = slope(ms, [published_step(r) for r in rows])
    a = sum(published_step(r) - b * m for r, m in zip(rows, ms)) / len(rows)
    return a / b


def pipeline_text(row: Row) -> str:
    """The row's `pipeline` statement: 1F1B, or interleaved with its virtual stages; stages placed by parc
    (`stages=auto`) unless the row states the source's cuts."""
    schedule = f"interleaved_1f1b stages={{}} virtual={row.virtual}" if row.virtual > 1 else "1f1b stages={}"
    if not row.cuts:
        return f"pipeline schedule={schedule.format('auto')}\n"
    cuts = "".join(f' cut after "{c}"\n' for c in row.cuts)
    return f"pipeline schedule={schedule.format(len(row.cuts) + 1)} {{\n{cuts}}}\n"


def plan_text(row: Row) -> str:
    """The row's published plan as a .par."""
    _, _, inter = FLAGS[row.source]
    zero = row.zero_stage
    cp = f" cp={row.cp}" if row.cp > 1 else ""
    order = f" order={row.order}" if row.order else ""
    return (f"mesh dp={row.dp} pp={row.pp} tp={row.tp}{cp}{order}\ntopology nodes={max(row.gpus // 8, 1)} "
            f"gpus_per_node={min(row.gpus, 8)}{inter}\nbatch global={row.batch} micro={row.micro}\n" +
            ("tensor_parallel {\n" + (TP_RULES if row.arch == "gpt" else LLAMA_TP_RULES) +
             (" sequence_parallel\n" if row.sp else "") + "}\n" if row.tp > 1 else "") +
            (pipeline_text(row) if row.pp > 1 else "") +
            (f"zero stage={zero}\n" if zero else "") +
            ("recompute " + " ".join(f'"{p}"' for p in row.recompute.split()) + "\n" if row.recompute else "") +
            f"precision {row.precision}\n")


def report_flags(row: Row) -> list[str]:
    """The `parc report` flags that state the row's system: its source's (`FLAGS`), then its own (op-level
    checkpointing, dp's reduction after the backward, its gradients' wire dtype, its attention kernel: the last
    --dp-wire and --attention win)."""
    return [*FLAGS[row.source][1], *(("--recompute-saves", row.saves) if row.saves else ()),
            *(() if row.dp_overlap else ("--no-dp-overlap",)), *(("--dp-wire", row.wire) if row.wire else ()),
            *(("--attention", row.attention) if row.attention else ())]


def model_env(row: Row) -> tuple[str, str]:
    """The environment variable and value that size the row's model file (bench/gpt_sized.py, llama_sized.py)."""
    env = "PARC_BENCH_GPT" if row.arch == "gpt" else "PARC_BENCH_LLAMA"
    fields = [f for f, on in (("fused", row.fused_norm), ("fused_ops", row.fused_ops), ("tied", row.tied)) if on]
    return env, ",".join(map(str, [*row.shape, *fields, *row.variant]))


def predict(row: Row, flags: list[str] | None = None) -> tuple[float, dict]:
    """(predicted throughput in the row's unit, the report) through `parc report`'s own code path, with the
    row's `report_flags` (or `flags`)."""
    from parc.analysis import report
    from parc.cli import parser

    env, spec = model_env(row)
    os.environ[env] = spec
    with tempfile.TemporaryDirectory() as tmp:
        par = Path(tmp) / f"{row.name.replace(' ', '_')}.par"
        par.write_text(plan_text(row))
        model = GPT_MODEL if row.arch == "gpt" else LLAMA_MODEL
        args = parser().parse_args(["report", "--model", str(model), "--plan", str(par), "--preset", row.preset,
                                    *(report_flags(row) if flags is None else flags)])
        rep = report.build_from_args(args)
    step = rep["utilization"]["step_seconds"]
    if row.unit == "TFLOP/s":
        return source_flops(row) / step / row.gpus / 1e12, rep
    return rep["utilization"]["tokens_per_step"] / step / row.gpus, rep


def ranks(xs: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks (ties at their mean rank); nan when a side is flat."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else float("nan")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def summary(results: list[tuple[Row, float]]) -> list[str]:
    """The statistics the issue's targets are stated in: mean |error|, worst row, trend with size, and the
    ordering inside each source's sweep."""
    errs = [pred / row.published - 1 for row, pred in results]
    worst = max(range(len(errs)), key=lambda i: abs(errs[i]))
    logp = [math.log10(row.params) for row, _ in results]
    lines = [f"mean |error| {sum(map(abs, errs)) / len(errs):.1%} over {len(errs)} runs from "
             f"{len({r.source for r, _ in results})} sources; mean signed error {sum(errs) / len(errs):+.1%}",
             f"worst: {results[worst][0].name} ({results[worst][0].source}, {results[worst][0].gpus} GPUs) "
             f"{errs[worst]:+.1%}; rows beyond 25%: {sum(abs(e) > 0.25 for e in errs)}"]
    if len(errs) > 2:
        lines.append(f"trend with size: signed error {slope(logp, errs):+.1%} per decade of parameters "
                     f"({min(r.params for r, _ in results) / 1e9:.1f}B to {max(r.params for r, _ in results) / 1e9:.0f}B), "
                     f"Spearman(error, size) {spearman(logp, errs):+.2f}")
    for source in dict.fromkeys(r.source for r, _ in results):
        mine = [(r, p) for r, p in results if r.source == source]
        if len(mine) >= 3:
            rho = spearman([r.published for r, _ in mine], [p for _, p in mine])
            sizes = [math.log10(r.params) for r, _ in mine]
            trend = (f"; error {slope(sizes, [p / r.published - 1 for r, p in mine]):+.1%} per decade of size"
                     if max(sizes) - min(sizes) > 0.5 else "")
            lines.append(f"Spearman(predicted, published) inside {source}: {rho:+.2f} over {len(mine)} runs{trend}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=len(ROWS))
    p.add_argument("--skip", type=int, default=0, help="start at this row")
    a = p.parse_args()
    print("| run | source | GPUs | tp × pp × dp | ZeRO | recompute | published per GPU | predicted | error | step s "
          "| bubble | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for row in ROWS[a.skip:a.rows]:
        t0 = time.time()
        pred, rep = predict(row)
        err = pred / row.published - 1
        results.append((row, pred))
        u = rep["utilization"]
        print(f"| {row.name} | {row.source} | {row.gpus} {row.preset.upper()} | {row.tp} × {row.pp} × "
              f"{row.dp}{f' (cp {row.cp})' if row.cp > 1 else ''} | {row.zero_stage} | {recompute_label(row)}"
              f"{kernels_label(row)} | "
              f"{row.published:.5g} {row.unit} | {pred:.0f} | "
              f"{err:+.0%} | {u['step_seconds']:.2f} | {u['bubble']:.0%} | "
              f"{'yes' if rep['memory']['fits'] else 'NO'} |", flush=True)
        print(f"<!-- {row.name}: traced and estimated in {time.time() - t0:.0f} s -->", file=sys.stderr)
    print()
    for line in summary(results):
        print(line)
    mtnlg = [r for r, _ in results if r.source == MTNLG]
    if len(mtnlg) >= 2:
        fills = ", ".join(f"{fill_slots(mtnlg, mb):.1f} at micro-batch {mb}" for mb in (1, 2, 4))
        print(f"MT-NLG's published steps against micro-batches a pipeline: fill and drain {fills} "
              f"(a 1F1B pipeline of {mtnlg[0].pp} stages: {mtnlg[0].pp - 1}); the rows run micro-batch {mtnlg[0].micro}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
