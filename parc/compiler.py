"""The driver: plan + model file → compiled/ directory.

Start here to see the whole compile: `compile_model` traces the model on the
meta device (`parc.trace`), checks the plan against it (`parc.grammar.validate`), runs
the passes once per program — one program per distinct (pipeline stage, tp rank)
— and writes plan.json, the programs, a copy of the model file and the manifest
(`parc.artifact`). Same inputs give byte-identical output.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import parc
from parc import artifact, codegen, mesh as meshlib
from parc.analysis import cost, review, support
from parc.errors import Diagnostic, ParcError, PlanError, TraceError
from parc.passes import PassCtx, context_parallel, dropout, expert_parallel, grad_buckets, pipeline_split, portable, recompute, run_passes, tensor_parallel, zero
from parc.passes import precision as precision_casts
from parc.passes.schedule import build_schedule, schedule_diagnostics
from parc.grammar.plan import Plan
from parc.trace import Traced, load_user_module, trace
from parc.traced import index_bounds, unread_params
from parc.trace_constants import MAX_CARRIED_ELEMENTS
from parc.grammar.validate import validate

log = logging.getLogger("parc.compile")

# The pass pipeline, in order. Each entry is (name, run(graph, plan, ctx) -> graph).
# dropout runs after tensor_parallel (it reads the shards) and before the split (it counts sites over the model)
PASSES: list = [("tensor_parallel", tensor_parallel.run), ("dropout", dropout.run)]
PASSES.insert(1, ("expert_parallel", expert_parallel.run))  # before dropout, which counts sites over the model
PASSES.insert(0, ("portable", portable.run))  # first: tensor_parallel's shape propagation runs CPU kernels
PASSES.insert(1, ("precision", precision_casts.run))  # bf16: no dtype guard the traced fp32 invalidates
PASSES.insert(2, ("context_parallel", context_parallel.run))  # mesh cp: before any pass that reads local shapes


def whole_pass_key(plan: Plan) -> tuple:
    """What `PASSES`, the whole-graph passes, read of a plan: the tensor-parallel block and degree, context and
    expert parallelism, the precision and the micro-batch (dropout's keys). Not dp, pp, the pipeline, ZeRO,
    recompute, the global batch, the optimizer or the topology: only the per-stage passes (pipeline_split, zero,
    recompute) read those. Two plans with one key get the same refusal from `PASSES` (`pass_errors`' memo)."""
    return (plan.tensor_parallel, plan.mesh.tp, plan.mesh.cp, plan.mesh.ep, plan.context_parallel,
            plan.expert_parallel, plan.precision, plan.micro_batch)


@dataclass
class CompileResult:
    out_dir: Path
    warnings: list[Diagnostic]
    plan_json: dict
    seconds: float


def _plan_summary(plan: Plan) -> dict:
    opt = plan.optimizer
    return {
        "mesh": {"dp": plan.mesh.dp, "pp": plan.mesh.pp, "tp": plan.mesh.tp, "order": list(plan.mesh.order)},
        "batch": {"global": plan.global_batch, "micro": plan.micro_batch, "accumulation": plan.accumulation},
        "zero": plan.zero.stage,
        "precision": plan.precision,
        "compile": plan.compile,
        "grad_reduce": plan.grad_reduce,  # `precision bf16 reduce=…` (runtime/precision.py reduce_dtype)
        # `precision bf16 reduce=bf16 accumulate=bf16` (runtime/precision.py accumulate_dtype); absent when fp32
        **({"grad_accumulate": plan.grad_accumulate} if plan.grad_accumulate != "fp32" else {}),
        # `precision fp16`'s scaler keys (runtime/loss_scale.py); absent under fp32 and bf16
        **({"loss_scaling": dataclasses.asdict(plan.loss_scaling)} if plan.precision == "fp16" else {}),
        "optimizer": {"name": opt.name, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                      "weight_decay": opt.weight_decay, "grad_clip": opt.grad_clip,
                      "warmup": opt.warmup, "decay": opt.decay, "decay_steps": opt.decay_steps,
                      "min_lr": opt.min_lr, "no_decay": list(opt.no_decay)},
        "sequence_parallel": plan.tensor_parallel.sequence_parallel,
        "recompute": list(plan.recompute.patterns),
        "schedule": plan.pipeline.schedule if plan.pipeline else None,
    }


def _state_entry(spec, shard, constants: dict) -> dict:
    entry = {"name": spec.name, "fqn": spec.fqn, "kind": spec.kind, "shape": _local_shape(spec.shape, shard),
             "dtype": spec.dtype, "requires_grad": spec.requires_grad, "shard": shard}
    if spec.fqn in constants:
        entry["value"] = constants[spec.fqn].tolist()  # its size was bounded where the trace made it
    return entry


def _local_shape(shape, shard) -> list[int]:
    """This rank's shape of a state tensor: dim `shard["dim"]` divided by `parts` (blocks keep the total)."""
    out = list(shape)
    if shard is not None:
        out[shard["dim"]] //= shard["parts"]
    return out


def _state_line(spec, shard) -> str:
    where = "full" if shard is None else f"dim {shard['dim']} part {shard['index']}/{shard['parts']}"
    if shard is not None and shard.get("blocks", 1) != 1:
        blocks = shard["blocks"]
        where += f" of each of {blocks} blocks" if isinstance(blocks, int) else f" of each block of {blocks}"
    return f"{spec.name} <- {spec.fqn}  {tuple(_local_shape(spec.shape, shard))}  {where}"


def compile_program(traced: Traced, plan: Plan, stage: int, tp_rank: int, debug: bool = False, stages: int = 1,
                    whole: dict | None = None):
    """One program. `whole`, shared by the calls of one compile, keeps each tp rank's graph after the
    whole-graph passes (which do not depend on the stage), so with pp stages they run once per tp rank,
    not once per program; pipeline_split copies the stage's nodes out of it and leaves it intact."""
    whole = {} if whole is None else whole
    if tp_rank not in whole:
        gm = copy.deepcopy(traced.gm)
        ctx = PassCtx(traced=traced, stage=stage, tp_rank=tp_rank, shards={s.name: None for s in traced.state},
                      notes={"stages": stages, "tp_shape_cache": whole.setdefault("tp_shapes", {})})
        whole[tp_rank] = (run_passes(gm, plan, ctx, PASSES, debug=debug), ctx)
        whole.setdefault("passed", set()).add(tp_rank)   # the whole-graph passes accepted the plan (pass_errors)
    gm, base = whole[tp_rank]
    notes = {k: v for k, v in base.notes.items() if k != "tp_shape_cache"}
    ctx = PassCtx(traced=traced, stage=stage, tp_rank=tp_rank, shards=dict(base.shards),
                  rewrites=dict(base.rewrites), notes=notes)
    if stage == stages - 1:  # its last program (zero below may edit the graph in place when stages == 1)
        del whole[tp_rank]
    # the split runs after the whole-graph passes (their nodes keep their stage in meta), then
    # zero runs after the passes whose parameters it partitions; recompute runs last, wrapping
    # each recomputed module's nodes, collectives included, as the other passes left them
    split = [("pipeline_split", pipeline_split.run)] if stages > 1 else []
    # precision's `extremes` and `norm_operands` after zero: their run-time dtype reads (`torch.finfo(x.dtype)`,
    # `w.to(x.dtype)`) are no op the other passes follow
    gm = run_passes(gm, plan, ctx, split + [("zero", zero.run), (precision_casts.EXTREMES, precision_casts.extremes),
                                            (precision_casts.NORMS, precision_casts.norm_operands),
                                            ("recompute", recompute.run)], debug=debug)
    return gm, ctx


def _pipeline(plan: Plan) -> tuple[str, int]:
    """(schedule name, virtual stages per pp rank); pp 1 has no pipeline whatever the plan says."""
    if plan.mesh.pp == 1:
        return "", 1
    pipe = plan.pipeline
    return (pipe.schedule, pipe.virtual) if pipe is not None else ("1f1b", 1)


def _tied(programs: dict, pp: int) -> list[dict]:
    """Parameters held by more than one stage (a tied embedding and lm head): grads are summed across them."""
    stages_of: dict[str, set] = {}
    for prog in programs.values():
        for e in prog["state"]:
            if e["kind"] == "param" and e["requires_grad"]:
                stages_of.setdefault(e["fqn"], set()).add(prog["stage"])
    tied = []
    for fqn, stages in sorted(stages_of.items()):
        if len(stages) < 2:
            continue
        ranks = sorted({s % pp for s in stages})
        if len(ranks) < len(stages):
            raise TraceError(f"parameter {fqn} is used by stages {sorted(stages)}, two of which share a pp rank; "
                             f"parc holds a shared parameter once per stage, on distinct pp ranks",
                             hint="move a cut so that its users fall on stages of different pp ranks")
        tied.append({"fqn": fqn, "stages": sorted(stages), "pp_ranks": ranks})
    return tied


def plan_checks(plan: Plan, num_layers: int | None = None) -> list:
    """The checks `parc compile` runs on the plan alone, before tracing, in its order; each raises a ParcError
    with its diagnostics. `plan_refusals` (parc report, parc plan) runs the same ones, so what they call
    refused is what compile refuses."""
    def preset() -> None:  # parc report would fail on it later, unlocated
        if (unknown := review.preset_error(plan)) is not None:
            raise PlanError(diagnostics=[unknown])

    return [lambda: validate(plan, num_layers=num_layers),  # sizes past parc's limits, before work scales
            lambda: support.check(plan),  # what the runtime does not implement (the plan alone says)
            preset]


def plan_refusals(plan: Plan, num_layers: int | None = None) -> list[Diagnostic]:
    """Every error of `plan_checks`, collected rather than raised: [] when compile would go on to trace."""
    out: list[Diagnostic] = []
    for check in plan_checks(plan, num_layers):
        try:
            check()
        except ParcError as e:
            out += [d for d in e.diagnostics if d.severity == "error"]
    return out


def compile_model(model_file: str | Path, plan: Plan, out_dir: str | Path, *, debug: bool = False,
                  exact_trace: bool = False, force: bool = False, grad_probe: bool = False,
                  max_carried_constant: int = MAX_CARRIED_ELEMENTS) -> CompileResult:
    """`force`: replace `out_dir` even if it is not an earlier artifact (parc/artifact.py `check_output`).
    `grad_probe`: compare the traced program's gradients with eager's first (parc/grad_probe.py; the CLI's
    default, off here so that tests compiling many plans of one model pay for it once).
    `max_carried_constant`: parc/trace_constants.py's bound on a tensor made in forward from data."""
    t0 = time.perf_counter()
    model_file = Path(model_file)
    artifact.check_output(Path(out_dir), force)
    for check in plan_checks(plan):  # the plan alone, before any work scales with it
        check()
    user = load_user_module(model_file)
    traced = trace(user, plan.micro_batch, fast=not exact_trace, debug=debug, max_carried=max_carried_constant)
    if grad_probe:
        from parc.grad_probe import probe
        probe(user, traced, plan.micro_batch)
    warnings = validate(plan, module_paths=traced.module_paths, num_layers=traced.num_layers)

    m = plan.mesh
    schedule_name, virtual = _pipeline(plan)
    n_stages = m.pp * virtual
    summaries, split_warnings = pipeline_split.assign_stages(traced, plan, n_stages)
    warnings += split_warnings
    schedule = None
    if n_stages > 1:
        warnings += schedule_diagnostics(schedule_name, m.pp, plan.accumulation, virtual)
        schedule = build_schedule(schedule_name, m.pp, plan.accumulation, virtual).to_json()
    programs: dict[str, dict] = {}
    files: dict[str, str] = {}
    whole: dict = {}  # tp rank → its graph after the whole-graph passes, shared by its stages
    bounds = index_bounds(traced)  # what each integer input indexes: checked against the data (runtime/data.py)
    for stage in range(n_stages):
        for tp_rank in range(m.tp):
            name = f"stage{stage}_tp{tp_rank}"
            gm, ctx = compile_program(traced, plan, stage, tp_rank, debug, n_stages, whole)
            if stage == 0 and tp_rank == 0:
                warnings += ctx.notes.get("tp_warnings", [])  # layers tp keeps whole by itself (passes/tp_gqa.py)
            split = ctx.notes.get("pipeline", {"recv": [], "send": [], "last": True})
            placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
            nodes = {n.name for n in gm.graph.nodes}
            state = [s for s in traced.state if s.name in placeholders]
            src = codegen.program_source(
                gm, stage=stage, tp_rank=tp_rank, tp=m.tp, model=model_file.name, plan=Path(plan.file).name,
                state_lines=[_state_line(s, ctx.shards.get(s.name)) + expert_parallel.slot_note(s.name, ctx) for s in state],
                inputs=[i.name for i in traced.inputs], boundary_lines=_boundary_lines(split, stage, m.pp))
            files[f"programs/{name}.py"] = src
            programs[name] = {
                "file": f"programs/{name}.py", "stage": stage, "tp_rank": tp_rank,
                "state": [_state_entry(s, ctx.shards.get(s.name), traced.constants) for s in state],
                "inputs": [_input_entry(i, bounds) for i in traced.inputs],
                "buckets": grad_buckets.assign(gm, state),
                "rewrites": dict(sorted(ctx.rewrites.items())),
                "tp_partial_grads": ctx.notes.get("tp_partial_grads", []),  # passes/tensor_parallel.py
                "tp_grad_reductions": ctx.notes.get("tp_grad_reductions", []),  # passes/tp_grads.py
                "tp_grad_gathers": [g for g in ctx.notes.get("tp_grad_gathers", [])  # passes/tp_grads.py
                                    if g["node"] in nodes],
                "tp_auto_replicated": [r for r in ctx.notes.get("tp_auto_replicated", [])  # passes/tp_gqa.py
                                       if r["param"] in placeholders],
                "zero": ctx.notes.get("zero"),  # ZeRO partition table (passes/zero.py); None at stage 0
                "recompute": ctx.notes.get("recompute", []),  # checkpointed module instances (passes/recompute.py)
            }
            if n_stages > 1:
                programs[name].update(recv=split["recv"], send=split["send"], last=split["last"])
            programs[name].update(expert_parallel.program_fields(gm, state, ctx, grad_buckets.assign))
            for e in programs[name]["state"]:  # which expert each slot is on each ep rank (runtime/parallel/expert_parallel.py)
                if e["name"] in ctx.notes.get("expert_parallel", {}):
                    e["ep_fqns"] = ctx.notes["expert_parallel"][e["name"]]

    model_src = model_file.read_text()
    dp = m.dp
    plan_json = {
        "format_version": artifact.FORMAT_VERSION,
        "parc_version": parc.__version__,
        "plan": {"file": Path(plan.file).name, "sha256": hashlib.sha256(plan.source.encode()).hexdigest(),
                 "source": plan.source, **_plan_summary(plan)},
        "model": {"file": "model/model.py", "name": model_file.name,
                  "sha256": hashlib.sha256(model_src.encode()).hexdigest(),
                  "param_count": traced.param_count, "num_layers": traced.num_layers,
                  "tokens_per_sample": _tokens_per_sample(traced)},
        "mesh": {"dp": m.dp, "pp": m.pp, "tp": m.tp, "order": list(m.order), "world_size": m.world_size},
        "ranks": [_rank_entry(m, r, virtual) for r in range(m.world_size)],
        "groups": {axis: meshlib.groups(m, axis) for axis in ("dp", "pp", "tp")},
        "stages": ([{"index": 0, "pp_rank": 0}] if n_stages == 1 else
                   [{"pp_rank": d["index"] % m.pp, "chunk": d["index"] // m.pp, **d} for d in summaries]),
        "programs": programs,
        # parameters the loss does not depend on: stepped with a zero gradient and no decay (parc/traced.py)
        "unread_params": unread_params(traced),
        "dropout": ctx.notes["dropout"],  # keyed sites and unkeyed random ops (passes/dropout.py), for --verify
        "costs": {"param_count": traced.param_count,
                  "dp_grad_allreduce_elements_per_rank": 2 * (dp - 1) * traced.param_count // max(dp, 1),
                  # per-stage FLOPs/params/activations of one micro-batch, for `parc report` (parc/analysis/cost.py)
                  "graph": cost.graph_stats(traced, plan),
                  # a plan naming a preset file: its figures travel with the artifact (`parc report compiled/`)
                  **_preset_file(plan)},
    }
    if m.ep > 1:  # expert parallelism: ep and edp groups, each rank's ep coordinate
        ep_groups = meshlib.expert_groups(m)
        plan_json["groups"].update(ep_groups)
        plan_json["mesh"]["ep"] = m.ep
        plan_json["plan"]["expert_parallel"] = list(plan.expert_parallel.patterns)
        plan_json["plan"]["mesh"]["ep"] = m.ep  # a checkpoint's record lists it; `--resume` says when it changes
        plan_json["expert_parallel"] = {"ep": m.ep, "layers": ctx.notes.get("expert_layers", [])}
        for entry in plan_json["ranks"]:
            entry["ep"] = meshlib.ep_rank(m, entry["rank"])
    if m.cp > 1:  # context parallelism: the cp rings, and the dp × cp groups gradients are reduced over
        plan_json["mesh"]["cp"] = plan_json["plan"]["mesh"]["cp"] = m.cp
        plan_json["groups"].update(cp=meshlib.groups(m, "cp"), dp_cp=meshlib.dp_cp_groups(m))
        plan_json["context_parallel"] = ctx.notes.get("context_parallel")
    if zero.hsdp(plan):  # `zero shard=K` < dp: the shard and replicate groups (parc/mesh.py zero_groups)
        plan_json["groups"].update(meshlib.zero_groups(m, plan.zero.shard))
        plan_json["plan"]["zero_shard"] = plan.zero.shard  # recorded only under HSDP, as mesh ep is
    if n_stages > 1:
        plan_json["schedule"] = schedule
        plan_json["tied"] = _tied(programs, m.pp)
    files["plan.json"] = artifact.dumps(plan_json)
    files["model/model.py"] = model_src
    files.update(_assets(user, model_file))
    artifact.write(Path(out_dir), files, force=force)
    return CompileResult(Path(out_dir), warnings, plan_json, time.perf_counter() - t0)


def _rank_entry(m, r: int, virtual: int) -> dict:
    """Rank → coordinates and its program; with virtual stages a rank holds `programs`, chunk order."""
    c = meshlib.coords(m, r)
    entry = {"rank": r, **c.as_dict(), "program": f"stage{c.pp}_tp{c.tp}"}
    if virtual > 1:
        entry["programs"] = [f"stage{k * m.pp + c.pp}_tp{c.tp}" for k in range(virtual)]
    return entry


def _boundary_lines(split: dict, stage: int, pp: int) -> list[str]:
    def one(d: dict, verb: str, peer: int) -> str:
        grad = ", its gradient comes back" if d["grad"] else ""
        return f"{verb} {d['name']} {tuple(d['shape'])} {d['dtype']} (stage {peer}){grad}"
    return ([one(d, "recv", stage - 1) for d in split["recv"]] +
            [one(d, "send", stage + 1) for d in split["send"]])


def _assets(user, model_file: Path) -> dict[str, bytes]:
    """Files the model names in `ASSETS` (paths relative to it), copied beside its copy."""
    out = {}
    for rel in getattr(user.module, "ASSETS", ()):
        src = (model_file.parent / rel).resolve()
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not src.is_file():
            raise TraceError(f"{model_file}: ASSETS entry {rel!r} must be an existing file below the model's folder")
        out[f"model/{Path(rel).as_posix()}"] = src.read_bytes()
    return out


def _input_entry(i, bounds: dict) -> dict:
    """plan.json's record of a batch input; `below`: the bound its ids must stay under, and what sets it."""
    entry = {"name": i.name, "shape": list(i.shape), "dtype": i.dtype}
    if i.name in bounds:
        entry.update(below=bounds[i.name][0], below_what=bounds[i.name][1])
    return entry


def _preset_file(plan) -> dict:
    """{"preset_file": the preset file's fields} when the plan's topology names a `parc calibrate` file (read
    relative to the plan's directory), so that the compiled/ directory is priced alike wherever it moves."""
    from dataclasses import fields

    from parc.analysis.preset_file import is_file, read_preset, resolve

    name = resolve(plan.topology.preset, plan.file)
    if name is None or not is_file(name):
        return {}
    return {"preset_file": read_preset(name, {f.name for f in fields(cost.Hardware)})}


def _tokens_per_sample(traced: Traced) -> int:
    first = traced.inputs[0]
    n = 1
    for d in first.shape[1:]:
        n *= d
    return n


def pass_errors(traced: Traced, plan: Plan, refusals: dict | None = None) -> list[Diagnostic]:
    """The diagnostics `parc compile` would stop with after tracing: tensor parallelism (every width tp does
    not divide, shared weights, ops it cannot shard), the pipeline split, ZeRO, a parameter two stages of one
    pp rank share, a constant too large to carry. Runs each stage's program for tp rank 0 only: the tp ranks'
    programs differ only in shard indices and vocab offsets, which no check reads. Assumes
    `pipeline_split.assign_stages` already ran on `traced` (as `parc check` and compile both do). With no error,
    the warnings compile would print: layers tensor parallelism keeps whole by itself (passes/tp_gqa.py).
    `refusals`, kept across calls on one `traced` (the planner's): the whole-graph passes' refusals by
    `whole_pass_key`, returned again without running them."""
    key = whole_pass_key(plan) if refusals is not None else None
    if key is not None and key in refusals:
        return refusals[key]
    _, virtual = _pipeline(plan)
    n = plan.mesh.pp * virtual
    whole: dict = {}
    programs = {}
    warnings: list[Diagnostic] = []
    try:
        for stage in range(n):
            gm, ctx = compile_program(traced, plan, stage, 0, stages=n, whole=whole)
            if stage == 0:
                warnings = ctx.notes.get("tp_warnings", [])  # layers tp keeps whole by itself (passes/tp_gqa.py)
            held = {x.name for x in gm.graph.nodes if x.op == "placeholder"}
            programs[stage] = {"stage": stage, "state": [{"fqn": s.fqn, "kind": s.kind, "requires_grad": s.requires_grad}
                                                         for s in traced.state if s.name in held]}
        if n > 1:
            _tied(programs, plan.mesh.pp)
        for spec in traced.state:
            if spec.fqn in traced.constants:
                _state_entry(spec, None, traced.constants)
    except ParcError as e:
        if key is not None and 0 not in whole.get("passed", ()):   # raised by the whole-graph passes
            refusals[key] = e.diagnostics
        return e.diagnostics
    return warnings
