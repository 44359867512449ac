"""The cost model: what one step of a plan costs per rank — memory, communication, time.

Start at `estimate(plan, stats, hw)`. It is arithmetic over two inputs that never
need the passes to have run:

- `stats`, from `graph_stats(traced, plan)`: per pipeline stage, the forward FLOPs,
  parameter and activation element counts of ONE micro-batch, each split into the
  part tensor parallelism divides by tp ("sharded": modules matched by a column,
  row or vocab rule, and the attention/MLP core between a column and a row
  module) and the part every tp rank holds ("replicated"); the tp collectives'
  message sizes; the values crossing each pipeline cut. The compiler stores it in
  plan.json's `costs.graph`, so `parc report compiled/` does not trace again.
- `hw`, a `Hardware` preset (A100-80GB, H100, H200 nodes); the plan's `topology`
  intra=/inter= override its bandwidths (both are per GPU, one direction).

Memory follows docs/design.md's table as the runtime holds it (fp32 4Ψ/4Ψ/8Ψ; bf16 adds a
2Ψ bf16 compute copy beside the 4Ψ fp32 masters, see docs/precision.md; ZeRO-1 ÷dp the
optimizer and, under bf16, the fp32 masters (the whole bf16 copy stays: 6 + 12/N bytes per
parameter); ZeRO-2 the grads too; ZeRO-3 the bf16 copy too, keeping no whole weight;
`accumulate=bf16`: ZeRO-1/2's gradients 2 bytes, 2 + 2 + 12/N and 2 + 14/N).
Activations: what autograd saves is estimated as every non-view value the forward
makes; `recompute` keeps only each recomputed module's input, plus one module's
values while it is recomputed (under `compile` with tp, also the module's collectives'
outputs: parc/analysis/activations.py); the logits' gradient is a transient peak on the
loss's stage; another system's attention (`System.attention`) adds what it keeps beyond the
flash kernel: a materialised one its probabilities, an unpadded one its padded output
(`_attention_kept`). Times: compute per operation (parc/analysis/compute.py: efficiency
tables by matmul shape and for attention, memory-bound ops by kind, measured or
bytes over bandwidth;
FLOPs × `achievable` for a preset without tables); a ring all-reduce moves
2(n−1)/n·S per rank, a tree 2·S with log₂n latency steps; a group across nodes
runs over as many NICs as it has ranks on a node, shared with the axis's other groups when a
node has fewer NICs than GPUs; a tp group across nodes holds them while it runs, so dp's collectives across
nodes hide under compute only, not under tp's time. The pipeline is timed as
`parc.passes.simulate` times it (`parc.analysis.schedules.timing`) with each stage's own costs (another
engine's run, `System.pp_engine`: that engine's order under its transfer rules). Assumed, and said in the
report's notes: the precision layout's bytes, plain dp's bucket all-reduces
overlapping the last backward, ZeRO's overlapping the compute the runtime runs them under
(`zero_exposed`), and that what hides is not free: the compute beside a hidden collective runs slower by
the preset's `overlap_slowdown` (`beside`).
docs/cost-model.md has the sources and the validation.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase

from parc.analysis import offload_cost
from parc.errors import ParcError

GiB = 1024 ** 3


@dataclass(frozen=True)
class Hardware:
    name: str
    memory: float           # bytes per GPU
    flops: dict             # precision -> peak FLOP/s (dense)
    achievable: float       # fraction of peak a good kernel mix reaches
    intra_bw: float         # bytes/s per GPU, one direction, within a node (NVLink): a ring collective's
    inter_bw: float         # bytes/s per GPU, one direction, between nodes (network)
    gpus_per_node: int = 8
    latency_intra: float = 5e-6
    latency_inter: float = 10e-6
    intra_allreduce_bw: float = 0.0  # an all-reduce on one node's NVLink SHARP (NVLS), as bus bandwidth; 0: a ring
    # the per-operation compute model (parc/analysis/compute.py); empty tables: FLOPs × achievable
    mem_bw: float = 0.0            # bytes/s an elementwise kernel reaches (read + written)
    matmul: tuple = ()             # (dtype, m, n, k, efficiency)
    attention: tuple = ()          # (dtype, T, head size, efficiency forward, backward), causal
    attention_cudnn: tuple = ()    # the same for cuDNN's fused attention (`--attention cudnn`); empty: unmeasured
    matmul_sustained: float = 0.0  # fraction of peak a power-saturated matmul holds (MSMF); 0: no cap
    op_overhead: float = 0.0       # seconds per kernel launch / op dispatch
    async_launch: bool = True      # the host runs ahead (GPU): a kernel costs max(work, overhead)
    nics_per_node: int = 0         # network links per node, one direction each at inter_bw; 0: one per GPU
    cores: int = 0                 # CPU: cores the ranks of a host share; 0: one device per rank
    collective_overhead: float = 0.0  # seconds per collective call beyond its ring steps (calibrated gloo)
    overlap_slowdown: float = 0.0  # compute's slowdown beside a running collective (`beside`; GPU presets: presets.py)
    # calibrated on a CPU host (parc calibrate), empty/neutral for the shipped GPU presets:
    contention: float = 1.0        # compute's slowdown beyond ranks / cores when more ranks than cores compute
    collectives: tuple = ()        # (kind, group size, bytes, compute between calls s, seconds per call), measured
    optimizer_per_tensor: float = 0.0  # seconds per parameter tensor of the optimizer step beyond its bytes
    # ZeRO-Offload (parc/analysis/offload_cost.py): 0 = unpriced
    pcie_bw: float = 0.0           # bytes/s per GPU, one direction, between host and device memory
    host_mem_bw: float = 0.0       # bytes/s one rank's optimizer step reaches in host memory (its share of DRAM)
    op_overheads: tuple = ()       # (kind: mm/attn/mem/view, forward s, backward s) per op at no work (compute.py)
    mem_times: tuple = ()          # (kind, bytes, forward s, backward s) of one memory-bound op, measured (compute.py)
    p2p_post: float = 0.0          # seconds a pipeline rank spends posting a send/receive, on its own timeline
    in_step: tuple = (1.0, 1.0, 1.0)  # a step's forward, backward, optimizer in place over the tables' price
    step_overhead: tuple = (0.0, 0.0)  # seconds a step spends beyond them: per step, per micro-batch
    source: str = ""               # where the figures come from


@dataclass(frozen=True)
class System:
    """What the priced run does differently from parc's runtime: the options `parc report` takes to price a
    run of another framework (its CLI flags --attention, --pp-sends, --pp-engine, --no-dp-overlap, --zero-prefetch,
    --dp-wire, --nics, --recompute-saves, --loss), and bench/published.py's published runs through that same path. The
    default is parc's own runtime.

    - `attention`: "flash" (a fused kernel: what scaled_dot_product_attention runs on a GPU), "materialized"
      (the T × T scores written out, as Megatron and DeepSpeed did before FlashAttention, 2022), or
      "materialized-dropout" (the same with a dropout on the probabilities: Megatron's --attention-dropout), or
      "flash-triton" (FlashAttention written in Triton, slower than FlashAttention-2 by a measured ratio:
      compute.TRITON_FLASH_SLOWER; llm-foundry's attn_impl "triton", MosaicML's MPT runs), or "flash-unpad"
      (the flash kernel with flash_attn's unpad_input and pad_input around it: their gathers and scatters,
      compute.unpad_seconds, and the padded output kept beside the kernel's own; llm-foundry's attn_impl "flash"),
      or "cudnn" (cuDNN's fused attention, Transformer Engine's FusedAttention: the preset's `attention_cudnn`
      table, the H100's measured beside FlashAttention-2; NVIDIA's NeMo recipes, NVTE_FUSED_ATTN=1).
    - `pp_sends`: "whole" (every tp rank sends the whole boundary value: parc) or "scatter-gather" (each tp rank
      sends 1/tp and the receiver all-gathers it over NVLink: Megatron's scatter/gather optimisation).
    - `pp_engine`: "parc" (parc's 1F1B: each rank's adjacent sends and receives posted together, sends eager,
      transfers under the next compute) or "deepspeed" (DeepSpeed's pipeline engine: its `TrainSchedule`'s
      instruction order, each transfer blocking both ranks until it is done; `schedule.deepspeed_train`; each
      micro-batch's gradient accumulated after its backward on the stage and, under bf16, all-reduced in fp32:
      `estimate`).
    - `dp_overlap`: False for a system whose dp all-reduce (or ZeRO's collectives) waits for the whole backward.
    - `dp_wire`: the dtype of gradients on the dp wire ("fp32", "bf16", "fp16"); None: the plan's layout.
    - `nics`: network links per node (0: the preset's, one per GPU), each at the topology's `inter=`.
    - `zero_prefetch`: when ZeRO-3 gathers the next layer in the backward. "pre" (parc; PyTorch FSDP's
      BackwardPrefetch.BACKWARD_PRE): before the current layer's gradient computation, so the gather runs under
      it. "post" (FSDP's BACKWARD_POST, Composer's default): after it, "the next all-gather is reordered to be
      before the current reduce-scatter" (torch/distributed/fsdp/api.py), so the next layer's backward waits
      for its whole gather: every backward gather is exposed; the reduce-scatters still run under compute.
    - `recompute_saves`: op-level selective checkpointing inside the plan's recomputed regions: the op classes
      whose outputs the system saves in the forward (`SAVES`: "matmul", "matmul-odd", "attention";
      torchtitan's op policy is matmul-odd and attention), every other op of the region run again in the
      backward. Empty: parc's recompute, the whole region (its collectives' outputs kept under `compile`).
    - `tp_overlap`: where tp's collectives run. "none" (parc: each on its stage's timeline, between the
      matmuls), "backward" (Megatron-LM's asynchronous tensor-parallel communication, 2021–2022, Korthikanti et al.'s
      code: in the backward of a column-parallel linear the input gradient's all-reduce, or under sequence
      parallelism its reduce-scatter, runs while the weight gradient is computed, megatron/mpu/layers.py
      `LinearWithGradAccumulationAndAsyncCommunication`; priced as those collectives, every backward one
      without sequence parallelism and half with it, the row-parallel linears' all-gathers staying exposed,
      under the stage's tp-split weight-gradient matmuls, what they cannot hide exposed) or "gemm"
      (Transformer Engine's userbuffers, Megatron-core's `tp_comm_overlap` / NeMo's `ub_tp_comm_overlap`: each
      all-gather and reduce-scatter cut into chunks pipelined with its linear's matmul, forward and backward;
      priced as each pass's collectives under that pass's tp-split matmuls, `compute.tp_gemm_seconds`). What
      the overlap costs the matmuls it runs beside (SMs the communication kernels hold) is not priced.
    - `loss`: the cross-entropy's kernel. "eager" (PyTorch's, what parc runs: under autocast an fp32
      log-softmax of the logits kept for the backward, an fp32 gradient and its bf16 cast) or "fused" (one
      kernel that keeps the logits as they are and a log-sum-exp a row, and writes the gradient in the logits'
      dtype: flash-attn's xentropy, llm-foundry's default loss_fn "fused_crossentropy").
    """
    attention: str = "flash"
    pp_sends: str = "whole"
    dp_overlap: bool = True
    dp_wire: str | None = None
    nics: int = 0
    recompute_saves: tuple = ()
    pp_engine: str = "parc"
    zero_prefetch: str = "pre"
    loss: str = "eager"
    cp_attention: str = "parc"
    tp_overlap: str = "none"

    ATTENTION = ("flash", "materialized", "materialized-dropout", "flash-triton", "flash-unpad", "cudnn")
    CP_ATTENTION = ("parc", "allgather", "te-ring")
    PP_SENDS = ("whole", "scatter-gather")
    PP_ENGINES = ("parc", "deepspeed")
    ZERO_PREFETCH = ("pre", "post")
    LOSS = ("eager", "fused")
    TP_OVERLAP = ("none", "backward", "gemm")
    SAVES = ("matmul", "matmul-odd", "attention")   # activations.saved_ops
    WIRE = {"fp32": 4, "bf16": 2, "fp16": 2}

    def hardware(self, hw: "Hardware") -> "Hardware":
        """`hw` with this system's NICs per node."""
        return replace(hw, nics_per_node=self.nics) if self.nics else hw

    def estimate_options(self) -> dict:
        """The keyword arguments of `cp_cost.estimate_plan` that price this system (`cp_attention` is its own;
        the rest it passes to `estimate`)."""
        return dict(attention="materialized" if self.attention.startswith("materialized") else self.attention,
                    attention_dropout=self.attention == "materialized-dropout",
                    p2p_scatter_gather=self.pp_sends == "scatter-gather", overlap_dp=self.dp_overlap,
                    dp_bytes=self.WIRE[self.dp_wire] if self.dp_wire else None, pp_engine=self.pp_engine,
                    zero_backward_prefetch=self.zero_prefetch == "pre", cp_attention=self.cp_attention,
                    tp_overlap=self.tp_overlap)

    def notes(self) -> list[str]:
        """The report's line saying which options differ from parc's runtime (none: no line)."""
        said = [f"{f} {v}" for f, v, d in (("attention", self.attention, "flash"),
                                          ("pp sends", self.pp_sends, "whole"),
                                          ("pp engine", self.pp_engine, "parc"),
                                          ("dp overlap", "off" if not self.dp_overlap else "on", "on"),
                                          ("dp wire", self.dp_wire, None), ("NICs per node", self.nics, 0),
                                          ("recompute saves", ",".join(self.recompute_saves), ""),
                                          ("ZeRO-3 backward prefetch", self.zero_prefetch, "pre"),
                                          ("loss", self.loss, "eager"),
                                          ("cp attention", self.cp_attention, "parc"),
                                          ("tp overlap", self.tp_overlap, "none"))
                if v != d]
        return [f"priced as another system's run, not parc's runtime: {', '.join(said)}"] if said else []


# NVLink on H100s as NCCL moves data over it: NCCL's maintainer (Sylvain Jeaugey, NVIDIA/nccl-tests issue #212,
# 2024-05-06) puts the protocol's overhead at ~20% of the 450 GB/s line rate, ~370 GB/s of bus bandwidth for every
# collective but NVLink SHARP's (NVLS) all-reduce, which reaches ~480 GB/s of bus bandwidth on 8 GPUs. The A100s'
# NVLink stays at its line rate: no such figure for it was found (and the published A100 rows, docs/cost-model.md
# (c), do not show one: taken with the H100's overhead they came out 1-3 points slower). Networks at line rate.
H100_NVLINK = 370e9
H100_NVLS_ALLREDUCE = 480e9


def _gpu(name, memory, flops, intra, inter, key, nvls: float = 0.0):
    """A shipped preset: `intra` NVLink as a ring collective reaches it, per GPU, one direction; `nvls` NVLink
    SHARP's all-reduce bus bandwidth on one node (0: none, a ring)."""
    from parc.analysis.presets import TABLES

    return Hardware(name, memory, flops, 0.5, intra, inter, intra_allreduce_bw=nvls,
                    source=f"shipped preset {key} (docs/cost-model.md)", **TABLES[key])


PRESETS = {
    # NVLink 3: 600 GB/s both directions; 8 × 200 Gbit/s HDR per node. fp32 is non-tensor-core.
    "a100": _gpu("A100-80GB", 80 * GiB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 300e9, 25e9, "a100"),
    # The A100 SXM4 40GB: the same GA100 die, clocks, bf16 peak and NVLink 3 as the 80GB part, with 40 GB of HBM2 at
    # 1,555 GB/s instead of 80 GB of HBM2e at 2,039 GB/s (NVIDIA A100 datasheet); the a100's tables (none of their
    # entries is bandwidth-bound: presets.py) and network (MosaicML's A100 40GB nodes: "1600 Gbps node-node
    # interconnect (RoCE)", 8 × 25 GB/s). Memory nominal, as the a100's 80 GiB.
    "a100_40gb": _gpu("A100-40GB", 40 * GiB, {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 300e9, 25e9,
                      "a100_40gb"),
    # NVLink 4: 900 GB/s both directions; 8 × 400 Gbit/s NDR per node. Dense (no sparsity) peaks.
    "h100": _gpu("H100-80GB", 80 * GiB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, H100_NVLINK, 50e9,
                 "h100", H100_NVLS_ALLREDUCE),
    # The H100 SXM5 with 96 GB of HBM2e (2.4 TB/s) instead of HBM3 (3.35 TB/s): the same GH100 die, clocks and
    # NVLink, so the h100 matmul and attention tables; only memory-bound ops are slower. Meta's Grand Teton hosts
    # (torchtitan's H100 benchmarks: "96GB HBM2e with 2.4 TB/sec", "95 GiB memory" as the runtime sees it).
    "h100_hbm2e": _gpu("H100-96GB-HBM2e", 95 * GiB, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, H100_NVLINK,
                       50e9, "h100_hbm2e", H100_NVLS_ALLREDUCE),
    "h200": _gpu("H200-141GB", 141e9, {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, H100_NVLINK, 50e9,
                 "h200", H100_NVLS_ALLREDUCE),
}
ALIASES = {"a100-80gb": "a100", "a100-40gb": "a100_40gb", "h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200"}


def hardware(name: str | None, topology=None, *, embedded: dict | None = None) -> Hardware:
    """The preset `name` (default h100) or a preset file (`parc calibrate -o FILE`), with the plan
    topology's bandwidths when stated. `embedded`: the file's fields as a compiled/ directory's plan.json
    carries them (`costs.preset_file`), read instead of the file."""
    from parc.analysis.preset_file import as_fields, is_file, read_preset

    key = ALIASES.get((name or "h100").lower(), (name or "h100").lower())
    if key not in PRESETS and name and is_file(name):
        from dataclasses import fields

        hw = Hardware(**(as_fields(dict(embedded)) if embedded is not None else
                         read_preset(name, {f.name for f in fields(Hardware)})))
    elif key not in PRESETS:
        raise ParcError(f"unknown hardware preset `{name}`",
                        hint="valid: " + ", ".join(PRESETS))
    else:
        hw = PRESETS[key]
    if topology is not None:
        from dataclasses import replace
        # a stated NVLink bandwidth is the one every collective on a node runs at (no NVLS figure beside it)
        hw = replace(hw, intra_bw=topology.intra_bw or hw.intra_bw, inter_bw=topology.inter_bw or hw.inter_bw,
                     intra_allreduce_bw=0.0 if topology.intra_bw else hw.intra_allreduce_bw,
                     gpus_per_node=topology.gpus_per_node)
    return hw


# ---------------------------------------------------------------- from the traced graph

def _elements(val) -> int:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return sum(math.prod(v.shape) for v in vals if hasattr(v, "shape"))


def _style(path: str, rules) -> str | None:
    return _styles(path, tuple(rules))


@functools.lru_cache(maxsize=65536)
def _styles(path: str, rules: tuple) -> str | None:
    """The first rule matching `path` (memoized: the cost model asks for every node of a large graph)."""
    return next((r.style for r in rules if fnmatchcase(path, r.pattern)), None)


def _under(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def graph_stats(traced, plan, saves: tuple = (), loss: str = "eager") -> dict:
    """Per-stage counts of ONE micro-batch (elements and FLOPs, not bytes); JSON-ready.

    Reads the stage of each node from `meta["parc_stage"]` (set by
    pipeline_split.assign_stages; absent means stage 0). `saves`: another framework's op-level
    checkpointing inside the plan's recomputed regions (`System.recompute_saves`, activations.saved_ops):
    the ops whose outputs it saves are kept and not run again in the backward. `loss`: "eager" (PyTorch's
    cross-entropy, parc's) or "fused" (another framework's one-kernel loss: `System.loss`).
    """
    from parc.analysis import activations  # torch.fx: the report reads these statistics without importing torch
    from parc.passes.pipeline_split import STAGE, crossing, node_flops
    from parc.trace_sizes import bounded_nodes
    from parc.traced import module_path

    gm, rules = traced.gm, plan.tensor_parallel.rules if plan.mesh.tp > 1 else ()
    patterns = plan.recompute.patterns
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    n_stages = 1 + max((n.meta.get(STAGE, 0) for n in nodes), default=0)
    keys = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
            "params_sharded", "params_replicated", "tp_bytes", "tp_ops", "logits_elements_sharded",
            "logits_elements_replicated", "param_tensors", "zero_units", "tp_bytes_recomputed", "tp_ops_recomputed",
            "tp_bytes_regathered", "tp_ops_regathered", "tp_bytes_regathered_ahead", "tp_ops_regathered_ahead")
    stages = [dict.fromkeys(keys, 0) for _ in range(n_stages)]
    core = {p.rsplit(".", 1)[0] for p in traced.module_paths if _style(p, rules) == "column" and "." in p}
    path_of = {n: module_path(n) or "" for n in gm.graph.nodes}
    state_names = {spec.name for spec in traced.state}
    sharded_of = {}
    # a vocab-parallel head's logits, and their views, copies and dtype casts on the way to the loss outside every
    # rule's module (`cross_entropy(logits[:, :-1].contiguous().float().view(-1, V), y)`), and that cross-entropy:
    # each rank's slice, as passes/tensor_parallel.py runs them (`parc.vocab_parallel_cross_entropy`: the logits
    # are never gathered)
    logits: set = set()
    in_core: dict[str, bool] = {}   # per module path: inside a column module's parent (the sharded core)
    for n in nodes:
        p = path_of[n]
        style = _style(p, rules)
        if style is None and p not in in_core:
            in_core[p] = any(_under(p, c) for c in core)
        head = style == "vocab" and "embedding" not in str(n.target)
        sharded_of[n] = style in ("column", "row") or head or (style is None and in_core[p])
        if head or (style is None and n.args and getattr(n.args[0], "op", None) and n.args[0] in logits and (
                activations.is_alias(n) or activations.is_cast(n) or activations.is_copy(n)
                or "cross_entropy" in str(n.target))):
            logits.add(n)
            sharded_of[n] = True

    def instance_of(n):
        return plan.recompute.instance(path_of.get(n, "")) if patterns else None

    saved = activations.saved_ops(nodes, instance_of, saves) if saves and patterns else frozenset()
    tp_inputs, tp_outputs, rerun_inputs = set(), set(), set()
    for n in nodes:
        s, p = n.meta.get(STAGE, 0), path_of[n]
        d = stages[s]
        f = node_flops(n)
        tag = "sharded" if sharded_of[n] else "replicated"
        d[f"flops_{tag}"] += f
        style = _style(p, rules)
        outside = [a for a in n.all_input_nodes if (a.op == "placeholder" and a.name not in state_names)
                   or (a.op != "placeholder" and not _under(path_of[a], p))]
        if style == "column" or (style == "vocab" and "embedding" not in str(n.target)):
            tp_inputs.update((a, s) for a in outside)   # backward all-reduce of the input gradient
            if patterns and plan.recompute.instance(p) is not None:
                rerun_inputs.update(outside)                # gathered with its recomputed region's forward
        if style == "row" or (style == "vocab" and "embedding" in str(n.target)):
            tp_outputs.add((p, s))                       # forward all-reduce of the output
        if "cross_entropy" in str(n.target) and n.args:   # the loss's logits: their gradient is a transient peak
            vocab = "vocab_parallel" in str(n.target) or sharded_of.get(n.args[0])  # a vocab-parallel head's
            d["logits_elements_" + ("sharded" if vocab else "replicated")] += \
                _elements(n.args[0].meta.get("val"))
        if n.target is operator.getitem or any(v in str(n.target) for v in activations.VIEWS):
            continue
        d[f"act_{tag}"] += _elements(n.meta.get("val"))
        if patterns and plan.recompute.instance(p) is not None and n not in saved:
            d["flops_recomputed"] += f
    # sequence parallelism in an eager program gathers each column input again in the backward: kept as its
    # slice and gathered ahead (runtime/parallel/sequence_regather.py, Megatron-LM's way) or, in a recomputed
    # region, with the region's forward; a compiled graph keeps the gathered copy (runtime/recompute_policy.py)
    eager = getattr(plan, "compile", "none") == "none"
    again = plan.mesh.tp > 1 and plan.tensor_parallel.sequence_parallel and eager
    for a, s in tp_inputs:
        stages[s]["tp_bytes"] += _elements(a.meta.get("val"))
        stages[s]["tp_ops"] += 1
        if again:   # all of them; and apart, those gathered ahead (not a recomputed region's)
            for tail in ("",) if a in rerun_inputs else ("", "_ahead"):
                stages[s][f"tp_bytes_regathered{tail}"] += _elements(a.meta.get("val"))
                stages[s][f"tp_ops_regathered{tail}"] += 1
    last = {}
    for n in nodes:
        last[(path_of[n], n.meta.get(STAGE, 0))] = n
    # a recomputed region runs its forward again in the backward, its row layers' all-reduces too, unless
    # compiled: then the checkpoint policy keeps the collectives' outputs (runtime/recompute_policy.py)
    rerun = patterns and eager
    for key in tp_outputs:
        stages[key[1]]["tp_bytes"] += _elements(last[key].meta.get("val"))
        stages[key[1]]["tp_ops"] += 1
        if rerun and plan.recompute.instance(key[0]) is not None:
            stages[key[1]]["tp_bytes_recomputed"] += _elements(last[key].meta.get("val"))
            stages[key[1]]["tp_ops_recomputed"] += 1
    bf16 = plan.precision != "fp32"
    sizes = activations._dtype_sizes(gm, [n for n in nodes if n.op == "call_function"], bf16)
    kept = activations.kept_bytes(
        gm, stage_of=lambda n: n.meta.get(STAGE, 0), sharded_of=sharded_of, n_stages=n_stages,
        instance_of=instance_of, saved=saved,
        tp=plan.mesh.tp, sequence_parallel=plan.tensor_parallel.sequence_parallel, bf16=bf16,
        row_outputs=frozenset(last[key] for key in tp_outputs),
        keep_collectives=not eager,  # runtime/recompute_policy.py
        fused_loss=loss == "fused", regather=eager, sizes=sizes)
    _op_tables(nodes, stages, plan, rules, path_of, sharded_of, sizes, saved, fused_loss=loss == "fused")
    for d, k in zip(stages, kept):
        for t in ("sharded", "replicated"):
            d.update({f"kept_bytes_{t}": k[f"kept_{t}"], f"recompute_peak_bytes_{t}": k[f"peak_{t}"]})
    from parc.passes.zero import unit_of

    units: list[dict] = [{} for _ in range(n_stages)]   # ZeRO's buckets: unit → its elements on one tp rank
    ties = []   # parameters more than one stage uses (a tied embedding and lm head): their gradients are summed
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for spec in traced.state:
        if spec.kind != "param" or not spec.requires_grad:
            continue
        node = placeholders.get(spec.name)
        used = sorted({u.meta.get(STAGE, 0) for u in node.users}) if node is not None else [0]
        style = _style(spec.fqn.rsplit(".", 1)[0], rules)
        if style == "row" and spec.fqn.endswith(".bias"):
            style = None  # a row layer adds its bias after the all-reduce: every tp rank holds all of it
        sharded = style in ("column", "row", "vocab")
        if len(used) > 1:
            ties.append({"stages": used, "elements": math.prod(spec.shape), "sharded": sharded})
        for s in used or [0]:
            stages[s]["params_sharded" if sharded else "params_replicated"] += math.prod(spec.shape)
            stages[s]["param_tensors"] += 1          # the optimizer's per-tensor loop (CPU)
            unit = unit_of(spec.fqn)                  # ZeRO's buckets: one per layer or top-level module
            units[s][unit] = units[s].get(unit, 0) + math.prod(spec.shape) / (plan.mesh.tp if sharded else 1)
    for d, u in zip(stages, units):
        d["zero_units"] = len(u)
        d["zero_unit_max"] = max(u.values(), default=0)  # the largest bucket: ZeRO's in-flight working set
    sends = [sum(_elements(v.meta.get("val")) for v in cut) for cut in crossing(gm, n_stages)] \
        if n_stages > 1 else []
    tokens = math.prod(traced.inputs[0].shape[1:]) if traced.inputs else 0
    bounded = len(bounded_nodes(gm))   # sizes chosen by the data, at their upper bounds (parc/trace_sizes.py)
    return {"stages": stages, "send_elements": sends, "param_count": traced.param_count,
            "tokens_per_sample": tokens, **({"loss": loss} if loss != "eager" else {}),
            **({"tied": ties} if ties else {}),
            **({"data_dependent": bounded} if bounded else {})}


def _op_tables(nodes, stages, plan, rules, path_of, sharded_of, size, saved=frozenset(),
               fused_loss: bool = False) -> None:
    """Each stage's `ops` (parc.analysis.compute.op_table): matmul and attention shapes, memory-bound bytes.
    `size`: bytes per element of each call's output (activations._dtype_sizes). A `saved` node (op-level
    checkpointing) is not recomputed; `fused_loss`: `System.loss` "fused"."""
    from parc.analysis import compute
    from parc.passes.pipeline_split import STAGE

    bf16 = plan.precision != "fp32"
    sp = plan.mesh.tp > 1 and plan.tensor_parallel.sequence_parallel

    def size_of(a):
        val = a.meta.get("val")
        return size.get(a, val.element_size() if hasattr(val, "element_size") else 4)

    def split_of(n):
        if not sharded_of.get(n):
            return 0
        style = _style(path_of[n], rules)
        return {"column": 1, "vocab": 1, "row": 2}.get(style, 3)

    def recomputed_of(n):
        return bool(plan.recompute.patterns) and n not in saved \
            and plan.recompute.instance(path_of.get(n, "")) is not None

    mine: list[list] = [[] for _ in stages]
    for n in nodes:
        mine[n.meta.get(STAGE, 0)].append(n)
    for d, those in zip(stages, mine):
        d["ops"] = compute.op_table(those, size_of=size_of, split_of=split_of,
                                    sharded_of=lambda n: sharded_of.get(n) or sp,
                                    recomputed_of=recomputed_of, bf16=bf16, fused_loss=fused_loss)


# ---------------------------------------------------------------- the estimate

@dataclass
class Comm:
    axis: str
    collective: str
    group: int
    bytes: float          # per rank per step
    intra: float
    inter: float
    seconds: float


@dataclass
class Estimate:
    hw: Hardware
    memory: list[dict]                 # per pp rank: params, grads, optimizer, activations, total (bytes)
    comms: list[Comm]
    step_seconds: float
    compute_seconds: float
    bubble: float                      # idle share of the simulated step, P2P time included
    schedule_bubble: float             # the schedule's own idle share (free P2P): DESIGN.md's formula
    inflight: list[int]
    model_flops: float                 # per step, whole job (3 × forward, no recompute)
    hardware_flops: float              # per step, whole job, with recompute
    mfu: float
    notes: list[str] = field(default_factory=list)
    dp_exposed_seconds: float = 0.0     # dp communication not hidden behind backward
    optimizer_seconds: float = 0.0      # the optimizer step, clipping, casts (memory-bound, per step)
    p2p_exposed_seconds: float = 0.0    # what P2P time adds to the pipeline over free communication
    tp_seconds: float = 0.0             # tp collectives on the busiest rank's critical path
    ep_seconds: float = 0.0             # the experts' all-to-alls (parc/analysis/experts.py), never overlapped
    cp_seconds: float = 0.0             # context parallelism's ring or all-to-alls (parc/analysis/cp_cost.py)
    stage_seconds: list = field(default_factory=list)  # per stage: (F, B) of one micro-batch, tp on the path
    beside_seconds: float = 0.0         # what collectives hidden under compute cost it (`beside`), in the step

    @property
    def comm_seconds(self) -> float:
        """Every collective's time added up, as if none overlapped anything (can exceed the step)."""
        return sum(c.seconds for c in self.comms)

    @property
    def exposed_comm_seconds(self) -> float:
        """The part of the step communication takes: tp on the critical path, P2P beyond the schedule's
        own bubble, dp not hidden behind backward. A part of the step, so at most the step."""
        return min(self.tp_seconds + self.p2p_exposed_seconds + self.dp_exposed_seconds + self.ep_seconds
                   + self.cp_seconds, self.step_seconds)


def _bytes_per_param(precision: str, optimizer: str) -> tuple[int, int, int, int]:
    """(fp32 masters, compute copy, grads, optimizer state) bytes per parameter, as parc's runtime holds them.

    bf16 (runtime/precision.py): fp32 masters (4) and a bf16 compute copy (2) made
    each step; gradients accumulate in fp32 (4); Adam's moments are fp32 (8). fp16 is
    the same layout with fp16 copies (its loss scale is three scalars). fp32: the
    parameters are their own compute copy. docs/design.md has the table.
    """
    moments = {"adamw": 8, "adam": 8, "sgd": 0}.get(optimizer, 8)
    return 4, 2 if precision in ("bf16", "fp16") else 0, 4, moments


def _state_per_param(precision: str, pb: int, cb: int, gb: int, ob: int, z: int, k: int,
                     sharded_masters: bool) -> str:
    """The report's note on state bytes per parameter per rank, term by term as the memory rows count them
    (runtime/parallel/zero.py's table): e.g. bf16 ZeRO-1 over 8 `params 2 (bf16 weights) + 4/8 (fp32
    masters) + grads 4 (fp32) + optimizer 8/8 = 7.5`."""
    def term(b: int, sharded: bool, what: str) -> tuple[str, float]:
        return (f"{b}/{k} ({what})", b / k) if sharded and k > 1 else (f"{b} ({what})", float(b))

    params = [term(cb, False, f"{precision} weights")] if cb and z < 3 else []
    params.append(term(pb, sharded_masters, "fp32 masters" if cb else "fp32 weights"))
    grads = term(gb, z >= 2, "bf16" if gb == 2 else "fp32")
    opt = term(ob, z >= 1, "fp32")
    total = sum(v for _, v in params) + grads[1] + opt[1]
    return (f"params {' + '.join(t for t, _ in params)} + grads {grads[0]} + optimizer {opt[0]} = {total:g}")


def _ring_fraction(ranks: list[int], per_node: int) -> float:
    """Share of a ring's hops (rank order, wrapping) that leave a node."""
    if len(ranks) < 2:
        return 0.0
    hops = list(zip(ranks, ranks[1:] + ranks[:1]))
    return sum(a // per_node != b // per_node for a, b in hops) / len(hops)


def _span(group: list[int], per_node: int) -> tuple[int, int]:
    """(nodes a group spans, most of its ranks on one node)."""
    count: dict[int, int] = {}
    for r in group:
        count[r // per_node] = count.get(r // per_node, 0) + 1
    return len(count), max(count.values(), default=0)


_PLACED: dict = {}   # (id of a groups list, GPUs per node) → (the list, its `_placement`)


def _placement(groups: list[list[int]], per_node: int) -> tuple[float, int]:
    """(the largest share of a group's ring hops that leave a node, the fewest ranks a group has on one
    node) for an axis's groups; memoized per list (the planner prices one list of groups many times, and
    a 16,384-rank mesh's groups are long): held with the list, so its id names it, a few hundred at most."""
    key = (id(groups), per_node)
    held = _PLACED.get(key)
    if held is None or held[0] is not groups:
        if len(_PLACED) > 512:
            _PLACED.clear()
        crossing = max((_ring_fraction(g, per_node) for g in groups), default=0.0)
        fewest = min((_span(g, per_node)[1] for g in groups), default=0) if crossing else 0
        held = _PLACED[key] = (groups, (crossing, fewest))
    return held[1]


def beside(hw: Hardware, hidden: float) -> float:
    """Seconds `hidden` seconds of communication under compute add to the compute: a kernel sharing the GPU with a
    running collective (its SMs, its memory bandwidth) takes 1 + `hw.overlap_slowdown` times as long, so the
    `hidden` seconds it spends beside the collective do hidden / (1 + s) seconds of its work."""
    s = hw.overlap_slowdown
    return hidden * s / (1 + s) if s > 0 and hidden > 0 else 0.0


def on_step(est: "Estimate", comms: list[Comm], part: str, exposed: float | None = None) -> "Estimate":
    """`est` with `comms` charged to the step, not overlapped: their rows added, their seconds (or the `exposed`
    seconds of them the step waits for) added to the step and to `part` (the Estimate field counting that
    communication), the MFU that of the longer step."""
    seconds = sum(c.seconds for c in comms) if exposed is None else exposed
    step = est.step_seconds + seconds
    return replace(est, comms=[*est.comms, *comms], step_seconds=step, **{part: getattr(est, part) + seconds},
                   mfu=est.mfu * est.step_seconds / step if step else 0.0)


def _collective(axis, name, n, size, groups, hw, algo, latency_steps=None, calls=1, gap=0.0, nvls=True) -> Comm:
    """A collective of `size` bytes per rank on groups of `n`; volume from DESIGN.md's table.

    A group on one node runs at NVLink's `intra_bw` (an all-reduce at `intra_allreduce_bw`, NVLink SHARP's, where
    the preset has it and `nvls`: not sequence parallelism's reduce-scatter and all-gather, which are priced as
    one all-reduce of their volume). A group across nodes with r of its ranks on a
    node runs NCCL's parallel rings (channels) over r network links at once, each at `inter_bw`, and
    no faster than NVLink: the bandwidth is min(intra, links × inter); each ring step pays its hop's
    latency, the network's on the hops that leave a node (1 in r) and NVLink's on the others. The axis's groups run together
    and share a node's NICs: with fewer NICs than GPUs a group gets r × NICs / GPUs per node links.
    `calls` collectives of the group (`size` their total) each cost `hw.collective_overhead` too.
    A preset with measured `collectives` (parc calibrate, CPU) prices each call as measured at this kind and
    group size, for its share of `size` and `gap`, the rank's compute (seconds) between two calls.
    """
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n, "reduce-scatter": (n - 1) / n,
              "send/recv": 1.0}[name]
    if name == "all-reduce" and algo == "tree":
        factor = 2.0 if n > 1 else 0.0
    volume = factor * size
    crossing, fewest = _placement(groups, hw.gpus_per_node)
    if crossing:
        per_node = fewest if name != "send/recv" else 1
        # every GPU of a node is in one of the axis's groups, and they all run at once: the node's NICs
        # are shared among its gpus_per_node / per_node groups (fewer NICs than GPUs: less than one each)
        nics = hw.nics_per_node or hw.gpus_per_node
        links = min(per_node, nics * per_node / hw.gpus_per_node)
        # a ring step's latency is its hop's: `crossing` of the ring's hops leave a node, the rest are NVLink
        # hops (a dp group with all 8 GPUs of each node crosses on 1 hop in 8), so a call of many steps pays
        # the mean over the ring, as a chunk walking it does
        bw = min(hw.intra_bw, links * hw.inter_bw)
        lat = crossing * hw.latency_inter + (1 - crossing) * hw.latency_intra
    else:   # on one node: NVLink, an all-reduce on its switch (NVLS) where the preset has that figure
        nvls = nvls and name == "all-reduce" and algo == "ring" and hw.intra_allreduce_bw > 0
        bw, lat = hw.intra_allreduce_bw if nvls else hw.intra_bw, hw.latency_intra
    steps = latency_steps if latency_steps is not None else \
        (2 * math.ceil(math.log2(max(n, 2))) if algo == "tree" else 2 * (n - 1))
    rows = [r[2:] for r in hw.collectives if r[0] == name and r[1] == n] if not crossing else []
    if rows and calls >= 1:   # measured per call at this group size (parc calibrate): each call priced as measured
        seconds = calls * measured_call(rows, size / calls, gap)
    else:
        seconds = volume / bw + steps * lat + calls * hw.collective_overhead
    return Comm(axis, name, n, volume, volume * (1 - crossing), volume * crossing, seconds)


def measured_call(rows: list[tuple], size: float, gap: float = 0.0) -> float:
    """Seconds of one call of `size` bytes, `gap` seconds of compute after the previous one, from measured
    (bytes, gap, seconds) rows: every size is measured at the same few gaps (calibrate's BETWEEN: the i-th
    smallest gap of each size is one level, at their mean gap). At each level, by size (`_by_size`);
    between two levels, linear in the gap; outside them, the nearest level's (no extrapolation)."""
    by_size: dict = {}
    for b, g, t in rows:
        by_size.setdefault(b, []).append((g, t))
    for v in by_size.values():
        v.sort()
    levels = min(len(v) for v in by_size.values())
    gaps = [sum(v[i][0] for v in by_size.values()) / len(by_size) for i in range(levels)]
    at = [_by_size(sorted((b, v[i][1]) for b, v in by_size.items()), size) for i in range(levels)]
    if gap <= gaps[0]:
        return at[0]
    if gap >= gaps[-1]:
        return at[-1]
    i = max(j for j in range(levels) if gaps[j] <= gap)
    return at[i] + (at[i + 1] - at[i]) * (gap - gaps[i]) / (gaps[i + 1] - gaps[i])


def _by_size(rows: list[tuple[float, float]], size: float) -> float:
    """Seconds of one call of `size` bytes from measured (bytes, seconds) rows, sorted by bytes: linear
    between the two measured sizes around it (a call costs a fixed part plus a part per byte); below the
    smallest, the smallest's (the fixed part); beyond the largest, on along the last two's slope."""
    if len(rows) == 1 or size <= rows[0][0]:
        return rows[0][1] if size <= rows[0][0] else rows[0][1] * size / rows[0][0]
    (b0, t0), (b1, t1) = next(pair for pair in zip(rows, rows[1:]) if size <= pair[1][0] or pair[1] == rows[-1])
    return max(t0 + (t1 - t0) * (size - b0) / (b1 - b0), 0.0)


def estimate(plan, stats: dict, hw: Hardware, *, allreduce: str = "ring", groups: dict | None = None,
             params_per_rank: list[int] | None = None, p2p_scatter_gather: bool = False,
             dp_bytes: int | None = None, overlap_dp: bool = True, schedules=None, attention: str = "flash",
             attention_dropout: bool = False, pp_engine: str = "parc", zero_backward_prefetch: bool = True,
             memory_limit: float | None = None, tp_overlap: str = "none") -> Estimate:
    """`params_per_rank` (per pp rank, one tp rank's share) replaces the analytic count: the artifact's.

    `p2p_scatter_gather`: pipeline sends under tp without SP go as Megatron's scatter/gather (each
    tp rank sends 1/tp, the receiver all-gathers over NVLink); parc's runtime sends the whole value
    from every tp rank, the default. `dp_bytes`: bytes per gradient element on the dp wire (default:
    the precision layout's gradient bytes). `overlap_dp=False`: plain dp's all-reduce waits for the
    whole backward (a system without parc's bucketed overlap; the published-results script's).
    `schedules`: a `parc.analysis.schedules.Schedules` memo shared by many estimates (the planner's);
    by default each estimate builds and simulates its own. `attention`, `attention_dropout`: the
    attention kernel of the system priced (compute.stage_seconds): "flash" is what parc runs;
    "materialized" a system that writes the scores out (any before FlashAttention, 2022); "flash-triton"
    FlashAttention written in Triton (compute.TRITON_FLASH_SLOWER); "flash-unpad" the flash kernel between
    flash_attn's unpad and pad gathers (compute.unpad_seconds); "cudnn" cuDNN's fused attention (the preset's
    `attention_cudnn`). `pp_engine`:
    "deepspeed" times the pipeline as DeepSpeed's engine runs it (`System.pp_engine`); its only training
    schedule is a 1F1B, so a plan with another is refused, and it runs ZeRO-1 at most (a ZeRO-2/3 plan is
    refused). It also accumulates the gradients as that engine does, after each micro-batch's backward on its
    stage (`compute.deepspeed_accumulate_seconds`), and under bf16 its BF16_Optimizer all-reduces the fp32
    gradients (`_bf16_reduce_grads`) where parc's ZeRO-1 reduce-scatters them.
    `zero_backward_prefetch=False`: ZeRO-3's backward gathers are issued after each layer's gradient
    computation, exposed (`System.zero_prefetch` "post").
    `tp_overlap`: "none" (parc: each tp collective on the stage's timeline), "backward" (the backward's under the
    tp-split linears' weight-gradient matmuls) or "gemm" (every one under the same pass's tp-split matmuls):
    `System.tp_overlap`.
    `memory_limit` (bytes): a plan whose fullest rank needs more comes back with its memory rows only, its step
    infinite and nothing timed (a search's drop: its pipeline schedule is neither built nor simulated).
    """
    from parc import mesh as meshlib
    from parc.analysis import compute
    from parc.analysis.schedules import Schedules
    from parc.passes.schedule import deepspeed_train, peak_inflight, peak_of

    memo = schedules if schedules is not None else Schedules()
    build_schedule, simulate = memo.build, memo.simulate
    m, notes = plan.mesh, []
    dp, pp, tp = m.dp, m.pp, m.tp
    acc = plan.accumulation  # the stats are of one micro-batch already (traced at plan.micro_batch)
    stages = stats["stages"]
    virtual = plan.pipeline.virtual if plan.pipeline and pp > 1 else 1
    if len(stages) != pp * virtual:
        raise ParcError(f"cost model: {len(stages)} stage statistics for pp {pp} × virtual {virtual} stages")
    groups = groups or {a: meshlib.groups(m, a) for a in ("dp", "pp", "tp")}
    act_b = 4 if plan.precision == "fp32" else 2
    dtype = "fp32" if plan.precision == "fp32" else "bf16"
    pb, cb, gb, ob = _bytes_per_param(plan.precision, plan.optimizer.name)
    if getattr(plan, "grad_accumulate", "fp32") == "bf16":  # `accumulate=bf16`: ZeRO-1/2's accumulators are bf16
        gb = 2
    z = plan.zero.stage
    if pp_engine == "deepspeed" and z >= 2:
        raise ParcError(f"cost model: --pp-engine deepspeed prices DeepSpeed's pipeline engine, which runs ZeRO-1 at "
                        f"most (deepspeed/runtime/pipe/engine.py: \"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                        f"parallelism\"); this plan has zero stage={z}",
                        hint="write `zero stage=1` to price that engine's run")
    # HSDP (`zero shard=K`): ZeRO's state is cut over K ranks (the shard groups) and replicated over dp / K
    k = (plan.zero.shard or dp) if z >= 1 else dp
    wire = 2 if plan.grad_reduce == "bf16" else gb  # `precision bf16 reduce=bf16`: the dp gradient reduction
    # CPU ranks of one host share its cores: compute slows by ranks / cores when they outnumber them, and by
    # the contention calibrate measured beyond that sharing (caches, switching) with every rank computing
    on_host = min(m.world_size, hw.gpus_per_node)
    # (a contention measured below 1 is the machine's noise between calibrate's two probes: ranks that share a
    # core do not run faster than their share of it)
    slow = max(1.0, on_host / hw.cores) * (max(hw.contention, 1.0) if on_host > hw.cores else 1.0) \
        if hw.cores else 1.0

    def per_tp(d, key):  # one tp rank's share
        return d[f"{key}_sharded"] / tp + d[f"{key}_replicated"]

    # -- compute per stage and micro-batch: each stage its own F and B (the simulator takes the list)
    # sequence parallelism's tp collectives are a reduce-scatter and an all-gather, priced as one all-reduce of
    # their volume but run as rings, never on NVLink SHARP (`_collective`'s `nvls`)
    seq_par = plan.tensor_parallel.sequence_parallel

    def stage_times(d):
        if compute.has_model(hw, d):
            # the same statistics (a planner's probe and its plans hold one dict per split) cost the same
            key = (id(d), id(hw), dtype, tp, attention, attention_dropout)
            held = memo.stage_costs.get(key)
            if held is None or held[0] is not d or held[1] is not hw:
                held = memo.stage_costs[key] = (d, hw, compute.stage_seconds(d["ops"], hw, dtype, tp, attention,
                                                                              attention_dropout))
            f, b = held[2]
            # in a step, ops run slower than each in a loop of itself, as the tables time them (a calibrated
            # CPU's `in_step`, calibrate_step.py; 1 on the shipped presets)
            f, b = f * hw.in_step[0], b * hw.in_step[1]
        else:
            f, b = compute.fallback(hw, dtype, per_tp(d, "flops"), d["flops_recomputed"] / tp)
        calls = max(d.get("tp_ops", 1), 1)
        tp_c = _collective("tp", "all-reduce", tp, d["tp_bytes"] * act_b, groups["tp"], hw, allreduce,
                           latency_steps=2 * (tp - 1) * calls, calls=calls, gap=(f + b) * slow / calls,
                           nvls=not seq_par)
        tp_t = tp_c.seconds if tp > 1 else 0.0
        rec_calls = d.get("tp_ops_recomputed", 0)   # the recomputed forward's all-reduces, in the backward
        tp_r_c = _collective("tp", "all-reduce", tp, d["tp_bytes_recomputed"] * act_b, groups["tp"], hw, allreduce,
                             latency_steps=2 * (tp - 1) * rec_calls, calls=rec_calls,
                             gap=(f + b) * slow / calls, nvls=not seq_par) if tp > 1 and rec_calls else None
        tp_r = tp_r_c.seconds if tp_r_c else 0.0
        again_calls = d.get("tp_ops_regathered", 0)   # sequence parallelism's inputs gathered again, in the backward
        tp_g_c = _collective("tp", "all-gather", tp, d.get("tp_bytes_regathered", 0) * act_b, groups["tp"], hw,
                             allreduce, latency_steps=(tp - 1) * again_calls, calls=again_calls,
                             gap=(f + b) * slow / calls) if tp > 1 and again_calls else None
        tp_g = tp_g_c.seconds if tp_g_c else 0.0
        ahead_calls = d.get("tp_ops_regathered_ahead", 0)
        if ahead_calls and tp_overlap == "none":
            # parc's runtime starts each kept slice's gather but the backward's first while the layer after it
            # computes its gradients (runtime/parallel/sequence_regather.py `prefetch`); what the backward's compute
            # cannot hold waits. A recomputed region's gathers run with its forward, in full
            ahead = tp_g * d["tp_bytes_regathered_ahead"] / d["tp_bytes_regathered"]
            first = ahead / ahead_calls
            tp_g = (tp_g - ahead) + first + max(0.0, ahead - first - b)
        # on the stage's timeline: the forward's collectives, the backward's and the recomputed forward's; another
        # system may run them under its tp-split linears' matmuls (`System.tp_overlap`)
        tp_f, tp_b = tp_t / 2, tp_t / 2 + tp_r + tp_g
        if tp > 1 and tp_overlap != "none" and compute.has_model(hw, d):
            win_f, win_b, win_w, win_r = compute.tp_gemm_seconds(d["ops"], hw, dtype, tp)
            # either way, an input's second all-gather runs while its layer's input gradient is computed
            # (Megatron-LM's asynchronous all-gather; Transformer Engine's likewise): under the input-gradient matmuls
            hidden_g = max(0.0, tp_g - (win_b - win_w))
            if tp_overlap == "gemm":
                tp_f, tp_b = max(0.0, tp_t / 2 - win_f), max(0.0, tp_t / 2 - win_b) + max(0.0, tp_r - win_r) + hidden_g
            else:   # "backward": the column-parallel linears' input-gradient collectives under the weight gradients'
                # matmuls: every backward collective without sequence parallelism (the f operator's all-reduces); with
                # it the reduce-scatters, half, while the row-parallel linears' all-gathers stay on the timeline
                share = 0.5 if plan.tensor_parallel.sequence_parallel else 1.0
                tp_b = tp_t / 2 * (1 - share) + max(0.0, tp_t / 2 * share - win_w) + tp_r + hidden_g
        tp_times.append(tp_f + tp_b)
        # what runs under compute rather than on the timeline slows that compute (`beside`)
        timeline_b = tp_t / 2 + tp_r + (tp_g_c.seconds if tp_g_c else 0.0)
        slowed = beside(hw, tp_t / 2 - tp_f), beside(hw, timeline_b - tp_b)
        beside_times.append(slowed)
        tp_comms.append([c for c in (tp_c if tp > 1 else None, tp_r_c, tp_g_c) if c is not None])
        # a tp group across nodes is priced at the node's NICs (`_collective`): while it runs, they are busy
        tp_on_nics.append((tp_t / 2, tp_t / 2 + tp_r + tp_g) if tp > 1 and tp_c.inter > 0 else (0.0, 0.0))
        f += hw.step_overhead[1]   # the runtime's own work per micro-batch (calibrated CPU; 0 elsewhere)
        if z >= 2:   # the whole gradient laid out, cast and divided for each micro-batch's reduce-scatter
            b += compute.zero_grad_seconds(hw, per_tp(d, "params"), act_b, dp_bytes or wire,
                                           low_acc=z < 3 and gb == act_b)
        if pp_engine == "deepspeed":   # the engine accumulates each micro-batch's gradient after its backward
            b += compute.deepspeed_accumulate_seconds(hw, per_tp(d, "params"), plan.precision, acc)
        return f * slow + tp_f + slowed[0], b * slow + tp_b + slowed[1]
    tp_times: list[float] = []
    beside_times: list[tuple[float, float]] = []   # per stage: (F, B) seconds hidden tp collectives add (`beside`)
    tp_on_nics: list[tuple[float, float]] = []   # per stage: (F, B) seconds tp holds the node's NICs
    tp_comms: list[list[Comm]] = []   # per stage: its tp collectives of one micro-batch, as priced above
    times = [stage_times(d) for d in stages]
    cost_f, cost_b = [t[0] for t in times], [t[1] for t in times]
    send_el = max(stats.get("send_elements") or [0])
    sp = plan.tensor_parallel.sequence_parallel and tp > 1
    send_bytes = send_el * act_b / (tp if sp or (p2p_scatter_gather and tp > 1) else 1)
    name = plan.pipeline.schedule if plan.pipeline else "1f1b"
    if pp > 1 and pp_engine == "deepspeed" and (name != "1f1b" or virtual != 1):
        raise ParcError(f"cost model: --pp-engine deepspeed prices DeepSpeed's pipeline engine, whose one "
                        f"training schedule is a 1F1B (TrainSchedule); this plan's is {name}"
                        f"{f' with {virtual} virtual stages' if virtual > 1 else ''}",
                        hint="write `pipeline schedule=1f1b` to price that engine's run")
    # DeepSpeed's engine trains in its own order, built once for memory and timing
    ds_order = deepspeed_train(pp, acc) if pp > 1 and pp_engine == "deepspeed" else None
    # micro-batches in flight per pp rank: the compute order's, whatever the costs (the simulator's peak)
    inflight = [1] if pp == 1 else peak_of(ds_order) if ds_order else peak_inflight(name, pp, acc, virtual)
    # -- memory per pp rank
    memory = []
    # bf16 ZeRO keeps only this rank's range of the fp32 masters (fp32: the masters are the parameters)
    sharded_masters = z >= 3 or (z >= 1 and cb > 0)
    for r in range(pp):
        held = [stages[r + k * pp] for k in range(virtual)]
        params = params_per_rank[r] if params_per_rank else sum(per_tp(d, "params") for d in held)
        # another system's attention may keep what the traced flash kernel does not (`_attention_kept`)
        probs = [_attention_kept(d, tp, attention, attention_dropout, act_b) for d in held]
        kept = sum(per_tp(d, "kept_bytes") + p[0] for d, p in zip(held, probs)) / len(held)
        rpeak = max(per_tp(d, "recompute_peak_bytes") + p[1] for d, p in zip(held, probs))
        transient = max(_transient(d, tp, act_b, fused_loss=stats.get("loss") == "fused") for d in held)
        act = kept * inflight[r] + max(rpeak, transient)
        memory.append({"pp_rank": r, "params_count": params,
                       # ZeRO keeps 1/dp of the fp32 masters; stages 1–2 keep the whole compute copy, ZeRO-3 none:
                       # it gathers bf16 per layer (runtime/parallel/zero.py)
                       "params": params * pb / (k if sharded_masters else 1) + (params * cb if z < 3 else 0),
                       "grads": params * gb / (k if z >= 2 else 1),
                       "optimizer": params * ob / (k if z >= 1 else 1),
                       "activations": act, "inflight": inflight[r],
                       "activations_kept": kept * inflight[r], "recompute_peak": rpeak,
                       "transient": transient})
    for r, row in enumerate(memory):
        row["zero_working"] = _zero_working(z, [stages[r + k * pp] for k in range(virtual)], row["params_count"],
                                            cb or pb, wire if dp > 1 else gb)
        row["total"] = row["params"] + row["grads"] + row["optimizer"] + row["activations"] + row["zero_working"]

    if memory_limit is not None and not getattr(plan.zero, "offload", None) and \
            max(row["total"] for row in memory) > memory_limit:
        # it does not fit (ZeRO-Offload moves state off the device below: not decided here): what a search needs
        # to drop it, without building or timing its schedule
        return Estimate(hw, memory, [], math.inf, 0.0, 0.0, 0.0, inflight, 0.0, 0.0, 0.0,
                        [f"not timed: it needs more than memory_limit, {memory_limit / GiB:.1f} GiB"])
    if pp > 1:
        # a send follows one F or B of the sender's stage (the mean action: the gap between two sends)
        action = sum(cost_f + cost_b) / (2 * len(cost_f))
        p2p = _collective("pp", "send/recv", 2, send_bytes, groups["pp"], hw, allreduce, latency_steps=1,
                          gap=action)
        p2p_t = p2p.seconds
        if hw.p2p_post:
            # the executor posts about one batch of sends/receives per action (runtime/parallel/pipeline.py batches
            # adjacent ones; a --trace shows 15–17 posts for 16 actions): the poster's time goes on its own
            # timeline, each F and B. The measured hop (half a round trip) holds the sender's post: taken off
            cost_f = [c + hw.p2p_post for c in cost_f]
            cost_b = [c + hw.p2p_post for c in cost_b]
            p2p_t = max(p2p_t - hw.p2p_post, 0.0)
        if p2p_scatter_gather and tp > 1 and not sp:   # the receiver's all-gather over NVLink
            p2p_t += _collective("tp", "all-gather", tp, send_el * act_b, groups["tp"], hw, allreduce).seconds
        split = {"cost_i": [b / 2 for b in cost_b], "cost_w": [b / 2 for b in cost_b]} if name == "zb_h1" else {}
        engine = {}
        if pp_engine == "deepspeed":
            # its order, every transfer blocking both ranks (free transfers below: the same rules at cost 0)
            schedule, engine = ds_order, {"p2p": "blocking", "send_waits": True}
        else:
            schedule = build_schedule(name, pp, acc, virtual)   # sends placed for unit costs, as compiled
        sim = simulate(schedule, cost_f=cost_f, cost_b=cost_b, cost_comm=p2p_t, **split, **engine)
        if name == "interleaved_1f1b":
            # the unit-cost placement can idle ranks that wait on a slow chunk; placed for the stages' own
            # costs it often does not. The better of the two: the order an executor should use (the
            # compiled one still uses unit costs; docs/cost-model.md)
            placed = build_schedule(name, pp, acc, virtual, order_costs={"F": cost_f, "B": cost_b})
            other = simulate(placed, cost_f=cost_f, cost_b=cost_b, cost_comm=p2p_t)
            if other.makespan < sim.makespan:
                schedule, sim = placed, other
        makespan, bubble = sim.makespan, sim.bubble_fraction
        free = simulate(schedule, cost_f=cost_f, cost_b=cost_b, **split, **engine) if any(cost_f + cost_b) else None
        sched_bubble = free.bubble_fraction if free else \
            simulate(build_schedule(name, pp, acc, virtual), **({"cost_i": 1.0, "cost_w": 1.0} if split else {})
                     ).bubble_fraction
    else:
        makespan, bubble, sched_bubble, free = acc * (times[0][0] + times[0][1]), 0.0, 0.0, None
    # the busiest pp rank's compute: all its virtual stages, every micro-batch
    compute_s = max(acc * sum(times[r + k * pp][0] + times[r + k * pp][1] for k in range(virtual))
                    for r in range(pp))

    # -- communication per rank per step (the worst pp rank's sizes)
    comms = []
    big_rank = max(range(pp), key=lambda r: memory[r]["params_count"])
    big = memory[big_rank]["params_count"]
    held = [stages[big_rank + k * pp] for k in range(virtual)]
    wire = dp_bytes or wire  # stated, else the layout's (`reduce=bf16`: 2 bytes)
    # collective calls: plain dp all-reduces one bucket of at most 25 MiB at a time (passes/grad_buckets.py);
    # ZeRO one bucket per layer or top-level module (passes/zero.py `unit_of`; 1 for statistics without it)
    units = max(sum(d.get("zero_units", 0) for d in held), 1)
    # the compute (seconds, cores shared) of one micro-batch on the busiest rank: what separates its calls
    micro_s = max(sum(times[r + k * pp][0] + times[r + k * pp][1] for k in range(virtual)) for r in range(pp))
    if dp > 1:
        if z == 0:
            buckets = max(1, math.ceil(big * gb / (25 * 2 ** 20)))
            comms.append(_collective("dp", "all-reduce", dp, big * wire, groups["dp"], hw, allreduce,
                                     calls=buckets, gap=acc * micro_s / buckets))
        else:
            # runtime/parallel/zero.py: ZeRO-1 reduce-scatters once a step; ZeRO-2/3 in every micro-batch's backward;
            # ZeRO-1/2 gather the updated parameters once a step (bf16: the compute copy, cast from the master
            # ranges); ZeRO-3 gathers the compute copy twice per micro-batch (forward, backward); each time every
            # bucket in a call of its own
            rs = acc if z >= 2 else 1
            ag = 2 * acc if z == 3 else 1
            gap = acc * micro_s / ((rs + ag) * units)   # the step's compute over all its calls
            # DeepSpeed's BF16_Optimizer (its "ZeRO-1 equivalent") all-reduces the fp32 gradients, then steps its
            # shard and all-gathers (pipe/engine.py `_bf16_reduce_grads`: `buffered_allreduce_fallback`)
            buffers = math.ceil(big / DEEPSPEED_ALLREDUCE_ELEMENTS) \
                if pp_engine == "deepspeed" and plan.precision == "bf16" else 0
            comms += _zero_comms(m, k, groups, hw, allreduce, big * wire, big * (cb or pb), rs, ag, units, gap,
                                 all_reduce=buffers)
    if tp > 1:
        comms += _tp_rows(tp_comms, tp_times, pp, virtual, acc, plan.tensor_parallel.sequence_parallel)
    if pp > 1:
        comms.append(_collective("pp", "send/recv", 2, 2 * send_bytes * acc * virtual, groups["pp"], hw,
                                 allreduce, latency_steps=2 * acc * virtual, calls=2 * acc * virtual))
    # a parameter held by more than one pp rank (a tied embedding and lm head) has its gradient summed over them once
    # a step, after the backward (runtime/parallel/pipeline.py `sync_tied`; DeepSpeed's `_exec_reduce_tied_grads`)
    tied_s = 0.0
    for tie in stats.get("tied", ()) if pp > 1 else ():
        holders = sorted({s % pp for s in tie["stages"]})
        if len(holders) > 1:
            size = tie["elements"] / (tp if tie["sharded"] else 1) * gb
            c = _collective("pp", "all-reduce", len(holders), size, [[g[r] for r in holders] for g in groups["pp"]],
                            hw, allreduce)
            comms.append(c)
            tied_s += c.seconds
    # tp and pp time is inside the simulated makespan. dp: plain dp's bucket all-reduces overlap the last
    # micro-batch's backward (runtime/parallel/data_parallel.py), all but the last bucket's share; ZeRO's
    # overlap the compute runtime/parallel/zero.py runs them under ("Overlap"), all but one bucket's share each
    dp_time = sum(c.seconds for c in comms if c.axis == "dp")
    # dp's collectives hide under compute, not under time the NICs they need carry tp's traffic: when both
    # axes' groups leave the node, a window is the stage's time less its tp seconds (one NIC, one transfer)
    shared = any(c.axis == "dp" and c.inter > 0 for c in comms)
    nic = [t if shared else (0.0, 0.0) for t in tp_on_nics]
    if z == 0 and dp > 1 and overlap_dp:
        window = max(sum(times[r + k * pp][1] - nic[r + k * pp][1] for k in range(virtual)) for r in range(pp))
        last = dp_time * min(1.0, 25 * 2 ** 20 / max(big * wire, 1))   # the 25 MiB bucket after backward
        dp_exposed = max(dp_time - window, last)
        dp_hidden = dp_time - dp_exposed
    elif z >= 1 and dp > 1 and overlap_dp:
        fwd = sum(times[big_rank + k * pp][0] - nic[big_rank + k * pp][0] for k in range(virtual))  # a micro-batch
        bwd = sum(times[big_rank + k * pp][1] - nic[big_rank + k * pp][1] for k in range(virtual))
        rs_s, ag_s, replicas_s = (sum(c.seconds for c in comms if c.axis == "dp" and c.collective == name)
                                  for name in ("reduce-scatter", "all-gather", "all-reduce"))
        # HSDP's all-reduce over the replicas runs in `finish`, after the last reduce-scatter: not overlapped
        waited = zero_exposed(z, rs_s, ag_s, acc, units, fwd, bwd, zero_backward_prefetch)
        dp_exposed, dp_hidden = waited + replicas_s, rs_s + ag_s - waited
    else:
        dp_exposed, dp_hidden = dp_time, 0.0
    dp_beside = beside(hw, dp_hidden)
    # the optimizer steps each parameter tensor (ZeRO: one flat range per bucket) in a loop of its own on a CPU
    tensors = units if z >= 1 else sum(d.get("param_tensors", 0) for d in held)
    # ZeRO-0/1 accumulate every micro-batch's whole gradient before the reduction; ZeRO-2/3 their shard
    optimizer_s = compute.step_seconds(hw, big / (k if z >= 1 else 1), plan.optimizer.name, dtype, acc,
                                       tensors=tensors,
                                       # DeepSpeed's engine accumulates in each backward (stage_times), not here
                                       params_grads=0.0 if pp_engine == "deepspeed" else big / (k if z >= 2 else 1))
    # the optimizer step in place (`in_step`), and the step's own work beyond its micro-batches and optimizer
    # (get_batch, the runtime's bookkeeping: `step_overhead`): both calibrated on a CPU, neutral elsewhere
    optimizer_s = (optimizer_s * hw.in_step[2] + hw.step_overhead[0]) * slow
    step = makespan + dp_exposed + dp_beside + tied_s + optimizer_s
    if z >= 1 and getattr(plan.zero, "offload", None):  # ZeRO-Offload (parc/analysis/offload_cost.py)
        # the gradient download runs under the last micro-batch's backward, bucket by bucket (runtime/parallel/offload.py)
        bwd = sum(times[big_rank + v * pp][1] for v in range(virtual)) if overlap_dp else 0.0
        memory, added, copies, note = offload_cost.apply(memory, big, k, z, plan.optimizer.name, pb, cb, ob, hw,
                                                         backward_s=bwd, buckets=units)
        comms += [Comm("host", name, 1, size, 0.0, 0.0, seconds) for name, size, seconds in copies]
        step += added
        notes.append(note)
    fwd = sum(d["flops_sharded"] + d["flops_replicated"] for d in stages)
    model_flops = 3 * fwd * acc * dp
    hw_flops = model_flops + sum(d["flops_recomputed"] for d in stages) * acc * dp
    mfu = model_flops / (step * m.world_size * hw.flops.get(plan.precision, hw.flops["fp32"])) if step else 0.0
    # DeepSpeed's bf16 engine all-reduces ZeRO-1's gradients (`_zero_comms`)
    grad_reduces = "all-reduces" if pp_engine == "deepspeed" and plan.precision == "bf16" else "reduce-scatters"
    overlap = "plain dp's bucket all-reduces overlap the last micro-batch's backward, all but the last " \
        "bucket (25 MiB)" if z == 0 and overlap_dp else "dp's all-reduce after the backward, not overlapped" \
        if z == 0 else _zero_overlap_note(z, units, zero_backward_prefetch) if overlap_dp \
        else f"ZeRO-{z}'s {grad_reduces} and all-gathers are not overlapped"
    if overlap_dp and dp > 1 and any(f + b for f, b in nic):
        overlap += ("; tp's groups cross nodes and hold the NICs dp's collectives need, so those overlap "
                    "compute only, not tp's time")
    if pp_engine == "deepspeed":
        how = {"bf16": "its BF16_Optimizer's cast and add into the fp32 gradients (18 bytes a parameter)",
               "fp16": "autograd's add into the fp16 .grad", "fp32": "autograd's add into the fp32 .grad"}
        notes.append("DeepSpeed's pipeline engine: each micro-batch's gradient is accumulated right after its backward "
                     f"on its stage, {how[plan.precision]}, inside the pipeline's slots"
                     + ("; the bf16 gradients are all-reduced in fp32 (its _bf16_reduce_grads), each rank then "
                        "stepping and all-gathering its shard" if plan.precision == "bf16" and z >= 1 and dp > 1
                        else ""))
    if tied_s:
        notes.append(f"tied parameters (held by more than one pp rank): their gradients summed over those ranks once a "
                     f"step after the backward, {tied_s:.3g} s, not overlapped (counted in pp's exposed time)")
    notes.append(f"communication: tp and pp inside the simulated pipeline; {overlap}; "
                 f"{dp_exposed / step if step else 0:.1%} of the step is exposed dp communication")
    if z >= 2:
        notes.append(f"ZeRO-{z} in flight (memory, `zero_working`): at most 1 bucket gradient being reduce-scattered"
                     + (" and 2 gathered layers (the one computing, the one prefetched)" if z == 3 else "")
                     + ", each bucket at the largest layer's size")
    layout = "fp32" if plan.precision == "fp32" else f"{plan.precision} compute (autocast) over fp32 master weights"
    if plan.precision == "fp16":
        layout += ", dynamic loss scaling (runtime/loss_scale.py)"
    if cb and 1 <= z <= 2:  # the whole 16-bit copy is ZeRO's flat buffer; the fp32 masters are sharded
        layout += f"; ZeRO-{z} keeps the whole {plan.precision} copy and 1/{k} of the fp32 masters, gathering {plan.precision}"
        if gb == 2:
            layout += ", accumulating gradients in bf16 (`accumulate=bf16`)"
    if k < dp:
        notes.append(f"HSDP: ZeRO-{z}'s state is cut over shard groups of {k} dp ranks and replicated over "
                     f"{dp // k}; reduce-scatters and all-gathers stay in the shard group, and one all-reduce a step "
                     f"of each rank's 1/{k} of the gradients crosses the replicate group")
    state = _state_per_param(plan.precision, pb, cb, gb, ob, z, k, sharded_masters)
    if z >= 1 and getattr(plan.zero, "offload", None):
        state += " on the device before ZeRO-Offload moves the fp32 ranges and optimizer state to the host"
    notes.append(f"precision layout: {layout}; bytes per parameter per rank, as the runtime keeps them: {state}; "
                 f"dp gradients on the wire {wire}, activations {act_b}")
    if getattr(plan, "compile", "none") != "none" and plan.recompute.patterns and tp > 1:
        notes.append(f"recompute under compile {plan.compile}: each recomputed region keeps its tp collectives' "
                     "outputs rather than communicating again in backward (runtime/recompute_policy.py); they are "
                     "counted in the kept activations")
    notes.append("compute: " + ("per operation (matmul and attention efficiency tables, memory-bound ops at "
                                f"{hw.mem_bw / 1e9:.0f} GB/s)" if any(compute.has_model(hw, d) for d in stages)
                                else f"FLOPs at {hw.achievable:.0%} of peak (no efficiency table or no op "
                                "statistics)") + (f"; {min(m.world_size, hw.gpus_per_node)} ranks share "
                                                  f"{hw.cores} cores (×{slow:.2g})" if slow > 1 else ""))
    if tuple(hw.in_step) != (1.0, 1.0, 1.0) or any(hw.step_overhead):
        f_in, b_in, o_in = hw.in_step
        notes.append(f"in a step (calibrated in place): forward ×{f_in:.2f}, backward ×{b_in:.2f}, optimizer "
                     f"×{o_in:.2f} the tables' price; {hw.step_overhead[0] * 1e3:.2g} ms a step and "
                     f"{hw.step_overhead[1] * 1e3:.2g} ms a micro-batch of the runtime's own")
    if attention == "flash-triton":
        fwd_x, bwd_x = compute.TRITON_FLASH_SLOWER
        notes.append(f"attention: FlashAttention in Triton, the attention table's efficiency ÷{fwd_x:g} forward, "
                     f"÷{bwd_x:g} backward (FlashAttention-2 paper §4.1)")
    elif attention == "flash-unpad":
        notes.append("attention: the flash kernel between flash_attn's unpad_input and pad_input: q, k and v "
                     "gathered and the output scattered each forward, the reverse each backward, "
                     f"{compute.UNPAD_INDEX_KERNELS} index kernels a forward, and the padded output kept beside "
                     "the kernel's; their host syncs (nonzero, item) are not priced")
    elif attention == "cudnn":
        notes.append("attention: cuDNN's fused kernel (Transformer Engine's FusedAttention), "
                     + ("the preset's cuDNN table (measured beside FlashAttention-2, presets.py)" if hw.attention_cudnn
                        else "priced as flash: this preset has no measurement of it (`attention_cudnn`)"))
    elif attention != "flash":
        notes.append(f"attention: {attention} (the scores written out, over the whole T × T square"
                     + (", with a dropout on the probabilities)" if attention_dropout else ")"))
    if hw.collectives:
        notes.append("collectives: each call priced as calibrated on this host (per kind, group size, size, and "
                     "the compute between calls), not by the ring formula")
    est = Estimate(hw, memory, comms, step, compute_s, bubble, sched_bubble, inflight, model_flops, hw_flops, mfu,
                   notes)
    est.dp_exposed_seconds, est.optimizer_seconds = dp_exposed, optimizer_s
    est.p2p_exposed_seconds = (max(0.0, makespan - free.makespan) if pp > 1 and free else 0.0) + tied_s
    est.tp_seconds = max(acc * sum(tp_times[r + k * pp] for k in range(virtual)) for r in range(pp))
    est.stage_seconds = times
    est.beside_seconds = dp_beside + max(acc * sum(sum(beside_times[r + k * pp]) for k in range(virtual))
                                         for r in range(pp))
    if est.beside_seconds:
        notes.append(beside_note(hw, est.beside_seconds))
    return est


BESIDE = "compute beside communication:"


def beside_note(hw: Hardware, seconds: float) -> str:
    """The report's line on what the collectives hidden under compute cost it (`beside`)."""
    return (f"{BESIDE} a kernel sharing the GPU with a running collective takes "
            f"{1 + hw.overlap_slowdown:.3g}× as long (the preset's `overlap_slowdown`), so the collectives hidden "
            f"under compute add {seconds:.3g} s to the step")


# DeepSpeed's engine all-reduces gradients in flat buffers of this many elements (MEMORY_OPT_ALLREDUCE_SIZE)
DEEPSPEED_ALLREDUCE_ELEMENTS = 500_000_000


@functools.lru_cache(maxsize=64)
def _zero_groups(m, k: int) -> dict[str, list[list[int]]]:
    """parc/mesh.py `zero_groups`, once per mesh and shard size (the planner prices many plans of one mesh)."""
    from parc import mesh as meshlib

    return meshlib.zero_groups(m, k)


def _zero_comms(m, k: int, groups: dict, hw: Hardware, allreduce: str, grad_bytes: float, gathered_bytes: float,
                rs: int, ag: int, units: int, gap: float, all_reduce: int = 0) -> list[Comm]:
    """ZeRO's collectives a step (runtime/parallel/zero.py): `rs` reduce-scatters of the gradients and `ag`
    all-gathers of the parameters, one call a bucket (`units`), over the shard groups: all of dp, or K ranks
    under HSDP, which then all-reduces each rank's 1/K of the gradients once a step over the dp / K replicas
    (the groups of parc/mesh.py `zero_groups`, priced by where their ranks sit: intra- or inter-node).
    `all_reduce` > 0: the gradients are all-reduced whole instead of reduce-scattered, in that many calls
    (DeepSpeed's BF16_Optimizer under its pipeline engine: `buffered_allreduce_fallback`, one call a buffer of
    `DEEPSPEED_ALLREDUCE_ELEMENTS`), each rank then stepping its own shard."""
    dp = m.dp
    if k == dp:
        shard, replicate = groups["dp"], None
    else:
        zg = _zero_groups(m, k)
        shard, replicate = zg["zero_shard"], zg["zero_replicate"]
    out = []
    if k > 1:
        # each bucket is a collective call of its own, and a ring call walks its k − 1 steps whatever its size,
        # each step paying the link's latency: (k − 1) steps per call (NCCL's all-gather and reduce-scatter
        # are rings: no tree to shorten them), which at thousands of ranks is most of a small bucket's time
        if all_reduce:   # a ring all-reduce: 2(k − 1) steps a call
            out.append(_collective("dp", "all-reduce", k, grad_bytes * rs, shard, hw, allreduce,
                                   latency_steps=2 * (k - 1) * all_reduce, calls=all_reduce, gap=gap))
        else:
            out.append(_collective("dp", "reduce-scatter", k, grad_bytes * rs, shard, hw, allreduce,
                                   latency_steps=(k - 1) * rs * units, calls=rs * units, gap=gap))
        out.append(_collective("dp", "all-gather", k, gathered_bytes * ag, shard, hw, allreduce,
                               latency_steps=(k - 1) * ag * units, calls=ag * units, gap=gap))
    if replicate is not None:
        out.append(_collective("dp", "all-reduce", dp // k, grad_bytes / k, replicate, hw, allreduce,
                               calls=units, gap=gap))
    return out


def zero_exposed(stage: int, rs: float, ag: float, acc: int, units: int, fwd: float, bwd: float,
                 backward_prefetch: bool = True) -> float:
    """Seconds of ZeRO's dp collectives compute does not hide, as runtime/parallel/zero.py overlaps them
    ("Overlap"): `rs`, `ag` the step's reduce-scatter and all-gather seconds, `fwd`, `bwd` one micro-batch's
    forward and backward on the rank, `units` its buckets.

    Each phase's traffic runs under its window of compute; what the window cannot hold is exposed, and never
    less than one bucket's share (1/units, buckets taken equal), which waits alone: the first layer's
    gather before any compute, the last bucket's reduce-scatter after the backward (plain dp's rule for
    its last bucket). Stage 1: one reduce-scatter under the last backward; stage 2: one per micro-batch,
    each under its backward; stages 1–2: the post-step gather under the next step's first forward (compiled
    programs too). Stage 3, every micro-batch: half the gathers
    under its forward, the other half with its reduce-scatter under its backward (one link for both).
    Without `backward_prefetch` (PyTorch FSDP's BACKWARD_POST: `System.zero_prefetch`) each backward gather is
    issued only after the layer before it finished its gradients, and waits whole: the backward's gathers are
    all exposed, its reduce-scatters run under its compute."""
    def exposed(seconds: float, window: float) -> float:
        return max(seconds - window, seconds / units) if seconds > 0 else 0.0

    if stage == 3:
        gather = ag / (2 * acc)
        if not backward_prefetch:
            return acc * (exposed(gather, fwd) + gather + exposed(rs / acc, bwd))
        return acc * (exposed(gather, fwd) + exposed(gather + rs / acc, bwd))
    reduced = acc * exposed(rs / acc, bwd) if stage == 2 else exposed(rs, bwd)
    return reduced + exposed(ag, fwd)


def _zero_working(stage: int, held: list[dict], params: float, gather_b: int, wire_b: int) -> float:
    """Bytes ZeRO holds for a moment beyond its state, at the bounds runtime/parallel/zero.py keeps
    ("Overlap"): stages 2–3, `REDUCE_SCATTERS_IN_FLIGHT` (1) whole bucket gradient in the wire dtype
    as reduce-scatter inputs; stage 3 also two gathered layers (the one computing, the one arriving) in
    the gathered dtype. A bucket is taken at the largest unit's size (`zero_unit_max`; statistics
    without it: the mean bucket)."""
    if stage < 2:
        return 0.0
    units = max(sum(d.get("zero_units", 0) for d in held), 1)
    largest = max((d.get("zero_unit_max", 0) for d in held), default=0) or params / units
    return largest * wire_b + (2 * largest * gather_b if stage == 3 else 0)


def _zero_overlap_note(stage: int, units: int, backward_prefetch: bool = True) -> str:
    """The report's line on how ZeRO's collectives are priced (`zero_exposed`)."""
    rs = "in each micro-batch's backward" if stage >= 2 else "in the last micro-batch's backward"
    if stage == 3 and not backward_prefetch:
        ag = ("its all-gathers overlap each micro-batch's forward; in the backward each is issued after the layer "
              "before it (FSDP's BACKWARD_POST) and waits whole, exposed")
    elif stage == 3:
        ag = "its all-gathers overlap each micro-batch's forward and backward, prefetching one layer ahead"
    else:
        ag = "its post-step all-gathers overlap the next step's forward, each layer waiting for its own bucket"
    return (f"ZeRO-{stage}'s reduce-scatters overlap the compute after them {rs}; {ag}; what compute cannot "
            f"hide is exposed, at least one of {units} buckets' share of each")


def _tp_rows(tp_comms: list[list[Comm]], tp_times: list[float], pp: int, virtual: int, acc: int,
             sequence_parallel: bool) -> list[Comm]:
    """The tp rows of the report: the collectives of the pp rank with the most tp time, its stages' every
    micro-batch, priced exactly as the stage times price them (latency and overhead per call), so where none
    of them is hidden the rows add up to `Estimate.tp_seconds` and the report's two communication figures are
    of one kind. Sequence parallelism's all-gather and reduce-scatter pair moves an all-reduce's volume over its
    ring steps, (n−1) each: the priced all-reduce, half to each row; its inputs gathered again in the backward
    (`tp_bytes_regathered`) add to the all-gather row."""
    busiest = max(range(pp), key=lambda r: sum(tp_times[r + k * pp] for k in range(virtual)))
    held = [c for k in range(virtual) for c in tp_comms[busiest + k * pp]]
    if not held:
        return []
    n = held[0].group
    pairs = [c for c in held if c.collective == "all-reduce"]
    again = [c for c in held if c.collective == "all-gather"]

    def summed(name: str, share: float, whole: list[Comm] = ()) -> Comm:   # `share` of each pair, all of `whole`
        return Comm("tp", name, n, *(acc * (share * sum(getattr(c, f) for c in pairs) +
                                            sum(getattr(c, f) for c in whole))
                                     for f in ("bytes", "intra", "inter", "seconds")))

    if not sequence_parallel:
        return [summed("all-reduce", 1.0)]
    return [summed("all-gather", 0.5, again), summed("reduce-scatter", 0.5)]


def _attention_kept(d: dict, tp: int, attention: str, dropout: bool, act_b: int) -> tuple[float, float]:
    """(kept, recompute peak) bytes of one micro-batch that another system's attention holds beyond the flash
    kernel parc traces.

    - Materialised: the softmax's output, b·heads·T² in 16 bits, saved for the softmax's and the value matmul's
      backward; with dropout on the probabilities also its mask (1 byte) and the dropped probabilities the value
      matmul reads (2): 5 bytes an element (Korthikanti et al. 2023, arXiv:2205.05198 §4.1: "2as²b", "as²b",
      "2as²b"; the scores before Megatron's fused scale-mask-softmax are not kept).
    - "flash-unpad": the output twice, b·heads·T·hs at the activations' bytes: the kernel saves its unpadded
      output and the projection after it saves the padded copy (`pad_input` writes a new tensor). Its unpadded
      q, k and v replace the views of the projection's output the kernel would save, so they add nothing.
    - Other flash kernels: nothing.

    Heads split over tp where the row says so. A recomputed attention's are held only while its region is
    recomputed: one at a time, the largest."""
    if attention not in ("materialized", "flash-unpad"):
        return 0.0, 0.0
    kept = peak = 0.0
    from parc.analysis.compute import attn_rows

    for bh, t, hs, _, split, rec, _, count in attn_rows(d.get("ops", {})):
        bh = bh / (tp if split else 1)
        held = bh * t * hs * act_b if attention == "flash-unpad" else bh * t * t * (5 if dropout else 2)
        if rec:
            peak = max(peak, held)
        else:
            kept += count * held
    return kept, peak


def _transient(d: dict, tp: int, act_b: int, fused_loss: bool = False) -> float:
    """Bytes alive for a moment in the backward of the loss: the logits' gradient (fp32) and, under
    bf16, its cast for the head's matmul; beside what the forward kept (logits, log-softmax). A fused loss
    kernel (`System.loss`) writes the gradient once, in the logits' dtype."""
    el = d.get("logits_elements_sharded", 0) / tp + d.get("logits_elements_replicated", 0)
    return el * act_b if fused_loss else el * (4 + (2 if act_b == 2 else 0))
