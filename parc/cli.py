"""The `parc` command: check a plan, compile a model under it.

Every user mistake arrives here as a `ParcError`; it is printed with all its
diagnostics (`file:line:col: error: …`, the line, a caret, a hint) and the
command exits 2 — never with a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from parc.errors import Diagnostic, ParcError, render_all

_STARTED = time.perf_counter()  # the command's own start: the times it prints include importing torch

DESCRIPTION = """parc compiles a parallel training plan (a .par file) and a PyTorch model file
into one readable program per rank, then runs them under torchrun.

  parc check   plan.par [--model model.py] [--world-size N]   find every mistake in a plan
  parc compile model.py --plan plan.par -o compiled/            write the per-rank programs
  torchrun --nproc-per-node N -m parc.run compiled/            train
  parc run     compiled/ [parc.run options]                     the same, on this machine, parc's lines alone
  parc export  checkpoints/ -o model.safetensors               one file from a sharded checkpoint
  parc export  checkpoints/ -o hf-model/ --hf compiled/        a Hugging Face directory (from_pretrained)
  parc import-deepspeed ds_config.json [--world-size N]       a .par from a DeepSpeed config
  parc report  compiled/ [--json]                             memory, communication, step time, MFU
               (--attention, --pp-sends, --pp-engine, --no-dp-overlap, --zero-prefetch, --dp-wire, --nics,
               --recompute-saves, --tp-overlap: price another framework's run)
  parc calibrate --device cpu -o preset.json                    measure this device: a preset for --preset FILE
  parc plan    model.py --gpus N --global-batch B -o plan.par  search the plans, write the fastest that fits
  parc viz     compiled/ -o viz/                              mesh, pipeline schedule, stages as SVG/PNG
"""


def _recompute_saves(text: str) -> str:
    """`--recompute-saves`: a comma-separated list of the op classes `cost.System.SAVES` names."""
    from parc.analysis.cost import System

    bad = [x for x in text.split(",") if x not in System.SAVES]
    if bad or not text:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'}: not an op class; choose from "
                                         f"{', '.join(System.SAVES)}, comma-separated")
    return text


def _print(diags: list[Diagnostic]) -> None:
    if diags:
        print(render_all(diags), file=sys.stderr)


def _existing(path: Path, what: str) -> Path:
    from parc.grammar.parser import path_problem

    problem = path_problem(path)
    if problem is not None:
        raise ParcError(f"{what} {path}: {problem}")
    return path


def _batch_line(plan) -> str:
    m = plan.mesh
    cp = f" × cp {m.cp}" if m.cp > 1 else ""
    return (f"mesh dp {m.dp} × pp {m.pp} × tp {m.tp}{cp} = {m.world_size} ranks; global batch {plan.global_batch} = "
            f"micro {plan.micro_batch} × accumulation {plan.accumulation} × dp {m.dp}")


def cmd_check(args) -> int:
    """Every error and warning, all at once: the plan against itself, the launch and the model
    (parc/grammar/validate.py), what the runtime does not implement (parc/analysis/support.py), the
    topology, schedule and memory (parc/analysis/review.py), and with --model the errors of compile's passes."""
    from parc.errors import PlanError
    from parc.grammar.parser import load_plan
    from parc.grammar.validate import validate

    plan = load_plan(args.plan)  # reads special files and bad encodings safely (grammar/parser.py)
    traced = None
    if args.model:
        from parc.trace import load_user_module, trace

        user = load_user_module(_existing(args.model, "model"))
        traced = trace(user, plan.micro_batch, max_carried=args.max_carried_constant)
        if args.grad_probe:
            from parc.grad_probe import probe
            probe(user, traced, plan.micro_batch)
    try:
        diags = validate(plan, world_size=args.world_size, module_paths=traced and traced.module_paths,
                         num_layers=traced and traced.num_layers)
    except PlanError as e:
        diags = e.diagnostics
    diags += _review(plan, args, traced, failed=any(d.severity == "error" for d in diags))
    if any(d.severity == "error" for d in diags):
        raise PlanError(diagnostics=diags)
    _print(diags)
    print(f"{args.plan}: ok — {_batch_line(plan)}")
    return 0


def _review(plan, args, traced, failed: bool) -> list[Diagnostic]:
    """What `parc compile` would refuse (parc/analysis/support.py, and with the model its passes), then
    topology, schedule and (with the model) memory checks (parc/analysis/review.py). When the plan already `failed`
    validation, a check that cannot run on it (an exception that is no ParcError) is skipped, and so are
    its errors that point at no line (echoes of the errors found, such as the pipeline split's layer count)."""
    from parc import compiler
    from parc.analysis import support
    from parc.analysis.review import review

    out: list[Diagnostic] = []

    def attempt(fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except ParcError as e:
            out.extend(d for d in e.diagnostics if d.span is not None or not failed)
        except Exception:  # noqa: BLE001 — only on a plan with errors already (see the docstring)
            if not failed and not out:
                raise
        return None

    attempt(support.check, plan)
    stats = None
    if traced is not None:
        from parc.analysis import cost
        from parc.passes.pipeline_split import assign_stages

        virtual = plan.pipeline.virtual if plan.pipeline is not None and plan.mesh.pp > 1 else 1
        split = attempt(assign_stages, traced, plan, plan.mesh.pp * virtual)
        if split is not None:
            out.extend(split[1])  # the split's warnings, as compile prints them
            out.extend(attempt(compiler.pass_errors, traced, plan) or [])
            stats = attempt(cost.graph_stats, traced, plan)
    out.extend(attempt(review, plan, world_size=args.world_size, stats=stats, preset=args.preset) or [])
    return out


def cmd_compile(args) -> int:
    from parc.grammar.parser import load_plan

    from parc import artifact

    # the plan, the model's path and the output first: torch takes seconds to load, a typo should not
    plan = load_plan(args.plan)
    _existing(args.model, "model")
    artifact.check_output(args.output, force=args.force)
    from parc.compiler import compile_model
    result = compile_model(_existing(args.model, "model"), plan, args.output, debug=args.debug,
                           exact_trace=args.exact_trace, force=args.force, grad_probe=args.grad_probe,
                           max_carried_constant=args.max_carried_constant)
    _print(result.warnings)
    if plan.mesh.pp > 1:
        from parc.passes.pipeline_split import stage_lines

        print("\n".join(stage_lines(result.plan_json["stages"], plan.mesh.pp)))
    n = len(result.plan_json["programs"])
    print(f"wrote {args.output}/ in {time.perf_counter() - _STARTED:.1f}s ({result.seconds:.1f}s compiling): "
          f"{n} program{'s' * (n != 1)} for "
          f"{plan.world_size} ranks; {_batch_line(plan)}")
    print("\n".join(_launch_lines(plan, args.output)))
    return 0


def _launch_lines(plan, output) -> list[str]:
    """The command that runs what was compiled, as the launch check (runtime/placement.py) will accept it.

    A plan whose topology line states fewer GPUs per node than it has ranks is refused on one node of
    `--nproc-per-node <world>`: print the multi-node command, and the one-machine form that stands in
    for it (`--oversubscribe` lifts the per-node bound: ranks share the machine's GPUs, or its CPU).
    """
    world, run = plan.world_size, f"-m parc.run {output}"
    gpn = plan.topology.gpus_per_node if "topology.gpus_per_node" in plan.spans else None
    if gpn is None or world <= gpn:
        return [f"run it: torchrun --nproc-per-node {world} {run}"]
    nodes = -(-world // gpn)
    return [f"run it on {nodes} nodes of {gpn} (the plan's topology), on each: torchrun --nnodes {nodes} "
            f"--nproc-per-node {gpn} --rdzv-backend c10d --rdzv-endpoint <first node>:29500 {run}",
            f"or on this machine alone, its {world} ranks sharing it: torchrun --nproc-per-node {world} {run} "
            f"--oversubscribe"]


def cmd_import_deepspeed(args) -> int:
    from parc import deepspeed

    paths = None
    if args.model:
        from parc.trace import load_user_module, trace

        paths = trace(load_user_module(_existing(args.model, "model")), 1).module_paths
    over = deepspeed.Overrides(micro=args.micro, accumulation=args.accumulation, global_batch=args.global_batch,
                               lr=args.lr, warmup=args.warmup, steps=args.steps, clip=args.clip,
                               precision=args.precision)
    imp = deepspeed.translate(deepspeed.load_config(_existing(args.config, "DeepSpeed config")),
                              world_size=args.world_size, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              model_paths=paths, source=args.config.name, overrides=over)
    out = args.output or Path(args.config.stem + ".par")  # the working directory, not the config's folder
    if args.output is None and out.exists():
        raise ParcError(f"{out} exists: parc import-deepspeed does not overwrite a file it was not told to",
                        hint=f"name the output with -o (an existing file given there is replaced), or move {out}")
    for note in imp.notes:
        print(f"note: {note}")
    for key, why in imp.untranslated:
        print(f"not translated: {key} ({why})")
    try:
        deepspeed.write_plan(imp, out)
    except ParcError:
        print(f"wrote {out} (it has errors: fix them there)", file=sys.stderr)
        raise
    print(f"wrote {out}: {len(imp.translated)} keys translated, {len(imp.untranslated)} not")
    return 0


def cmd_report(args) -> int:
    from parc.analysis import report

    rep = report.build_from_args(args)
    if args.json:
        print(report.to_json(rep))
    else:
        report.render(rep)
    return 0


def cmd_calibrate(args) -> int:
    from parc.analysis.calibrate import calibrate

    calibrate(args.device, args.output, peak_tflops=args.peak_tflops, ranks=args.ranks)
    print(f"wrote {args.output}: use it as --preset {args.output}")
    return 0


def cmd_plan(args) -> int:
    """Search the plan space with the cost model (parc/analysis/planner.py); print the best, write the winner."""
    from parc.analysis import planner

    if args.output is not None and args.output.exists() and not args.force:  # refuse before the search
        raise ParcError(f"{args.output} exists: parc plan does not overwrite a file unless told to",
                        hint=f"pass --force to replace it, or choose another -o than {args.output}")
    result = planner.search(_existing(args.model, "model"), gpus=args.gpus, nodes=args.nodes, preset=args.preset,
                            global_batch=args.global_batch, top=args.top, precision=args.precision)
    if args.json:  # the ranking first: a refused write (below) loses no search
        print(planner.to_json(result, args.top))
    else:
        print("\n".join(planner.summary(result, args.top)))
    if args.output is not None and result.ranked:
        planner.write(result, args.output, "parc " + " ".join(sys.argv[1:]), force=args.force)
        print(f"wrote {args.output}: check it with `parc check {args.output} --model {args.model}`",
              file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_viz(args) -> int:
    from parc import viz

    for path in viz.draw_all(args.compiled, args.output, trace=args.trace, fmt=args.format):
        print(f"wrote {path}")
    return 0


def cmd_export(args) -> int:
    from parc.export import export

    if args.hf is not None:
        from parc.export_hf import export_hf, parse_size

        if args.output is None:
            raise ParcError("--hf writes a directory: name it with -o (e.g. -o my-model/)")
        out = export_hf(args.checkpoint, args.output, args.hf, parse_size(args.max_shard_size))
        print(f"wrote {out}: {_exported(args.checkpoint, sorted(Path(out).glob('*.safetensors')))}")
        return 0
    out = export(args.checkpoint, args.output or Path("model.safetensors"))
    print(f"wrote {out}: {_exported(args.checkpoint, [Path(out)])}")
    return 0


def _exported(checkpoint, files: list[Path]) -> str:
    """What an export holds, for its one line: tensors, parameters, and the checkpoint and step they came from."""
    import json
    import math

    from safetensors import safe_open

    from parc.runtime.checkpoint import resolve

    tensors = numel = 0
    for f in files:
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                tensors, numel = tensors + 1, numel + math.prod(shape)
    where = resolve(checkpoint, "checkpoint")
    step = json.loads((where / "parc.json").read_text()).get("step", "?")
    return f"{tensors} tensors, {numel:,} parameters, from {where} (after {step} steps)"


def _model_options(p: argparse.ArgumentParser) -> None:
    """What `check --model` and `compile` trace with, so that check accepts exactly what compile does."""
    p.add_argument("--max-carried-constant", type=int, default=4096, metavar="ELEMENTS",
                   help="the largest tensor made in forward from Python data (torch.tensor(list), a list index) "
                        "that plan.json carries (default 4096); a larger one is refused where it is made")
    p.add_argument("--no-grad-probe", dest="grad_probe", action="store_false",
                   help="skip the gradient probe (default: on): one eager forward+backward on CPU of a model of at "
                        "most 50M parameters without random ops, against the traced program's, refused if a "
                        "parameter's gradient differs by more than 1e-3 of its scale (parc/grad_probe.py)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parc", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"parc {__import__('parc').__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="parse and validate a plan; with --model, against the traced model too",
                       description="Report every error and warning in a plan. Exit 2 if there is an error.")
    c.add_argument("plan", type=Path, help="the .par file")
    c.add_argument("--model", type=Path, help="model file to check the plan against (module paths, layers)")
    c.add_argument("--world-size", type=int, help="the launch's world size, checked against dp × pp × tp")
    c.add_argument("--preset", help="hardware for the memory check (default: the plan's topology preset)")
    _model_options(c)
    c.set_defaults(fn=cmd_check)

    k = sub.add_parser("compile", help="compile a model under a plan into a directory of per-rank programs",
                       description="Trace MODEL on the meta device (no memory for weights), apply the plan's "
                                   "passes, and write plan.json, one program per (stage, tp rank), a copy of "
                                   "the model and a MANIFEST to OUTPUT.")
    k.add_argument("model", type=Path, help="model file defining build_model(), get_batch(), loss_fn()")
    k.add_argument("--plan", type=Path, required=True, help="the .par file")
    k.add_argument("-o", "--output", type=Path, default=Path("compiled"),
                   help="output directory (default compiled); it may be missing, empty or an earlier parc "
                        "artifact (replaced atomically); anything else is refused unless --force")
    k.add_argument("--force", action="store_true",
                   help="replace OUTPUT even if it is a file or a directory that is not a parc artifact "
                        "(its contents are deleted)")
    k.add_argument("--debug", action="store_true", help="log each pass's time and a before/after graph diff")
    k.add_argument("--exact-trace", action="store_true",
                   help="export every repeated block instead of replicating block 1 (slower; for models whose "
                        "code around the blocks branches on the block index)")
    _model_options(k)
    k.set_defaults(fn=cmd_compile)

    e = sub.add_parser("export", help="write one consolidated safetensors file from a sharded checkpoint",
                       description="Assemble every parameter of a checkpoint written by `parc.run --save-every` "
                                   "(any dp, any ZeRO stage) into one safetensors file keyed by model FQN.")
    e.add_argument("checkpoint", type=Path, help="a step_<N> checkpoint, or a --checkpoint-dir (its latest)")
    e.add_argument("-o", "--output", type=Path, default=None,
                   help="output file (default model.safetensors); with --hf, a new directory")
    e.add_argument("--hf", type=Path, default=None, metavar="MODEL",
                   help="write a Hugging Face directory (config.json + safetensors, sharded with an index past "
                        "--max-shard-size) that transformers' from_pretrained loads; MODEL is the model file or "
                        "the compiled directory, whose build_model() must return a PreTrainedModel")
    e.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="with --hf: the largest safetensors file (default 5GB)")
    e.set_defaults(fn=cmd_export)

    d = sub.add_parser("import-deepspeed", help="translate a DeepSpeed JSON config into a .par plan",
                       description="Write a .par from a DeepSpeed config (batch sizes, ZeRO stage, tp/pp sizes, "
                                   "optimizer, clipping, bf16/fp16, lr scheduler), list the keys it could not "
                                   "translate, and check the written plan (exit 2 with file:line:col diagnostics "
                                   "if it is wrong). \"auto\" values (HF Trainer configs) take their numbers from "
                                   "the flags below, as the Trainer fills them from its own arguments; one left "
                                   "without a number stays `auto` in the plan under a `# auto:` comment, and the "
                                   "check points at it. docs/deepspeed.md lists every key.")
    d.add_argument("config", type=Path, help="ds_config.json")
    d.add_argument("--model", type=Path, help="model file: propose tensor_parallel rules from its module names")
    d.add_argument("--world-size", type=int, help="GPUs in the launch: dp = world / (tp × pp)")
    d.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node: a topology line and the world size)")
    d.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    d.add_argument("-o", "--output", type=Path, help="the .par to write (default: ./<config name>.par, never overwritten)")
    auto = d.add_argument_group("numbers for \"auto\" values (the HF Trainer argument each stands for)")
    auto.add_argument("--micro", type=int, help="train_micro_batch_size_per_gpu (per_device_train_batch_size)")
    auto.add_argument("--accumulation", type=int, help="gradient_accumulation_steps")
    auto.add_argument("--global-batch", type=int, help="train_batch_size (world × micro × accumulation; "
                                                       "derived when the other two and the world size are known)")
    auto.add_argument("--lr", type=float, help="optimizer lr and the scheduler's warmup_max_lr (learning_rate)")
    auto.add_argument("--warmup", type=int, help="the scheduler's warmup_num_steps (warmup_steps)")
    auto.add_argument("--steps", type=int, help="the scheduler's total_num_steps (max_steps)")
    auto.add_argument("--clip", type=float, help="gradient_clipping (max_grad_norm)")
    auto.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="bf16.enabled / fp16.enabled (--bf16, --fp16)")
    d.set_defaults(fn=cmd_import_deepspeed)

    r = sub.add_parser("report", help="memory, communication and utilization estimates of a plan",
                       description="The three-step review of a plan: memory per rank with a verdict, "
                                   "communication per step by collective and group (intra/inter node), then "
                                   "FLOPs, pipeline bubble, step time and MFU. From a compiled/ directory, or "
                                   "analytically from --model and --plan (tracing only, no passes).")
    r.add_argument("compiled", type=Path, nargs="?", help="a compiled/ directory")
    r.add_argument("--model", type=Path, help="model file (with --plan, instead of compiled/)")
    r.add_argument("--plan", type=Path, help="the .par file (with --model)")
    r.add_argument("--preset", help="hardware: a100, a100_40gb, h100, h100_hbm2e, h200 or a `parc calibrate` file "
                                    "(default: the plan's topology preset, else h100)")
    r.add_argument("--allreduce", choices=("ring", "tree"), help="all-reduce algorithm (default ring)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    from parc.analysis.cost import System   # light: no torch

    other = r.add_argument_group(
        "another system's run", "price a run of another framework rather than parc's runtime (docs/report-and-viz.md; "
        "bench/published.py prices the published runs with these)")
    other.add_argument("--attention", choices=System.ATTENTION, default="flash",
                       help="attention kernel: flash (parc: a fused kernel), materialized (the T x T scores written "
                            "out, pre-2022 Megatron and DeepSpeed), materialized-dropout (with a dropout on them), "
                            "flash-triton (FlashAttention written in Triton: llm-foundry's attn_impl triton), "
                            "flash-unpad (the flash kernel between flash_attn's unpad and pad gathers: llm-foundry's "
                            "attn_impl flash), cudnn (cuDNN's fused attention: Transformer Engine's, NVIDIA's NeMo "
                            "recipes; measured on the H100 presets, flash elsewhere)")
    other.add_argument("--pp-sends", choices=System.PP_SENDS, default="whole",
                       help="pipeline sends under tp: whole (parc) or scatter-gather (Megatron: 1/tp each, "
                            "all-gathered by the receiver over NVLink)")
    other.add_argument("--pp-engine", choices=System.PP_ENGINES, default="parc",
                       help="the pipeline's executor: parc (its 1F1B, adjacent sends and receives posted together, "
                            "transfers under the next compute) or deepspeed (DeepSpeed's pipeline engine: its "
                            "TrainSchedule's order, each send and receive blocking both ranks, each micro-batch's "
                            "gradient accumulated after its backward, bf16 gradients all-reduced in fp32; 1F1B "
                            "plans, ZeRO-1 at most)")
    other.add_argument("--no-dp-overlap", action="store_true",
                       help="dp's gradient reduction waits for the whole backward (parc overlaps it)")
    other.add_argument("--zero-prefetch", choices=System.ZERO_PREFETCH, default="pre",
                       help="when ZeRO-3 gathers the next layer in the backward: pre (parc; PyTorch FSDP's "
                            "BACKWARD_PRE: under the current layer's gradients) or post (FSDP's BACKWARD_POST, "
                            "Composer's default: after them, so each backward gather is exposed)")
    other.add_argument("--cp-attention", choices=System.CP_ATTENTION, default="parc",
                       help="context parallelism's attention: parc (the plan's ring or all-to-all, as parc runs it), "
                            "allgather (K and V all-gathered over cp at their kv heads, before GQA repeats them, "
                            "and the local queries' attention computed; gradients reduce-scattered: Llama 3's) "
                            "or te-ring (Transformer Engine's ring, Megatron-core's and NeMo's: K/V blocks at their "
                            "kv heads in the activations' dtype, each hop under the attention block beside it)")
    other.add_argument("--dp-wire", choices=tuple(System.WIRE),
                       help="dtype of gradients on the dp wire (default: the plan's precision layout)")
    other.add_argument("--nics", type=int, help="network links per node, each at the topology's inter= "
                                                 "(default: the preset's, one per GPU)")
    other.add_argument("--recompute-saves", metavar="OPS", type=_recompute_saves,
                       help="op-level selective checkpointing inside the plan's recomputed regions: the ops whose "
                            "outputs are saved, comma-separated from matmul, matmul-odd (the 1st, 3rd, ... of a "
                            "region), attention; every other op runs again in the backward (torchtitan's op "
                            "policy: matmul-odd,attention). Default: the whole region is recomputed (parc)")
    other.add_argument("--tp-overlap", choices=System.TP_OVERLAP, default="none",
                       help="where tp's collectives run: none (parc: between the matmuls), backward (Megatron-LM's "
                            "asynchronous tp communication: the backward's under the weight-gradient matmuls) or "
                            "gemm (Transformer Engine's userbuffers, NeMo's ub_tp_comm_overlap: each under its "
                            "linear's matmul, forward and backward)")
    other.add_argument("--loss", choices=System.LOSS, default="eager",
                       help="the cross-entropy's kernel: eager (parc: PyTorch's, an fp32 log-softmax kept for the "
                            "backward) or fused (one kernel keeping the logits and a log-sum-exp a row, its gradient "
                            "in the logits' dtype: flash-attn's xentropy, llm-foundry's fused_crossentropy)")
    r.set_defaults(fn=cmd_report)

    cal = sub.add_parser("calibrate", help="measure this device for the cost model; write a preset file",
                         description="Short probes (a matmul sweep, attention, memory bandwidth, op overhead and "
                                     "memory-bound ops by kind; on CPU also gloo collectives under load among --ranks "
                                     "processes, and a small probe model's training step timed in place against "
                                     "those tables) written as a preset file that --preset FILE accepts wherever a "
                                     "preset name is (docs/cost-model.md). A few minutes on CPU; run it on a quiet "
                                     "machine.")
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the device to measure (default cpu)")
    cal.add_argument("-o", "--output", type=Path, default=Path("preset.json"), help="the file to write")
    cal.add_argument("--peak-tflops", type=float, help="the peak to state efficiencies against (default: the best "
                                                     "matmul measured)")
    cal.add_argument("--ranks", type=int, default=2, help="CPU: processes in the gloo probe, as many as the plans "
                                                           "will run (default 2)")
    cal.set_defaults(fn=cmd_calibrate)

    q = sub.add_parser("plan", help="search dp × tp × pp × schedule × ZeRO × micro-batch × recompute × SP for a "
                                    "model on N GPUs; write the fastest plan that fits",
                       description="Trace MODEL once, enumerate the plans parc can run on the GPUs, drop those "
                                   "that do not fit or that parc refuses, rank the rest by the cost model's step "
                                   "time (docs/planner.md), print the best with why each loses to the winner, "
                                   "and write the winner as a .par.")
    q.add_argument("model", type=Path, help="model file defining build_model(), get_batch(), loss_fn()")
    q.add_argument("--gpus", type=int, required=True, help="GPUs in the job (the world size)")
    q.add_argument("--nodes", type=int, help="nodes (default: GPUs / the preset's GPUs per node)")
    q.add_argument("--preset", help="hardware: a100, a100_40gb, h100, h100_hbm2e, h200 or a `parc calibrate` file "
                                    "(default: h100, with a warning)")
    q.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    q.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="compute precision (default bf16)")
    q.add_argument("--top", type=int, default=5, help="plans to print (default 5)")
    q.add_argument("-o", "--output", type=Path, help="write the winner here (an existing file only with --force)")
    q.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    q.add_argument("--json", action="store_true", help="print the ranking as JSON")
    q.set_defaults(fn=cmd_plan)

    # listed for `parc --help`; `parc run …` is dispatched before this parser (main), to parc/launcher.py
    sub.add_parser("run", help="torchrun a compiled plan on this machine, parc's lines alone (parc run --help)",
                   add_help=False)
    v = sub.add_parser("viz", help="draw the device mesh, the pipeline schedule and the stages (SVG and PNG)",
                       description="Graphviz drawings of a compiled/ directory: mesh.*, schedule.*, stages.*.")
    v.add_argument("compiled", type=Path, help="a compiled/ directory")
    v.add_argument("-o", "--output", type=Path, default=Path("viz"), help="output directory (default viz)")
    v.add_argument("--trace", type=Path, help="a measured Chrome-trace JSON to draw beside the simulated schedule")
    v.add_argument("--format", choices=("svg", "png", "both"), default="both", help="what to write (default both)")
    v.set_defaults(fn=cmd_viz)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:  # parc.run's options pass through untouched: its own parser (parc/launcher.py)
        from parc import launcher

        try:
            return launcher.main(argv[1:])
        except ParcError as e:
            _print(e.diagnostics)
            return 2
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if getattr(args, "debug", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.fn(args)
    except ParcError as e:
        _print(e.diagnostics)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
