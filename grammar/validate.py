"""Validation: is a `Plan` consistent with itself, the launch, and the model?

Start at `validate`. Each `_check_*` function looks at one statement (or one
relation between statements) and appends Diagnostics; nothing stops at the first
error. Checks that need the launch (`world_size`) or the model (`module_paths`,
`num_layers`) are skipped when that argument is None, so the front end can run the
plan-only checks right after parsing.

Assumes a `Plan` whose fields have the right types (the parser checks those).
Guarantees: raises one `PlanError` carrying every error found, or returns the
warnings; it reads no file and never stops at the first mistake.

Limits: a plan's sizes are bounded (`MAX_WORLD` ranks, `MAX_MICRO` samples per
micro-batch, `MAX_MICRO_BATCHES` per step, `MAX_SCHEDULE_SLOTS` for a pipeline),
so that no later check or compile does work proportional to an absurd number; a
value past a limit is a located error like any other (docs/plan-language.md).

Spans: a Diagnostic points at the offending token when the front end recorded it in
`plan.spans` ("mesh.tp", "batch.global", ...), else at the statement, else nowhere
(plans built in code carry no spans).
"""

from __future__ import annotations

import difflib
from fnmatch import fnmatchcase

from parc.errors import Diagnostic, PlanError, Span
from parc.grammar.plan import (AXES, COMPILE_MODES, LOSS_SCALING_KEYS, PRECISIONS, REDUCE_DTYPES, SCHEDULES, LossScaling,
                               Plan, TPRule)

OPTIMIZERS = ("adamw", "adam", "sgd")
DECAYS = ("constant", "linear", "cosine")  # the lr after warmup (runtime/schedule_lr.py)
NO_DECAY = ("bias", "norm", "embedding")   # parameter classes weight decay can skip (runtime/param_groups.py)
TP_STYLES = ("column", "row", "vocab", "replicate")
CUT_WHERE = ("before", "after")
INTERLEAVED = ("interleaved_1f1b",)  # schedules that place several stages on one pp rank

# Limits, so that checking or compiling any plan is cheap (compile lists every rank in plan.json and
# builds the pipeline schedule slot by slot; tracing materialises one micro-batch).
MAX_WORLD = 65536           # dp × pp × tp ranks; hence each degree too
MAX_NODES = 65536           # topology nodes, and gpus_per_node
MAX_MICRO = 65536           # samples in one micro-batch (get_batch(0, micro) runs at compile time)
MAX_MICRO_BATCHES = 65536   # micro-batches per step (accumulation, stated or derived)
MAX_VIRTUAL = 1024          # virtual stages per pp rank
MAX_SCHEDULE_SLOTS = 262144  # pp × virtual × micro-batches: built and simulated slot by slot (~0.1 ms each).
                             # Megatron's 1T run is pp 64 × 512 = 32,768 slots, its Table 2 530B on 560 GPUs
                             # pp 35 × virtual 3 × 1120 = 117,600; at this bound `parc compile` took 16 s and
                             # 1.8 GB (a 101 MB plan.json) on a 2-core box, `parc report` ~10 s


def validate(plan: Plan, *, world_size: int | None = None, module_paths=None,
             num_layers: int | None = None) -> list[Diagnostic]:
    """Raise PlanError carrying every error; return the warnings when there are none."""
    out = _Report(plan)
    _check_mesh(plan, out, world_size)
    _check_topology(plan, out)
    _check_batch(plan, out)
    _check_tensor_parallel(plan, out)
    _check_pipeline(plan, out, num_layers)
    _check_schedule_size(plan, out)
    _check_rest(plan, out)
    _check_expert_parallel(plan, out)
    if module_paths is not None:
        _check_patterns(plan, out, list(module_paths))
        _check_experts(plan, out, list(module_paths))
    errors = [d for d in out.diagnostics if d.severity == "error"]
    if errors:
        raise PlanError(diagnostics=out.diagnostics)
    return out.diagnostics


class _Report:
    def __init__(self, plan: Plan):
        self.plan = plan
        self.diagnostics: list[Diagnostic] = []

    def at(self, key: str, node=None) -> Span | None:
        """The span of `key` if the front end recorded it, else `node`'s, else the plan file's."""
        span = self.plan.spans.get(key) or getattr(node, "span", None)
        if span is None and self.plan.source:
            span = Span(self.plan.file, 1, 1)
        return span

    def error(self, message: str, span: Span | None, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(message, span, hint, "error", self.plan.source or None))

    def warn(self, message: str, span: Span | None, hint: str | None = None) -> None:
        self.diagnostics.append(Diagnostic(message, span, hint, "warning", self.plan.source or None))


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _one_of(name: str, choices) -> str:
    close = difflib.get_close_matches(name, choices, n=1)
    return (f"did you mean `{close[0]}`? " if close else "") + "valid: " + ", ".join(choices)


def _check_mesh(plan: Plan, out: _Report, world_size: int | None) -> None:
    mesh = plan.mesh
    for axis in AXES:
        if not _positive_int(mesh.degree(axis)):
            out.error(f"mesh {axis} must be a positive integer, got {mesh.degree(axis)}",
                      out.at(f"mesh.{axis}", mesh), f"{axis}=1 means the {axis} axis is not used")
    if (sorted(mesh.order) != sorted(AXES) or mesh.cp != 1) and not _cp_order(mesh):
        named = (*AXES, "cp") if mesh.cp != 1 else AXES
        out.error(f"mesh order must name each of {', '.join(named)} once, got {','.join(mesh.order)}",
                  out.at("mesh.order", mesh), "axes inner → outer, e.g. order=tp,pp,dp (the default)"
                  + (", or order=tp,cp,pp,dp (the default with cp)" if mesh.cp != 1 else ""))
    _check_cp_degree(mesh, out)
    degrees = [mesh.degree(a) for a in AXES] + ([mesh.cp] if mesh.cp != 1 else [])
    if all(_positive_int(d) for d in degrees) and mesh.world_size > MAX_WORLD:
        product = " × ".join(f"{a} {d}" for a, d in zip((*AXES, "cp"), degrees))
        big = max(AXES, key=mesh.degree)
        out.error(f"mesh {product} = {mesh.world_size} ranks > {MAX_WORLD}, the most parc compiles for",
                  out.at(f"mesh.{big}", mesh), "see the limits in docs/plan-language.md")
    if world_size is not None and all(_positive_int(d) for d in degrees) and mesh.world_size != world_size:
        product = " × ".join(f"{a} {d}" for a, d in zip((*AXES, "cp"), degrees))
        out.error(f"mesh {product} = {mesh.world_size} ≠ world size {world_size}", out.at("mesh", mesh),
                  "launch as many ranks as the mesh has, or change the degrees")


def _cp_order(mesh) -> bool:
    """An order naming cp with dp, pp and tp: allowed (and needed) with mesh cp > 1."""
    return sorted(mesh.order) == sorted((*AXES, "cp"))


def _check_cp_degree(mesh, out: _Report) -> None:
    """mesh cp is a positive integer (what cp composes with: parc/analysis/cp_support.py)."""
    if not _positive_int(mesh.cp):
        out.error(f"mesh cp must be a positive integer, got {mesh.cp}", out.at("mesh.cp", mesh),
                  "cp=1 means the sequence is not split")


def _check_topology(plan: Plan, out: _Report) -> None:
    topo = plan.topology
    for key in ("nodes", "gpus_per_node"):
        if not _positive_int(getattr(topo, key)):
            out.error(f"topology {key} must be a positive integer, got {getattr(topo, key)}",
                      out.at(f"topology.{key}", topo))
        elif getattr(topo, key) > MAX_NODES:
            out.error(f"topology {key} {getattr(topo, key)} > {MAX_NODES}, the most parc plans for",
                      out.at(f"topology.{key}", topo))
    for key, attr in (("intra", "intra_bw"), ("inter", "inter_bw")):
        bw = getattr(topo, attr)
        if bw is not None and not bw > 0:
            out.error(f"topology {key} bandwidth must be positive, got {bw:g} B/s", out.at(f"topology.{key}", topo))
    if _positive_int(topo.nodes) and _positive_int(topo.gpus_per_node) and _positive_int(plan.mesh.world_size) \
            and topo.nodes * topo.gpus_per_node < plan.mesh.world_size:
        out.warn(f"mesh needs {plan.mesh.world_size} ranks but topology has nodes {topo.nodes} × "
                 f"gpus_per_node {topo.gpus_per_node} = {topo.nodes * topo.gpus_per_node} devices",
                 out.at("topology", topo), "the cost model will assume more devices than stated")


def _check_batch(plan: Plan, out: _Report) -> None:
    batch, dp = plan.batch, plan.mesh.dp
    if batch is None:
        return
    sizes = {"global": batch.global_size, "micro": batch.micro}
    if batch.accumulation is not None:
        sizes["accumulation"] = batch.accumulation
    bad = [k for k, v in sizes.items() if not _positive_int(v)]
    for key in bad:
        out.error(f"batch {key} must be a positive integer, got {sizes[key]}", out.at(f"batch.{key}", batch))
    if bad or not _positive_int(dp):
        return
    if batch.micro > MAX_MICRO:
        out.error(f"batch micro {batch.micro} > {MAX_MICRO} samples, the most parc traces in one micro-batch",
                  out.at("batch.micro", batch), "a micro-batch is what one rank runs at once; raise accumulation")
        return
    span = out.at("batch.global", batch)
    steps = batch.accumulation if batch.accumulation is not None else batch.global_size // (batch.micro * dp)
    if steps > MAX_MICRO_BATCHES:
        said = (f"accumulation {steps}" if batch.accumulation is not None else
                f"global {batch.global_size} / (micro {batch.micro} × dp {dp}) = {steps} micro-batches")
        out.error(f"batch {said} per step > {MAX_MICRO_BATCHES}, the most parc schedules",
                  out.at("batch.accumulation", batch) if batch.accumulation is not None else span,
                  "raise micro (samples per micro-batch) or dp")
        return
    if batch.accumulation is not None:
        product = batch.micro * batch.accumulation * dp
        if product != batch.global_size:
            out.error(f"global batch {batch.global_size} ≠ micro {batch.micro} × accumulation "
                      f"{batch.accumulation} × dp {dp} = {product}", span,
                      "global batch = micro × accumulation × dp; drop accumulation= to derive it")
    elif batch.global_size % (batch.micro * dp):
        per_step = batch.micro * dp
        out.error(f"global batch {batch.global_size} is not a multiple of micro {batch.micro} × dp {dp} "
                  f"= {per_step}", span,
                  f"the nearest multiples are {batch.global_size // per_step * per_step or per_step} "
                  f"and {(batch.global_size // per_step + 1) * per_step}")


def _check_tensor_parallel(plan: Plan, out: _Report) -> None:
    tp = plan.tensor_parallel
    first: dict[str, TPRule] = {}
    for i, rule in enumerate(tp.rules):
        if rule.style not in TP_STYLES:
            out.error(f"unknown tensor_parallel style `{rule.style}` for \"{rule.pattern}\"",
                      out.at(f"tensor_parallel.rules[{i}].style", rule), _one_of(rule.style, TP_STYLES))
        if not rule.pattern:
            out.error("empty tensor_parallel pattern", out.at("", rule), 'write a glob such as "blocks.*.attn.qkv"')
        if rule.pattern in first:
            line = first[rule.pattern].span.line if first[rule.pattern].span else "?"
            out.error(f"duplicate tensor_parallel pattern \"{rule.pattern}\"", out.at("", rule),
                      f"the first rule for it is on line {line}")
        first.setdefault(rule.pattern, rule)
    if tp.sequence_parallel and plan.mesh.tp == 1:
        out.warn("sequence_parallel with mesh tp 1 has no effect", out.at("tensor_parallel", tp))
    if tp.rules and plan.mesh.tp == 1:  # a warning: a tp plan run at tp 1 is a fair reuse (docs/plan-language.md)
        n = len(tp.rules)
        out.warn(f"with mesh tp 1, {n} tensor_parallel rule{'s' * (n != 1)} {'has' if n == 1 else 'have'} no effect",
                 out.at("tensor_parallel", tp), "raise mesh tp to split these modules, or drop the block")
    gpn = plan.topology.gpus_per_node
    if _positive_int(gpn) and _positive_int(plan.mesh.tp) and plan.mesh.tp > gpn:
        out.warn(f"mesh tp {plan.mesh.tp} > topology gpus_per_node {gpn}: tp groups span nodes, and TP's per-layer "
                 "all-reduces lose the in-node bandwidth", out.at("mesh.tp", plan.mesh),
                 f"use tp ≤ {gpn} and put the rest on dp or pp")


def _check_pipeline(plan: Plan, out: _Report, num_layers: int | None) -> None:
    pp, pipe = plan.mesh.pp, plan.pipeline
    # layers matter only to a pipeline: pp 1 runs a model of any shape, and explicit cuts need no layer list
    if num_layers == 0 and _positive_int(pp) and pp > 1 and (pipe is None or pipe.cuts is None):
        out.error(f"mesh pp {pp}: placing the stages needs repeated layers (an nn.ModuleList of one block class) "
                  "to cut between, and the model has none", out.at("mesh.pp", plan.mesh),
                  f'write the {pp - 1} cut{"s" * (pp > 2)}: pipeline {{ cut after "<module path>" }}')
    elif num_layers and _positive_int(pp) and pp > num_layers:
        out.error(f"mesh pp {pp} > {num_layers} layers: each pp rank needs at least one layer",
                  out.at("mesh.pp", plan.mesh), f"use pp ≤ {num_layers}")
    if pipe is None:
        return
    if pipe.schedule not in SCHEDULES:
        out.error(f"unknown pipeline schedule `{pipe.schedule}`", out.at("pipeline.schedule", pipe),
                  _one_of(pipe.schedule, SCHEDULES))
    if not _positive_int(pipe.virtual):
        out.error(f"pipeline virtual must be a positive integer, got {pipe.virtual}", out.at("pipeline.virtual", pipe))
        return
    if pipe.virtual > MAX_VIRTUAL:
        out.error(f"pipeline virtual {pipe.virtual} > {MAX_VIRTUAL}, the most parc schedules",
                  out.at("pipeline.virtual", pipe))
        return
    if pipe.schedule in INTERLEAVED and pipe.virtual < 2:
        out.error(f"schedule {pipe.schedule} needs virtual ≥ 2, got virtual {pipe.virtual}",
                  out.at("pipeline.virtual", pipe) if "pipeline.virtual" in plan.spans else out.at("pipeline.schedule", pipe),
                  "state virtual=2 (stages per pp rank) or use schedule=1f1b")
    elif pipe.schedule in SCHEDULES and pipe.schedule not in INTERLEAVED and pipe.virtual > 1:
        out.error(f"schedule {pipe.schedule} holds one stage per pp rank, got virtual {pipe.virtual}",
                  out.at("pipeline.virtual", pipe), "use schedule=interleaved_1f1b, or drop virtual=")
    if not _positive_int(pp):
        return
    total = pp * pipe.virtual
    if pipe.stages is not None and not _positive_int(pipe.stages):
        out.error(f"pipeline stages must be auto or a positive integer, got {pipe.stages}", out.at("pipeline.stages", pipe))
    elif pipe.stages is not None and pipe.stages != total:
        out.error(f"pipeline stages {pipe.stages} ≠ pp {pp} × virtual {pipe.virtual} = {total}",
                  out.at("pipeline.stages", pipe), "write stages=auto to derive it")
    if num_layers is not None and pipe.virtual > 1 and total > num_layers:
        out.error(f"pipeline needs pp {pp} × virtual {pipe.virtual} = {total} stages but the model has "
                  f"{num_layers} layers", out.at("pipeline.virtual", pipe), "each stage needs at least one layer")
    if pipe.cuts is not None:
        _check_cuts(plan, out, total)


def _check_schedule_size(plan: Plan, out: _Report) -> None:
    """A pipelined step's schedule has pp × virtual × micro-batches forward/backward slots, each built and
    simulated one by one: bound it (only when every factor passed its own check)."""
    pp, pipe, batch = plan.mesh.pp, plan.pipeline, plan.batch
    virtual = pipe.virtual if pipe is not None else 1
    if not (_positive_int(pp) and pp > 1 and _positive_int(virtual) and virtual <= MAX_VIRTUAL) or batch is None:
        return
    sizes = (batch.global_size, batch.micro, plan.mesh.dp) + ((batch.accumulation,) if batch.accumulation else ())
    if not all(_positive_int(v) for v in sizes) or batch.micro > MAX_MICRO:
        return
    m = plan.accumulation
    if m > MAX_MICRO_BATCHES or pp * virtual * m <= MAX_SCHEDULE_SLOTS:
        return
    out.error(f"pipeline schedule of pp {pp} × virtual {virtual} × {m} micro-batches = {pp * virtual * m} slots "
              f"> {MAX_SCHEDULE_SLOTS}, the most parc schedules in one step",
              out.at("batch.accumulation" if batch.accumulation is not None else "batch.global", batch),
              "fewer micro-batches per step: raise micro (samples per micro-batch) or dp")


def _check_cuts(plan: Plan, out: _Report, total: int) -> None:
    pipe = plan.pipeline
    if len(pipe.cuts) + 1 != total:
        out.error(f"{len(pipe.cuts)} cuts make {len(pipe.cuts) + 1} stages ≠ pp {plan.mesh.pp} × virtual "
                  f"{pipe.virtual} = {total}", out.at("pipeline", pipe), f"give {total - 1} cuts")
    for i, cut in enumerate(pipe.cuts):
        if cut.where not in CUT_WHERE:
            out.error(f"a cut is `before` or `after` a module, got `{cut.where}`",
                      out.at(f"pipeline.cuts[{i}].where", cut), _one_of(cut.where, CUT_WHERE))
        if any(c in cut.path for c in "*?[") or not cut.path:
            out.error(f"a cut names one module path, got \"{cut.path}\"", out.at("", cut),
                      'write the exact path, e.g. cut before "blocks.2"')


def _check_zero_shard(plan: Plan, out: _Report) -> None:
    """`zero shard=K` (HSDP): K dp ranks hold one copy of the sharded state, dp / K copies in all; K divides dp.
    With a topology, a shard group whose ranks sit on several nodes is warned about: its per-layer
    gathers and reduce-scatters would leave the node (placement: `parc.mesh.zero_groups`)."""
    k, dp, z = plan.zero.shard, plan.mesh.dp, plan.zero
    if k is None:
        return
    span = out.at("zero.shard", z)
    if not _positive_int(k):
        out.error(f"zero shard must be a positive integer, got {k}", span,
                  "shard=K shards the state over groups of K dp ranks; K = dp is plain ZeRO")
        return
    if z.stage == 0:
        out.error(f"zero shard={k} with stage 0: nothing is sharded", span,
                  "write zero stage=1, 2 or 3 with shard=, or drop shard=")
    if not _positive_int(dp):
        return
    if dp % k:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        out.error(f"zero shard {k} does not divide mesh dp {dp}: dp {dp} = shard × replicas needs "
                  f"dp % shard = 0, got {dp} % {k} = {dp % k}", span,
                  "shard must be one of the divisors of dp: " + ", ".join(map(str, divisors)))
        return
    if plan.mesh.ep != 1:
        return  # refused with expert parallelism (parc/analysis/support.py), not placed here
    topo = plan.topology
    if not (_positive_int(topo.gpus_per_node) and all(_positive_int(plan.mesh.degree(a)) for a in AXES)) or \
            sorted(plan.mesh.order) != sorted(AXES) or plan.mesh.world_size > MAX_WORLD:
        return
    from parc import mesh as meshlib  # pure arithmetic; imported here to keep the front end's imports small

    gpn = topo.gpus_per_node
    crossing = [g for g in meshlib.zero_groups(plan.mesh, k)["zero_shard"] if len({r // gpn for r in g}) > 1]
    if crossing:
        g = crossing[0]
        out.warn(f"zero shard={k}: {len(crossing)} shard group{'s span' if len(crossing) != 1 else ' spans'} nodes under topology "
                 f"gpus_per_node {gpn} (e.g. ranks {g[0]}..{g[-1]} on nodes {g[0] // gpn}..{g[-1] // gpn}): each "
                 "layer's gathers and reduce-scatters leave the node", span,
                 f"use shard ≤ the dp ranks of one node ({max(meshlib.shard_sizes_in_node(plan.mesh, gpn))} here), or reorder the mesh "
                 "so dp is inner")


OFFLOAD_DEVICES = ("cpu",)


def _check_zero_offload(plan: Plan, out: _Report) -> None:
    """`zero offload=cpu` (ZeRO-Offload): the optimizer's state and step move to host memory, so there must be a
    sharded optimizer (stage ≥ 1) to move; `cpu` is the one place it can go (DeepSpeed's `nvme` is not done)."""
    z = plan.zero
    if z.offload is None:
        return
    span = out.at("zero.offload", z)
    if z.offload not in OFFLOAD_DEVICES:
        out.error(f"zero offload must be cpu, got {z.offload}", span,
                  "offload=cpu keeps the fp32 masters and optimizer state in host memory; drop offload= to keep "
                  "them on the device")
    elif z.stage == 0:
        out.error(f"zero offload={z.offload} with stage 0: there is no sharded optimizer to offload", span,
                  "write zero stage=1, 2 or 3 with offload=, or drop offload=")


def _check_accumulate(plan: Plan, out: _Report) -> None:
    """`precision bf16 reduce=bf16 accumulate=bf16`: ZeRO-1/2 keep their gradient accumulators in bf16
    (runtime/parallel/zero.py), 2 bytes a parameter at ZeRO-1 and 2/N at ZeRO-2 instead of 4 and 4/N. Only
    where the runtime does it and a test holds it to the serial run: refused elsewhere, at the key."""
    acc = plan.grad_accumulate
    if acc == "fp32":
        return
    where = out.at("precision.accumulate")
    if acc not in REDUCE_DTYPES:
        out.error(f"precision accumulate must be fp32 or bf16, got `{acc}`", where, _one_of(acc, REDUCE_DTYPES))
    elif plan.precision != "bf16" or plan.grad_reduce != "bf16":
        # a bf16 accumulator reduced in fp32 would move 4 bytes of values rounded to 2: nothing gained
        out.error(f"precision {plan.precision} reduce={plan.grad_reduce} accumulate=bf16: bf16 gradient "
                  "accumulation needs bf16 compute and a bf16 reduction", where,
                  "write `precision bf16 reduce=bf16 accumulate=bf16`, or drop accumulate=")
    elif plan.zero.stage not in (1, 2):
        out.error(f"precision accumulate=bf16 under zero stage {plan.zero.stage}: bf16 gradient accumulators "
                  "are implemented for ZeRO-1 and ZeRO-2 only", where,
                  "state `zero stage=1` or `zero stage=2`, or drop accumulate=")
    elif plan.zero.offload is not None or plan.expert_parallel.patterns:
        what = f"zero offload={plan.zero.offload}" if plan.zero.offload is not None else "expert_parallel"
        out.error(f"precision accumulate=bf16 with {what} is not implemented: its gradients take another path "
                  "(runtime/parallel/offload.py, expert_parallel.py)", where, "drop accumulate=")
    elif plan.zero.shard is not None and plan.zero.shard < plan.mesh.dp:
        # tests/test_zero_bf16_accumulate.py trains dp, tests/test_bf16_accumulate_meshes.py dp with tp, pp or cp
        out.error(f"precision accumulate=bf16 with zero shard={plan.zero.shard}: no test holds bf16 gradient "
                  "accumulation to the serial run under HSDP (its replicas' all-reduce)", where,
                  "drop accumulate=, or drop zero shard=")


def _check_loss_scaling(plan: Plan, out: _Report) -> None:
    """fp16's scaler keys (runtime/loss_scale.py): only under fp16, each in its range, at its token."""
    ls, base = plan.loss_scaling, LossScaling()
    if plan.precision != "fp16":
        for key in LOSS_SCALING_KEYS:
            if getattr(ls, key) != getattr(base, key) or f"precision.{key}" in plan.spans:
                out.error(f"precision {plan.precision} {key}=: loss scaling is fp16's (fp32 and bf16 have fp32's "
                          f"exponent range and scale nothing)", out.at(f"precision.{key}"),
                          "write `precision fp16`, or drop the key")
        return
    if not 0 <= ls.initial_scale_power <= 64:
        out.error(f"precision initial_scale_power must be an integer 0..64, got {ls.initial_scale_power}",
                  out.at("precision.initial_scale_power"),
                  "the first scale is 2**initial_scale_power; DeepSpeed's default is 16 (65536)")
    for key in ("loss_scale_window", "hysteresis"):
        if getattr(ls, key) < 1:
            out.error(f"precision {key} must be a positive integer, got {getattr(ls, key)}", out.at(f"precision.{key}"),
                      f"DeepSpeed's default is {getattr(LossScaling(), key)}")
    if not ls.min_loss_scale > 0:
        out.error(f"precision min_loss_scale must be > 0, got {ls.min_loss_scale:g}", out.at("precision.min_loss_scale"),
                  "the scale is halved on overflow but never below it; DeepSpeed's default is 1")
    elif ls.loss_scale == 0 and ls.min_loss_scale > 2.0 ** ls.initial_scale_power:
        out.error(f"precision min_loss_scale {ls.min_loss_scale:g} is above the first scale "
                  f"2**{ls.initial_scale_power}", out.at("precision.min_loss_scale"),
                  "lower min_loss_scale or raise initial_scale_power")
    if ls.loss_scale < 0 or ls.loss_scale > 2.0 ** 64:
        out.error(f"precision loss_scale must be 0 (dynamic) or a static scale in (0, 2**64], got {ls.loss_scale:g}",
                  out.at("precision.loss_scale"), "0 lets the scale move (DeepSpeed's default)")


def _check_rest(plan: Plan, out: _Report) -> None:
    if plan.zero.stage not in (0, 1, 2, 3) or isinstance(plan.zero.stage, bool):
        out.error(f"zero stage must be 0, 1, 2 or 3, got {plan.zero.stage}", out.at("zero.stage", plan.zero),
                  "1 shards optimizer state, 2 also gradients, 3 also parameters")
    _check_zero_shard(plan, out)
    _check_zero_offload(plan, out)
    seen: dict[str, int] = {}
    for i, pattern in enumerate(plan.recompute.patterns):
        if not pattern:
            out.error("empty recompute pattern", out.at(f"recompute.patterns[{i}]", plan.recompute))
        elif pattern in seen:  # as a repeated tensor_parallel pattern is: the same mistake, the same answer
            out.error(f"duplicate recompute pattern \"{pattern}\"", out.at(f"recompute.patterns[{i}]", plan.recompute),
                      f"it is pattern {seen[pattern] + 1} of this statement already")
        seen.setdefault(pattern, i)
    if plan.precision not in PRECISIONS:
        out.error(f"unknown precision `{plan.precision}`", out.at("precision"), _one_of(plan.precision, PRECISIONS))
    if plan.compile not in COMPILE_MODES:
        out.error(f"unknown compile mode `{plan.compile}`", out.at("compile"), _one_of(plan.compile, COMPILE_MODES))
    if plan.grad_reduce not in REDUCE_DTYPES:
        out.error(f"precision reduce must be fp32 or bf16, got `{plan.grad_reduce}`", out.at("precision.reduce"),
                  _one_of(plan.grad_reduce, REDUCE_DTYPES))
    elif plan.grad_reduce == "bf16" and plan.precision != "bf16":
        out.error(f"precision {plan.precision} reduce=bf16: a bf16 gradient reduction needs bf16 compute",
                  out.at("precision.reduce"), "write `precision bf16 reduce=bf16`, or drop reduce=")
    _check_accumulate(plan, out)
    _check_loss_scaling(plan, out)
    opt = plan.optimizer
    if opt.name not in OPTIMIZERS:
        out.error(f"unknown optimizer `{opt.name}`", out.at("optimizer.name", opt), _one_of(opt.name, OPTIMIZERS))
    if not opt.lr > 0:
        out.error(f"optimizer lr must be > 0, got {opt.lr}", out.at("optimizer.lr", opt))
    elif opt.lr > 10:  # legal, but no published run uses one: most likely a typo (a missing `e-`)
        out.warn(f"optimizer lr={opt.lr:g} is far above any usual learning rate (1e-5 … 1e-1)",
                 out.at("optimizer.lr", opt), "did you mean a negative exponent, e.g. lr=3e-4?")
    for beta in opt.betas:
        if not 0 <= beta < 1:
            out.error(f"optimizer betas must lie in [0, 1), got {','.join(map(str, opt.betas))}",
                      out.at("optimizer.betas", opt), "the usual values are betas=0.9,0.999")
            break
    if not opt.eps > 0:
        out.error(f"optimizer eps must be > 0, got {opt.eps}", out.at("optimizer.eps", opt))
    if not opt.weight_decay >= 0:
        out.error(f"optimizer weight_decay must be ≥ 0, got {opt.weight_decay}", out.at("optimizer.weight_decay", opt))
    if opt.grad_clip is not None and not opt.grad_clip > 0:
        out.error(f"optimizer clip must be > 0, got {opt.grad_clip}", out.at("optimizer.clip", opt),
                  "clip is the max global gradient norm; drop it to disable clipping")
    _check_schedule(opt, out)


def _check_schedule(opt, out: _Report) -> None:
    """The optimizer's lr schedule and weight-decay groups (runtime/schedule_lr.py, runtime/param_groups.py)."""
    if opt.warmup < 0:
        out.error(f"optimizer warmup must be ≥ 0 steps, got {opt.warmup}", out.at("optimizer.warmup", opt))
    if opt.decay not in DECAYS:
        out.error(f"unknown lr decay `{opt.decay}`", out.at("optimizer.decay", opt), _one_of(opt.decay, DECAYS))
    elif opt.decay == "constant":
        for key in ("decay_steps", "min_lr"):
            if getattr(opt, key) is not None:
                out.error(f"optimizer {key} needs decay=linear or decay=cosine (the lr is constant after warmup)",
                          out.at(f"optimizer.{key}", opt), "add decay=cosine, or drop " + key)
    elif opt.decay_steps is None:
        out.error(f"optimizer decay={opt.decay} needs decay_steps=N, the step at which the lr reaches min_lr",
                  out.at("optimizer.decay", opt), "e.g. decay_steps=<the run's --steps>")
    elif opt.decay_steps <= opt.warmup:
        out.error(f"optimizer decay_steps {opt.decay_steps} must be > warmup {opt.warmup}: the decay runs from "
                  f"step {opt.warmup} to step decay_steps", out.at("optimizer.decay_steps", opt))
    if opt.min_lr is not None and not 0 <= opt.min_lr <= opt.lr:
        out.error(f"optimizer min_lr must lie in [0, lr {opt.lr:g}], got {opt.min_lr:g}", out.at("optimizer.min_lr", opt))
    names = tuple(opt.no_decay)
    if names != ("none",):
        for n in names:
            if n not in NO_DECAY:
                out.error(f"unknown no_decay class `{n}`", out.at("optimizer.no_decay", opt),
                          _one_of(n, NO_DECAY + ("none",)) + " (none: decay every parameter)")
                break


def _check_patterns(plan: Plan, out: _Report, paths: list[str]) -> None:
    """A glob that matches no module is an error: the rule would do nothing, most often from a typo (a plan
    that means it, e.g. one written for several models, marks the glob optional: `"glob"?`)."""
    rc = plan.recompute
    globs = [(r.pattern, r, "tensor_parallel", r.optional) for r in plan.tensor_parallel.rules]
    globs += [(p, rc, "recompute", p in rc.optional) for p in rc.patterns]
    suggested = 0  # difflib is slow: the closest paths only for the first 20 unmatched globs
    for i, (pattern, node, where, optional) in enumerate(globs):
        if pattern and not optional and not any(fnmatchcase(p, pattern) for p in paths):
            suggested += 1
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.0) if suggested <= 20 else []
            key = f"recompute.patterns[{i - len(plan.tensor_parallel.rules)}]" if where == "recompute" else ""
            out.error(f"{where} pattern \"{pattern}\" matches no module", out.at(key, node),
                      ("closest module paths: " + ", ".join(close) + "; " if close else
                       "" if paths else "the model has no modules; ") + f'mark it "{pattern}"? if it may match none')
    for i, pattern in enumerate(rc.patterns):
        _check_recompute_depths(pattern, paths, out, out.at(f"recompute.patterns[{i}]", rc))
    if plan.pipeline is not None and plan.pipeline.cuts:
        for cut in plan.pipeline.cuts:
            if cut.path and cut.path not in paths:
                suggested += 1
                close = difflib.get_close_matches(cut.path, paths, n=3, cutoff=0.0) if suggested <= 20 else []
                out.error(f"cut {cut.where} \"{cut.path}\": no module has this path", out.at("", cut),
                          "closest module paths: " + ", ".join(close) if close else None)


def _check_recompute_depths(pattern: str, paths: list[str], out: _Report, span: Span | None) -> None:
    """A recompute glob whose regions sit at different depths is a warning: a glob's `*` also matches dots, so
    `"layers.*[13579]"` meant for the odd layers also makes `layers.0.feed_forward.w1` a region of its own
    (bench/published.py recomputed 45% of the even layers' matmuls that way). A region is the outermost module
    the glob matches on a path (passes/recompute.py)."""
    regions = {p for p in paths if fnmatchcase(p, pattern)}
    regions = sorted(p for p in regions if not any(fnmatchcase(a, pattern) for a in _ancestors(p)))
    by_depth: dict[int, str] = {}
    for p in regions:
        by_depth.setdefault(p.count("."), p)
    if len(by_depth) > 1:
        shown = ", ".join(f"`{by_depth[d]}`" for d in sorted(by_depth))
        out.warn(f"recompute pattern \"{pattern}\" makes regions of modules at {len(by_depth)} depths ({shown}): "
                 "a glob's `*` also matches dots", span,
                 "match one depth per pattern (e.g. \"layers.[13579]\" \"layers.[1-9][13579]\" for odd layers), or "
                 "list the modules you mean")


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def _check_expert_parallel(plan: Plan, out: _Report) -> None:
    """ep groups are carved out of dp (docs/moe.md): ep divides dp, and ep > 1 needs rules naming the experts."""
    mesh, rules = plan.mesh, plan.expert_parallel
    if not _positive_int(mesh.ep):
        out.error(f"mesh ep must be a positive integer, got {mesh.ep}", out.at("mesh.ep", mesh))
        return
    if _positive_int(mesh.dp) and mesh.dp % mesh.ep:
        out.error(f"mesh ep {mesh.ep} does not divide dp {mesh.dp}: ep groups are carved out of the dp group, "
                  f"and dp {mesh.dp} / ep {mesh.ep} = {mesh.dp / mesh.ep:g} is not a whole number of groups",
                  out.at("mesh.ep", mesh), f"use an ep that divides dp {mesh.dp}, or raise dp")
    if mesh.ep > 1 and not rules.patterns:
        out.error(f"mesh ep {mesh.ep} but no `expert_parallel` rule names the experts to spread",
                  out.at("mesh.ep", mesh), 'add expert_parallel { "blocks.*.moe.experts" } (the ModuleList of experts)')
    if mesh.ep == 1 and rules.patterns:
        out.warn("expert_parallel with mesh ep 1 has no effect: every rank holds every expert",
                 out.at("expert_parallel", rules), "state the expert-parallel degree, e.g. `mesh dp=4 ep=2`")
    for i, pattern in enumerate(rules.patterns):
        if not pattern:
            out.error("empty expert_parallel pattern", out.at(f"expert_parallel.patterns[{i}]", rules),
                      'write a glob such as "blocks.*.moe.experts"')


def _check_experts(plan: Plan, out: _Report, paths: list[str]) -> None:
    """Each expert_parallel glob matches at least one list of experts, and ep divides each list's length."""
    ep = plan.mesh.ep
    for i, pattern in enumerate(plan.expert_parallel.patterns):
        if not pattern:
            continue
        span = out.at(f"expert_parallel.patterns[{i}]", plan.expert_parallel)
        matched = [p for p in paths if fnmatchcase(p, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.0)
            out.error(f"expert_parallel pattern \"{pattern}\" matches no module", span,
                      "closest module paths: " + ", ".join(close) if close else "the model has no modules")
            continue
        for path in matched:
            experts = [p for p in paths if p.startswith(path + ".") and p[len(path) + 1:].isdigit()]
            if not experts:
                out.error(f"expert_parallel pattern \"{pattern}\" matches `{path}`, which has no numbered children: "
                          "parc expects the ModuleList of experts", span,
                          "parc spreads a ModuleList of alike experts, each run on its capacity slots (E, cap, C) "
                          "(examples/moe.py, docs/moe.md); experts fused into one module's 3-D weights, as HF "
                          "Mixtral and Qwen2-MoE write them, are not a form it recognises")
            elif _positive_int(ep) and len(experts) % ep:
                out.error(f"`{path}` holds {len(experts)} experts, not a multiple of mesh ep {ep}: each ep rank "
                          f"holds experts / ep = {len(experts)} / {ep}", span,
                          f"use an ep that divides {len(experts)}")
