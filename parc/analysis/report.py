"""`parc report`: the seed's three-step review of a plan — memory, communication, utilization.

Start at `build(compiled, model=, plan=, preset=)`: it gathers the plan and the
per-stage statistics (from a compiled/ directory's plan.json, or by tracing
`--model` under `--plan` when there is no artifact: no pass has to run), asks
`parc.cost.estimate`, and returns a JSON-ready dict. `render` prints it as rich
tables; `to_json` as text.

1. Memory per pp rank (the tp and dp ranks of one pp rank are alike) with a
   verdict against the preset's GPU memory: fits, or over by how much.
2. Communication per step by axis and collective, bytes per rank split into
   intra-node and inter-node, and its share of the step time.
3. Utilization: FLOPs per step, the simulated pipeline bubble, step time, MFU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parc.analysis import cost, cp_cost, experts, tp_grad_sums
from parc.analysis.preset_file import implausible, resolve
from parc.errors import ParcError, PlanError

GiB = cost.GiB


def _size(b: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (tiny test models stay readable)."""
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _unit(values) -> tuple[str, float]:
    """One binary unit for a whole table, the largest that keeps its largest value ≥ 1: each cell is then a
    bare number that fits an 80-column terminal, and the columns compare at a glance."""
    top = max(values, default=0)
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if top >= scale:
            return unit, scale
    return "B", 1


def _in(b: float, scale: float) -> str:
    """`b` bytes in the table's unit: two decimals (none for bytes); a non-zero size too small to show, "<0.01"."""
    if scale == 1:
        return f"{b:.0f}"
    return f"{b / scale:.2f}" if b == 0 or b / scale >= 0.005 else "<0.01"


def _inputs(compiled: Path | None, model: Path | None, plan_path: Path | None, saves: tuple = (),
            loss: str = "eager"):
    """(plan, stats, notes, plan.json or None for the analytic report). `saves`: another framework's op-level
    checkpointing (`--recompute-saves`), `loss`: its loss kernel (`--loss`): the statistics are traced for them
    (a compiled/ directory's model again)."""
    from parc.grammar.parser import load_plan, parse

    notes = []
    if compiled is not None and (model is not None or plan_path is not None):
        given = " and ".join(f for f, v in (("--model", model), ("--plan", plan_path)) if v is not None)
        raise ParcError(f"parc report {compiled}: {given} would be ignored: a compiled/ directory carries its own "
                        "plan and model", hint="parc report compiled/   or   parc report --model model.py --plan plan.par")
    if compiled is not None:
        from parc import artifact

        art = artifact.load(compiled)
        pj = art.plan
        plan = parse(pj["plan"]["source"], file=pj["plan"]["file"])
        stats = pj.get("costs", {}).get("graph")
        if stats is None or saves or loss != "eager":  # an artifact from before plan.json carried them; another
            # framework's checkpointing or loss
            notes.append("plan.json has no costs.graph: traced model/model.py again" if stats is None else
                         "--recompute-saves / --loss: traced model/model.py again for that system")
            stats = _trace_stats(compiled / "model" / "model.py", plan, saves, loss)
        if plan.mesh.ep > 1:
            stats = dict(stats, experts=experts.from_artifact(pj))
        return plan, stats, notes, pj
    if model is None or plan_path is None:
        raise ParcError("parc report needs a compiled/ directory, or both --model and --plan",
                        hint="parc report compiled/   or   parc report --model model.py --plan plan.par")
    plan = load_plan(plan_path)
    from parc.analysis.review import preset_error
    if (bad := preset_error(plan)) is not None:   # located at the plan's `preset=`, before the trace
        raise PlanError(diagnostics=[bad])
    notes.append("analytic: traced the model under the plan; no compile pass ran")
    return plan, _trace_stats(model, plan, saves, loss), notes, None


def _trace_stats(model: Path, plan, saves: tuple = (), loss: str = "eager") -> dict:
    from parc.passes.pipeline_split import assign_stages
    from parc.trace import load_user_module, trace

    if not Path(model).is_file():
        raise ParcError(f"model {model}: no such file")
    traced = trace(load_user_module(model), plan.micro_batch)
    virtual = plan.pipeline.virtual if plan.pipeline is not None and plan.mesh.pp > 1 else 1
    assign_stages(traced, plan, plan.mesh.pp * virtual)
    stats = cost.graph_stats(traced, plan, saves, loss)
    if plan.mesh.ep > 1:  # the MoE layers, as the expert_parallel pass would find them
        stats["experts"] = experts.layers_of(traced, plan)
    return stats


def _artifact_params(pj: dict) -> list[int]:
    """Parameters per pp rank as the compiled programs hold them (local shard shapes), max over tp ranks."""
    pp = pj["mesh"]["pp"]
    per_stage: dict[tuple[int, int], int] = {}
    for prog in pj["programs"].values():
        n = 0
        for e in prog["state"]:
            if e["kind"] == "param" and e["requires_grad"]:
                k = 1
                for d in e["shape"]:
                    k *= d
                n += k
        per_stage[(prog["stage"], prog["tp_rank"])] = n
    sums: dict[tuple[int, int], int] = {}  # (pp rank, tp rank) -> params over the rank's stages
    for (stage, tp_rank), n in per_stage.items():
        sums[(stage % pp, tp_rank)] = sums.get((stage % pp, tp_rank), 0) + n
    return [max(v for (r, _), v in sums.items() if r == rank) for rank in range(pp)]


def system_of(args) -> cost.System:
    """The `System` of `parc report`'s flags (cli.py): the one place they are read."""
    saves = tuple(x for x in (args.recompute_saves or "").split(",") if x)
    return cost.System(attention=args.attention, pp_sends=args.pp_sends, dp_overlap=not args.no_dp_overlap,
                       dp_wire=args.dp_wire, nics=args.nics or 0, recompute_saves=saves,
                       pp_engine=args.pp_engine, zero_prefetch=args.zero_prefetch, loss=args.loss,
                       cp_attention=args.cp_attention, tp_overlap=args.tp_overlap)


def build_from_args(args) -> dict:
    """`parc report`'s report from its parsed arguments (cli.py `cmd_report`, and bench/published.py)."""
    return build(args.compiled, model=args.model, plan=args.plan, preset=args.preset, allreduce=args.allreduce,
                 system=system_of(args))


def build(compiled: Path | None = None, *, model: Path | None = None, plan: Path | None = None,
          preset: str | None = None, allreduce: str | None = None, system: cost.System | None = None) -> dict:
    """The report of a compiled/ directory, or of `model` and `plan` analytically. `system`: how the run
    priced differs from parc's runtime (`parc report`'s --attention, --pp-sends, --no-dp-overlap, --dp-wire,
    --nics; default: parc's own)."""
    system = system or cost.System()
    plan_obj, stats, notes, pj = _inputs(compiled, model, plan, system.recompute_saves, system.loss)
    art_params = _artifact_params(pj) if pj is not None else None
    topo = plan_obj.topology
    embedded = (pj or {}).get("costs", {}).get("preset_file") if preset is None else None
    name = preset or resolve(topo.preset, plan_obj.file if pj is None else None)
    hw = system.hardware(cost.hardware(name, topo, embedded=embedded))
    warnings = assumed_hardware(name, hw) + implausible(hw)
    from parc.compiler import plan_refusals
    # what compile refuses is priced (the figures of a plan parc will not run), but said before anything else
    refusals = [d.message for d in plan_refusals(plan_obj)]
    if topo.span is None:  # no `topology` line: the Topology defaults stand in for the nodes
        notes.append(f"no topology in the plan: {topo.gpus_per_node} ranks per node assumed (rank r on node "
                     f"r // {topo.gpus_per_node}); state `topology nodes= gpus_per_node=` to price your own")
    if stats.get("data_dependent"):
        notes.append(f"{stats['data_dependent']} tensors have sizes that depend on the data (tokens routed by a mask "
                     "or to an expert): priced at their upper bounds, so their memory is the worst case and their "
                     "FLOPs high (parc/trace_sizes.py)")
    ep_info = stats.get("experts")
    # a cp plan: dp × cp ranks on 1/cp of the tokens, plus the ring or all-to-alls (cp_cost.py); an ep rank its
    # own experts, unless the artifact counted what each rank holds
    est = cp_cost.estimate_plan(plan_obj, stats, hw, allreduce=allreduce or "ring", params_per_rank=art_params,
                                **system.estimate_options())
    notes += system.notes()
    if system.cp_attention != "parc" and plan_obj.mesh.cp == 1:
        notes.append(f"--cp-attention {system.cp_attention}: the plan has no context parallelism (mesh cp 1), "
                     "so it changes nothing")
    if system.recompute_saves and not plan_obj.recompute.patterns:
        notes.append("--recompute-saves: the plan recomputes nothing (no `recompute` line), so it changes nothing")
    ep = experts.section(ep_info, plan_obj, hw)  # mesh ep > 1: the all-to-all row, the experts' state
    if ep is not None:
        est = experts.charge(est, ep["row"])
    if pj is not None:  # the gradient sums tensor parallelism inserted (plan.json), on the step
        rows, per_step, per_micro = tp_grad_sums.section(pj, plan_obj, hw, allreduce or "ring")
        est = tp_grad_sums.charge(est, rows)
        if rows:
            notes.append(f"tp partial gradients: {per_step:,} parameter elements summed over tp once a step, "
                         f"{per_micro:,} elements' gradients per micro-batch (plan.json tp_grad_reductions; "
                         "all-gathers: tp_grad_gathers)")
        extra, whole = tp_grad_sums.replicated_compute(pj, plan_obj, hw)
        if whole:
            est = tp_grad_sums.charge_compute(est, extra)
            notes.append(f"k/v layers with fewer kv heads than tp (plan.json tp_auto_replicated: one kv head a rank "
                         f"in the kv-subset form, all when kept whole): {', '.join(whole)}; their matmuls beyond "
                         f"1/tp add {extra * 1e3:.3f} ms to the step")
    elif plan_obj.mesh.tp > 1:
        notes.append("tp partial gradients (replicated values on sharded ones, passes/tp_grads.py) are priced "
                     "from a compiled/ directory only: this analytic report does not run the pass")
    if art_params is not None:
        notes.append("parameters per rank: counted from the compiled programs' state (their shard shapes)")
    notes += est.notes
    m = plan_obj.mesh
    rows = []
    for r, row in enumerate(est.memory):
        d = {f"{k}_bytes": round(v) for k, v in row.items()
             if k in ("params", "grads", "optimizer", "activations", "activations_kept", "recompute_peak", "total",
                      "transient", "zero_working", "host", "offload_frees")}
        d.update(pp_rank=r, params_count=int(row["params_count"]), inflight=row["inflight"])
        rows.append(d)
    worst = max(est.memory, key=lambda row: row["total"])
    over = worst["total"] - hw.memory
    verdict = (f"fits: the fullest rank (pp {worst['pp_rank']}) needs {_size(worst['total'])} of "
               f"{_size(hw.memory)}" if over <= 0 else
               f"does not fit: pp rank {worst['pp_rank']} needs {_size(worst['total'])}, over the "
               f"{_size(hw.memory)} of a {hw.name} by {_size(over)}")
    comm = [{"axis": c.axis, "collective": c.collective, "group": c.group, "bytes_per_rank": round(c.bytes),
             "intra_bytes": round(c.intra), "inter_bytes": round(c.inter), "seconds": c.seconds}
            for c in est.comms]
    tokens = plan_obj.global_batch * stats.get("tokens_per_sample", 0)
    if ep is not None:
        notes.append("ep all-to-all: its time is on the step, not overlapped (the experts wait for their tokens); "
                     "each rank's memory holds 1/ep of the experts; dp's all-reduce counts every parameter a rank "
                     "holds over dp, though experts reduce over dp / ep ranks")
    if est.mfu > 1:
        warnings.append(mfu_warning(est))
    rep = {
        "source": "compiled" if compiled is not None else "analytic",
        "refusals": refusals,
        "warnings": warnings,
        "notes": notes,
        "hardware": {"name": hw.name, "memory_bytes": hw.memory, "peak_flops": hw.flops,
                     "achievable": hw.achievable, "memory_gbps": hw.mem_bw / 1e9, "matmul_table": len(hw.matmul),
                     "source": hw.source, "intra_gbps": hw.intra_bw / 1e9, "inter_gbps": hw.inter_bw / 1e9,
                     "intra_allreduce_gbps": hw.intra_allreduce_bw / 1e9,
                     "gpus_per_node": hw.gpus_per_node, "cores": hw.cores, "allreduce": allreduce or "ring"},
        "plan": {"dp": m.dp, "pp": m.pp, "tp": m.tp, "ep": m.ep, "cp": m.cp, "world_size": m.world_size,
                 "global_batch": plan_obj.global_batch, "micro": plan_obj.micro_batch,
                 "accumulation": plan_obj.accumulation, "precision": plan_obj.precision,
                 "zero": plan_obj.zero.stage, "zero_shard": plan_obj.zero.shard or m.dp * m.cp,
                 "zero_offload": plan_obj.zero.offload, "recompute": list(plan_obj.recompute.patterns),
                 "schedule": (plan_obj.pipeline.schedule if plan_obj.pipeline else "1f1b") if m.pp > 1 else None},
        "memory": {"per_pp_rank": rows, "capacity_bytes": hw.memory, "fits": over <= 0,
                   "over_bytes": max(round(over), 0), "verdict": verdict},
        "communication": {"rows": comm, "seconds": est.comm_seconds, "exposed_seconds": est.exposed_comm_seconds,
                          "exposed_parts": _exposed_parts(est),
                          # what the collectives hidden under compute slow it by, in the step (`cost.beside`)
                          "beside_seconds": est.beside_seconds,
                          "share_of_step": round(est.exposed_comm_seconds / est.step_seconds, 4)
                          if est.step_seconds else 0},
        "utilization": {"model_flops_per_step": est.model_flops, "hardware_flops_per_step": est.hardware_flops,
                        "bubble": est.bubble, "schedule_bubble": est.schedule_bubble, "compute_seconds": est.compute_seconds,
                        "step_seconds": est.step_seconds, "mfu": est.mfu,
                        "tokens_per_step": tokens},
    }
    if ep is not None:
        rep["experts"] = ep["experts"]
    return rep


def assumed_hardware(name: str | None, hw) -> list[str]:
    """The loud line when no preset was named: the hardware every rank was priced as, said first (a CPU job
    priced as an H100 is off by orders of magnitude); [] when the plan or --preset names one."""
    if name is not None:
        return []
    from parc.analysis.preset_file import has_gpu
    where = "this machine has no GPU, and " if not has_gpu() else ""
    return [f"{where}no preset was named (--preset, or `topology preset=` in the plan): every rank is priced as "
            f"an {hw.name}; for this machine's CPU ranks run `parc calibrate --device cpu -o cpu.json` and pass "
            "--preset cpu.json"]


def mfu_warning(est) -> str:
    """MFU above 100% is no plan's: the preset's peak or its tables are wrong for the device."""
    return (f"MFU {est.mfu:.0%} > 100%: the step is priced faster than the {est.hw.name} preset's own peak "
            f"allows ({est.model_flops:.3g} model FLOPs in {est.step_seconds:.3g} s): its figures are implausible "
            "(a calibration on a busy machine, or a peak below the device's)")


# each axis whose communication can add to the step: the Estimate's field for it, and the words the report says
EXPOSED = {"tp": ("tp_seconds", "tp on the critical path"),
           "pp": ("p2p_exposed_seconds", "P2P beyond the schedule's own bubble"),
           "dp": ("dp_exposed_seconds", "dp not hidden behind backward"),
           "ep": ("ep_seconds", "ep all-to-all"),
           "cp": ("cp_seconds", "cp's K and V exchange")}


def _exposed_parts(est) -> dict[str, float]:
    """What each axis adds to the step (the exposed seconds, before their cap at the step), so the
    report can say where the exposed communication comes from (`EXPOSED`)."""
    return {axis: getattr(est, field) for axis, (field, _) in EXPOSED.items()}


def _rank_words(hw: dict) -> tuple[str, str]:
    """(what one rank is, the node line): a GPU preset names its device; a calibrated CPU preset (it
    has cores) a share of its host. "GPU" is never said of a rank that is not one."""
    if hw.get("cores"):
        return f"each rank a process on {hw['name']} ({hw['cores']} cores shared)", "ranks per host"
    return f"each rank one {hw['name']} ({_size(hw['memory_bytes'])})", "ranks per node"


def to_json(rep: dict) -> str:
    return json.dumps(rep, indent=2, ensure_ascii=False)


def render(rep: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped to a file, rich would wrap at 80 columns and cut headers and values ("optimiz…"):
    # there, lines are never wrapped and tables get the width their contents need.
    console = console or (Console() if sys.stdout.isatty() else Console(width=240, soft_wrap=True))
    p, hw = rep["plan"], rep["hardware"]
    for r in rep.get("refusals", []):   # said first: parc would not run this plan at all
        console.print(f"[bold red]compile refuses this[/]: {r}")
    for w in rep.get("warnings", []):   # then what makes every figure below doubtful
        console.print(f"[bold yellow]warning[/]: {w}")
    console.print(f"[bold]plan[/]: dp {p['dp']} × pp {p['pp']} × tp {p['tp']} = {p['world_size']} ranks"
                  + (f" (ep {p['ep']} inside dp)" if p.get("ep", 1) > 1 else "") + ", "
                  f"global batch {p['global_batch']} = micro {p['micro']} × accumulation {p['accumulation']} × "
                  f"dp {p['dp']}, {p['precision']}, ZeRO {p['zero']}"
                  + (f" shard {p['zero_shard']} (HSDP)" if p.get("zero_shard", p["dp"]) < p["dp"] and p["zero"] else "")
                  + (f" offload {p['zero_offload']}" if p.get("zero_offload") and p["zero"] else "")
                  + f", schedule {p['schedule'] or '-'}, "
                  f"recompute {', '.join(p['recompute']) or 'none'}")
    device, per_node = _rank_words(hw)
    console.print(f"[bold]hardware[/]: {device}, {hw['gpus_per_node']} {per_node}, "
                  f"intra {hw['intra_gbps']:g} GB/s"
                  + (f" (all-reduce {hw['intra_allreduce_gbps']:g}, NVLS)" if hw.get("intra_allreduce_gbps") else "")
                  + f", inter {hw['inter_gbps']:g} GB/s per rank, "
                  + (f"matmul efficiency from a {hw['matmul_table']}-shape table, memory {hw['memory_gbps']:g} GB/s"
                     if hw.get("matmul_table") else f"achievable {hw['achievable']:.0%} of peak")
                  + f", {hw['allreduce']} all-reduce" + (f" ({hw['source']})" if hw.get("source") else ""))

    mem = rep["memory"]
    unit, scale = _unit(r["total_bytes"] for r in mem["per_pp_rank"])
    t = Table(title=f"1. Memory per rank ({unit})", title_justify="left")
    working = any(r.get("zero_working_bytes") for r in mem["per_pp_rank"])  # ZeRO-2/3's collectives in flight
    cols = ["pp rank", "params", "grads", "optimizer", "activations", "in flight"] + (["ZeRO in flight"] if working else []) + ["total"]
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    for r in mem["per_pp_rank"]:
        t.add_row(str(r["pp_rank"]), *(_in(r[f"{k}_bytes"], scale) for k in ("params", "grads", "optimizer",
                                                                            "activations")),
                  str(r["inflight"]), *([_in(r.get("zero_working_bytes", 0), scale)] if working else []),
                  _in(r["total_bytes"], scale))
    console.print(t)
    for r in mem["per_pp_rank"]:  # ZeRO-Offload (parc/analysis/offload_cost.py): the host's side of the table
        if "host_bytes" in r:
            moved = "the optimizer state" + (", the fp32 masters" if p["precision"] != "fp32" else "")
            console.print(f"pp rank {r['pp_rank']}: offload frees {_in(r['offload_frees_bytes'], scale)} {unit} of "
                          f"device memory ({moved}) and holds {_in(r['host_bytes'], scale)} {unit} in "
                          "host memory (fp32 masters, gradient buffer, optimizer state)")
    console.print(("[green]" if mem["fits"] else "[red]") + mem["verdict"] + "[/]")

    comm = rep["communication"]
    unit, scale = _unit(c["bytes_per_rank"] for c in comm["rows"])
    t = Table(title=f"2. Communication per step, per rank (volumes in {unit}; seconds with every call's latency)",
              title_justify="left")
    for c in ("axis", "collective", "group", "volume", "intra-node", "inter-node", "seconds"):
        t.add_column(c, justify="right", no_wrap=c != "collective")  # a long collective name wraps, no number
    for c in comm["rows"]:
        t.add_row(c["axis"], c["collective"], str(c["group"]), _in(c["bytes_per_rank"], scale),
                  _in(c["intra_bytes"], scale), _in(c["inter_bytes"], scale), f"{c['seconds']:.3g}")
    console.print(t)
    if rep.get("experts"):
        console.print(experts.line(rep["experts"]))
    console.print(_comm_line(comm))

    u = rep["utilization"]
    t = Table(title="3. Utilization", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("model FLOPs per step", f"{u['model_flops_per_step']:.3e}")
    if p["recompute"]:  # the FLOPs the hardware runs: the recomputed forwards added
        t.add_row("with recompute", f"{u['hardware_flops_per_step']:.3e}")
    if p["schedule"]:  # a pipeline: its schedule's idle share, priced per stage (parc viz draws unit costs)
        t.add_row("pipeline bubble (schedule, each stage's priced F and B)", f"{u['schedule_bubble']:.1%}")
        t.add_row("idle share, P2P time included (simulated)", f"{u['bubble']:.1%}")
    t.add_row("compute time per step", f"{u['compute_seconds']:.3g} s")
    t.add_row("estimated step time", f"{u['step_seconds']:.3g} s")
    t.add_row("tokens per step", f"{u['tokens_per_step']:,}")
    t.add_row("MFU", f"{u['mfu']:.1%}")
    console.print(t)
    for n in rep["notes"]:
        console.print(f"note: {n}")


def _comm_line(comm: dict) -> str:
    """The two totals under the table, both with every call's latency: the rows added up (as if nothing
    overlapped compute), and what communication adds to the step, by axis; then what the hidden rest costs
    the compute it runs under (`cost.beside`)."""
    parts = comm.get("exposed_parts", {})
    named = ", ".join(f"{EXPOSED[a][1]} {v:.3g} s" for a, v in parts.items() if v > 0) or "none"
    line = (f"communication: {comm['seconds']:.3g} s per step, the rows above added up (latency included) as if "
            f"none of it overlapped compute; exposed {comm['exposed_seconds']:.3g} s = {comm['share_of_step']:.1%} "
            f"of the step, the time it adds to the step: {named}")
    if comm["exposed_seconds"] > comm["seconds"] * (1 + 1e-9):
        line += (" (more than the rows: the critical path crosses the P2P hops of several pp ranks, each row "
                 "one rank's)")
    if comm.get("beside_seconds"):
        line += f"; what hides slows the compute beside it, {comm['beside_seconds']:.3g} s more in the step"
    return line
