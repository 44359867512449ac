"""The plan model: what a .par file means, as frozen dataclasses.

Start here to learn the plan language's semantics. `parc.grammar.parser.parse` builds a
`Plan` from text (nothing from lark survives past it); `parc.grammar.printer.format_plan`
prints one back so that parse → print → parse is the identity. Every node keeps
the `Span` of the text it came from so later errors can point at it.

Assumes nothing: a `Plan` built in code is as valid as one parsed (run
`parc.grammar.validate.validate` on it). Guarantees: every class is frozen and
hashable, so a plan never changes after it is checked.

Defaults are chosen so a plan of a single `mesh` line trains: fp32, AdamW,
no ZeRO, no pipeline, no tensor-parallel rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal

from parc.errors import Span

AXES = ("dp", "pp", "tp")
DEFAULT_ORDER = ("tp", "pp", "dp")  # inner → outer on global ranks: tp adjacent, dp outermost
# with mesh cp > 1 (context parallelism), cp sits between tp and pp, as in Megatron-Core (tp-cp-…-dp-pp)
CP_DEFAULT_ORDER = ("tp", "cp", "pp", "dp")
CP_METHODS = ("ring", "alltoall")  # `context_parallel …`: how attention runs on the sharded sequence
TPStyle = Literal["column", "row", "vocab", "replicate"]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")
PRECISIONS = ("fp32", "bf16", "fp16")
COMPILE_MODES = ("none", "inductor", "aot_eager")  # runtime/compiled.py; docs/compile.md
REDUCE_DTYPES = ("fp32", "bf16")  # `precision … reduce=`: the dp gradient reduction


@dataclass(frozen=True)
class Mesh:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER  # inner → outer
    ep: int = 1  # expert-parallel degree: groups of ep consecutive dp ranks (not an axis of its own)
    span: Span | None = field(default=None, compare=False)
    cp: int = 1  # context-parallel degree: the sequence split over cp ranks (docs/context-parallel.md)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    def degree(self, axis: str) -> int:
        return getattr(self, axis)


@dataclass(frozen=True)
class Topology:
    nodes: int = 1
    gpus_per_node: int = 8
    intra_bw: float | None = None  # bytes/s within a node (NVLink)
    inter_bw: float | None = None  # bytes/s between nodes (network)
    preset: str | None = None      # e.g. "h100" — hardware figures for the cost model
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Batch:
    global_size: int
    micro: int
    accumulation: int | None = None  # as stated; None means derived
    span: Span | None = field(default=None, compare=False)

    def derived_accumulation(self, dp: int) -> int:
        """global = micro × accumulation × dp; validation guarantees exact division."""
        return self.accumulation if self.accumulation is not None else self.global_size // (self.micro * dp)


@dataclass(frozen=True)
class TPRule:
    pattern: str      # glob over module paths, e.g. "blocks.*.attn.qkv"
    style: TPStyle
    span: Span | None = field(default=None, compare=False)
    optional: bool = False  # written `"glob"? : style`: matching no module is not an error


@dataclass(frozen=True)
class TensorParallel:
    rules: tuple[TPRule, ...] = ()
    sequence_parallel: bool = False
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ExpertParallel:
    """Globs naming ModuleLists of experts; with mesh ep > 1 each ep rank holds E/ep of each list's experts."""

    patterns: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ContextParallel:
    """`context_parallel ring|alltoall`: how each attention runs when mesh cp > 1 (passes/context_parallel.py)."""

    method: str = "ring"
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Cut:
    """A pipeline cut before or after the module at `path` (a glob is not allowed)."""

    path: str
    where: Literal["before", "after"] = "before"
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Pipeline:
    schedule: str = "1f1b"
    stages: int | None = None      # total stages; None = pp × virtual
    virtual: int = 1               # virtual stages per pp rank (interleaved schedules)
    cuts: tuple[Cut, ...] | None = None  # None = auto (balance compute and memory)
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Zero:
    stage: int = 0
    shard: int | None = None  # HSDP: shard the state over groups of this many dp ranks; None = all of dp
    offload: str | None = None  # ZeRO-Offload: "cpu" keeps the fp32 masters and optimizer state in host memory
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Recompute:
    patterns: tuple[str, ...] = ()
    span: Span | None = field(default=None, compare=False)
    optional: tuple[str, ...] = ()  # the patterns written `"glob"?`: matching no module is not an error

    def instance(self, path: str) -> str | None:
        """The outermost module on `path` a glob matches, e.g. `blocks.3` for "blocks.*"; None if none does.
        A recomputed region is every node of one instance (passes/recompute.py)."""
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if any(fnmatchcase(prefix, p) for p in self.patterns):
                return prefix
        return None


@dataclass(frozen=True)
class Optimizer:
    name: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = None  # max global grad norm
    # learning-rate schedule (runtime/schedule_lr.py): linear warmup over `warmup` steps, then `decay`
    # (constant, linear or cosine) down to `min_lr` at step `decay_steps`
    warmup: int = 0
    decay: str = "constant"
    decay_steps: int | None = None
    min_lr: float | None = None
    # parameters weight decay skips (runtime/param_groups.py); ("none",) decays every parameter
    no_decay: tuple[str, ...] = ("bias", "norm", "embedding")
    span: Span | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LossScaling:
    """`precision fp16`'s dynamic loss scaler (runtime/loss_scale.py), keys and defaults DeepSpeed's `fp16`
    section's: the scale starts at 2**initial_scale_power, doubles after loss_scale_window steps without an
    overflow, and halves (never below min_loss_scale) at the hysteresis-th overflow since the last change.
    loss_scale > 0 fixes the scale (DeepSpeed's static scaling); overflowed steps are skipped either way."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    loss_scale: float = 0.0  # 0: dynamic


LOSS_SCALING_KEYS = ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale", "loss_scale")


@dataclass(frozen=True)
class Plan:
    mesh: Mesh = Mesh()
    batch: Batch | None = None
    topology: Topology = Topology()
    tensor_parallel: TensorParallel = TensorParallel()
    pipeline: Pipeline | None = None
    zero: Zero = Zero()
    recompute: Recompute = Recompute()
    precision: str = "fp32"
    optimizer: Optimizer = Optimizer()
    expert_parallel: ExpertParallel = ExpertParallel()
    compile: str = "none"
    context_parallel: ContextParallel = ContextParallel()
    grad_reduce: str = "fp32"  # `precision bf16 reduce=…`: dtype of the dp gradient reduction (docs/precision.md)
    # `precision bf16 reduce=bf16 accumulate=…`: dtype ZeRO-1/2 accumulate gradients in (DeepSpeed's grad_accum_dtype)
    grad_accumulate: str = "fp32"
    loss_scaling: LossScaling = LossScaling()  # `precision fp16 initial_scale_power=… …` (docs/precision.md)
    file: str = field(default="<plan>", compare=False)
    source: str = field(default="", compare=False, repr=False)
    # Where each stated value came from, keyed "statement.key" ("mesh.tp", "batch.global",
    # "precision", "optimizer.name"), so validation can point at the token, not just the
    # statement. Filled by the front end; empty for plans built in code.
    spans: dict[str, Span] = field(default_factory=dict, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def accumulation(self) -> int:
        if self.batch is None:
            return 1
        return self.batch.derived_accumulation(self.mesh.dp)

    @property
    def micro_batch(self) -> int:
        return self.batch.micro if self.batch is not None else 1

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.mesh.dp
