"""The driver: plan + model file → compiled/ directory.

Start here to see the whole compile: `compile_model` traces the model on the
meta device (`parc.trace`), checks the plan against it (`parc.validate`), runs
the passes once per program — one program per distinct (pipeline stage, tp rank)
— and writes plan.json, the programs, a copy of the model file and the manifest
(`parc.artifact`). Same inputs give byte-identical output.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import parc
from parc import artifact, codegen, mesh as meshlib
from parc.errors import Diagnostic, TraceError
from parc.passes import PassCtx, grad_buckets, run_passes
from parc.plan import Plan
from parc.trace import Traced, load_user_module, trace
from parc.validate import validate

log = logging.getLogger("parc.compile")

# The pass pipeline, in order. Each entry is (name, run(graph, plan, ctx) -> graph).
PASSES: list = []


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
        "optimizer": {"name": opt.name, "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                      "weight_decay": opt.weight_decay, "grad_clip": opt.grad_clip},
        "sequence_parallel": plan.tensor_parallel.sequence_parallel,
        "recompute": list(plan.recompute.patterns),
        "schedule": plan.pipeline.schedule if plan.pipeline else None,
    }


MAX_INLINE_CONSTANT = 4096  # elements; a bigger tensor made in forward belongs in a buffer


def _state_entry(spec, shard, constants: dict) -> dict:
    entry = {"name": spec.name, "fqn": spec.fqn, "kind": spec.kind, "shape": list(spec.shape),
             "dtype": spec.dtype, "requires_grad": spec.requires_grad, "shard": shard}
    if spec.fqn in constants:
        value = constants[spec.fqn]
        if value.numel() > MAX_INLINE_CONSTANT:
            raise TraceError(f"the model creates a {tuple(value.shape)} tensor inside forward; parc carries at most "
                             f"{MAX_INLINE_CONSTANT} elements of such constants",
                             hint="register it as a buffer: self.register_buffer(name, tensor, persistent=False)")
        entry["value"] = value.tolist()
    return entry


def _state_line(spec, shard) -> str:
    where = "full" if shard is None else f"dim {shard['dim']} part {shard['index']}/{shard['parts']}"
    return f"{spec.name} <- {spec.fqn}  {tuple(spec.shape)}  {where}"


def compile_program(traced: Traced, plan: Plan, stage: int, tp_rank: int, debug: bool = False):
    gm = copy.deepcopy(traced.gm)
    ctx = PassCtx(traced=traced, stage=stage, tp_rank=tp_rank,
                  shards={s.name: None for s in traced.state})
    gm = run_passes(gm, plan, ctx, PASSES, debug=debug)
    return gm, ctx


def compile_model(model_file: str | Path, plan: Plan, out_dir: str | Path, *, debug: bool = False) -> CompileResult:
    t0 = time.perf_counter()
    model_file = Path(model_file)
    user = load_user_module(model_file)
    traced = trace(user, plan.micro_batch)
    warnings = validate(plan, module_paths=traced.module_paths, num_layers=traced.num_layers)

    m = plan.mesh
    programs: dict[str, dict] = {}
    files: dict[str, str] = {}
    for stage in range(1):  # pipeline stages arrive with the pipeline pass
        for tp_rank in range(m.tp):
            name = f"stage{stage}_tp{tp_rank}"
            gm, ctx = compile_program(traced, plan, stage, tp_rank, debug)
            placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
            state = [s for s in traced.state if s.name in placeholders]
            src = codegen.program_source(
                gm, stage=stage, tp_rank=tp_rank, tp=m.tp, model=model_file.name, plan=Path(plan.file).name,
                state_lines=[_state_line(s, ctx.shards.get(s.name)) for s in state],
                inputs=[i.name for i in traced.inputs])
            files[f"programs/{name}.py"] = src
            programs[name] = {
                "file": f"programs/{name}.py", "stage": stage, "tp_rank": tp_rank,
                "state": [_state_entry(s, ctx.shards.get(s.name), traced.constants) for s in state],
                "inputs": [{"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in traced.inputs],
                "buckets": grad_buckets.assign(gm, state),
                "rewrites": dict(sorted(ctx.rewrites.items())),
            }

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
        "ranks": [{"rank": r, **meshlib.coords(m, r).as_dict(),
                   "program": f"stage0_tp{meshlib.coords(m, r).tp}"} for r in range(m.world_size)],
        "groups": {axis: meshlib.groups(m, axis) for axis in ("dp", "pp", "tp")},
        "stages": [{"index": 0, "pp_rank": 0}],
        "programs": programs,
        "costs": {"param_count": traced.param_count,
                  "dp_grad_allreduce_elements_per_rank": 2 * (dp - 1) * traced.param_count // max(dp, 1)},
    }
    files["plan.json"] = artifact.dumps(plan_json)
    files["model/model.py"] = model_src
    files.update(_assets(user, model_file))
    artifact.write(Path(out_dir), files)
    return CompileResult(Path(out_dir), warnings, plan_json, time.perf_counter() - t0)


def _assets(user, model_file: Path) -> dict[str, bytes]:
    """Files the model names in `ASSETS` (paths relative to it), copied beside its copy."""
    out = {}
    for rel in getattr(user.module, "ASSETS", ()):
        src = (model_file.parent / rel).resolve()
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not src.is_file():
            raise TraceError(f"{model_file}: ASSETS entry {rel!r} must be an existing file below the model's folder")
        out[f"model/{Path(rel).as_posix()}"] = src.read_bytes()
    return out


def _tokens_per_sample(traced: Traced) -> int:
    first = traced.inputs[0]
    n = 1
    for d in first.shape[1:]:
        n *= d
    return n
