"""Which combinations of features the runtime can train, checked before compiling.

Start here when `parc compile` refuses a plan that `parc check` accepts. The
plan language can state more than the runtime implements; a plan asking for
something parc would silently ignore, or run without a test proving it matches
the serial model, is refused here with the reason. What is proven (tests/):

  dp × tp × pp with sequence parallelism, every schedule        test_3d, test_pipeline, test_tensor_parallel
  ZeRO-1/2/3 alone (dp)                                          test_zero
  ZeRO-1/2 with pp (one stage per rank) and tp                   test_3d, test_zero_combos
  ZeRO-3 with tp                                                 test_zero_combos
  HSDP (zero shard=K < dp), stages 1–3, fp32 and bf16              test_zero_hsdp
  recompute with dp, tp + SP, pp (1F1B, ZB-H1), ZeRO-2, and 3D   test_recompute, test_report_memory
  expert parallelism (mesh ep) with dp, fp32                     test_moe (everything else refused below)
  expert parallelism with tp (expert FFNs column/row), fp32, no SP test_moe_tp
  expert parallelism with pp (1F1B, GPipe) and dp, fp32          test_moe_pp
  ep with ZeRO-1/2 (experts cut over edp), clip=, bf16 and fp16  test_moe_zero
  ZeRO-Offload (zero offload=cpu), stages 1–3, fp32/bf16, with tp and pp (as ZeRO is) test_zero_offload
  context parallelism (mesh cp, ring, alltoall) with dp, pp, ZeRO 1–3, HSDP, offload, recompute, bf16, checkpoints,
  keyed and attention dropout          test_context_parallel, test_cp_compositions, test_cp_dropout (the rest: cp_support)

The rest of what `parc compile` refuses needs the model: `parc.compiler.pass_errors`
runs the compiler's passes as compile does, without writing anything, so that
`parc check --model` reports their errors with the plan's own.

Assumes: the plan passed `parc.grammar.validate.validate`.
Guarantees: `check` returns only if the runtime implements every feature the plan
asks for.
"""

from __future__ import annotations

from parc.analysis import cp_support
from parc.errors import Diagnostic, PlanError
from parc.grammar.plan import Plan


def check(plan: Plan) -> None:
    """Raise PlanError naming each requested feature the runtime does not (provably) implement."""
    out: list[Diagnostic] = []

    def refuse(message: str, key: str, node, hint: str) -> None:
        span = plan.spans.get(key) or getattr(node, "span", None)
        out.append(Diagnostic(message, span, hint, "error", plan.source or None))

    z, m, pipe = plan.zero.stage, plan.mesh, plan.pipeline
    if plan.recompute.patterns and z == 3:
        refuse("recompute with zero stage=3 is not supported: a recomputed region would gather its layer's "
               "weights a third time in backward, and no test proves the gather-on-demand runtime inside a "
               "recomputed region", "recompute.patterns[0]", plan.recompute,
               "use zero stage=1 or 2 with recompute, or drop the `recompute` line")
    virtual = pipe.virtual if pipe is not None else 1
    if z == 3 and m.pp > 1:
        refuse(f"zero stage=3 with pp {m.pp} > 1 is not supported: ZeRO-3 re-gathers each layer's weights over dp "
               f"in every micro-batch's forward and again in its backward, so a pipeline of {plan.accumulation} "
               f"micro-batches per step would gather the weights 2 × {plan.accumulation} times a step, and its "
               f"gather-on-demand runtime is not proven under the pipeline executor by any test",
               "zero.stage", plan.zero, "use zero stage=1 or 2 with pp, or pp=1 with zero stage=3")
    if z >= 1 and m.pp > 1 and virtual > 1:
        refuse(f"zero stage={z} with virtual stages ({virtual} per pp rank) is not supported: ZeRO partitions one "
               f"program per rank, and with virtual > 1 a rank runs {virtual}",
               "pipeline.virtual", pipe, "use schedule=1f1b with ZeRO, or drop zero")
    if plan.zero.shard is not None and plan.zero.shard < m.dp and m.ep > 1:
        refuse(f"zero shard={plan.zero.shard} with expert parallelism (mesh ep {m.ep}) is not supported: the experts' "
               "state is cut over the expert-data-parallel group, and no test proves a shard group inside it",
               "zero.shard", plan.zero, "drop shard= with ep (plain ZeRO-1/2 is proven with ep)")
    _offload(plan, refuse)
    _expert_parallel(plan, refuse)
    out += cp_support.diagnostics(plan)  # mesh cp: what context parallelism composes with so far
    if out:
        raise PlanError(diagnostics=out)


def _offload(plan: Plan, refuse) -> None:
    """`zero offload=cpu` is proven with ZeRO-1/2/3 over dp, fp32 and bf16, with clip= and kill-and-resume, and
    with tp and pp wherever ZeRO itself is (tests/test_zero_offload.py: bitwise against the same plan without
    offload); with expert parallelism, HSDP and compiled programs no test proves the host step: refused."""
    if plan.zero.offload is None or plan.zero.stage == 0:
        return
    m = plan.mesh
    others = [(f"mesh ep {m.ep}", m.ep > 1),
              (f"zero shard={plan.zero.shard} (HSDP)", plan.zero.shard is not None and plan.zero.shard < m.dp),
              (f"compile {plan.compile}", plan.compile != "none")]
    for what, present in others:
        if present:
            refuse(f"zero offload={plan.zero.offload} with {what} is not supported: the host optimizer step is "
                   "proven with ZeRO-1/2/3 over dp, tp and pp (tests/test_zero_offload.py), not with this",
                   "zero.offload", plan.zero, f"drop offload=, or drop {what}")


def _expert_parallel(plan: Plan, refuse) -> None:
    """mesh ep > 1 is proven with dp (tests/test_moe.py), tp (tests/test_moe_tp.py), pp (1F1B, GPipe:
    tests/test_moe_pp.py), and ZeRO-1/2, bf16, fp16 and clip= (tests/test_moe_zero.py, with tp 1 and pp 1):
    each other feature is refused, with why."""
    m, pipe = plan.mesh, plan.pipeline
    if m.ep == 1:
        return
    sharded = m.tp > 1 or m.pp > 1  # ZeRO, bf16, fp16 and clip= are proven with ep at tp 1 and pp 1 only
    unproven = f"with tp {m.tp} and pp {m.pp} no test proves it with ep (tests/test_moe_zero.py runs tp 1, pp 1)"
    why = {
        "tensor_parallel": (m.tp > 1 and plan.tensor_parallel.sequence_parallel, "sequence_parallel: the "
                            "dispatch and combine would read sequence-sharded tokens, which no test proves",
                            "drop sequence_parallel with ep (tp without it is proven: tests/test_moe_tp.py)"),
        "zero.stage": (plan.zero.stage == 3 or (plan.zero.stage > 0 and sharded),
                       f"zero stage={plan.zero.stage}: " + ("its per-layer gather is cut over all of dp, but an "
                       "expert's weights live on its expert-data-parallel group (dp / ep ranks) only, and no test "
                       "proves a gather over that group" if plan.zero.stage == 3 else unproven),
                       "use zero stage=1 or 2 with ep, at tp 1 and pp 1"),
        "precision": (plan.precision != "fp32" and sharded, f"precision {plan.precision}: {unproven}",
                      "use fp32, or tp 1 and pp 1, with ep"),
        "optimizer.clip": (plan.optimizer.grad_clip is not None and sharded, f"clip: {unproven}",
                           "drop clip=, or use tp 1 and pp 1, with ep"),
        "recompute.patterns[0]": (bool(plan.recompute.patterns), "recompute: a recomputed region would issue the "
                                  "experts' all-to-all again in backward, which no test proves", "drop `recompute`"),
        "pipeline.schedule": (pipe is not None and m.pp > 1 and (pipe.schedule not in ("1f1b", "gpipe") or
                                                                pipe.virtual > 1),
                              f"pipeline schedule={pipe and pipe.schedule} virtual={pipe and pipe.virtual}: only "
                              "1f1b and gpipe with one stage per pp rank are proven with ep (tests/test_moe_pp.py)",
                              "use pipeline schedule=1f1b (or gpipe) with ep"),
    }
    nodes = {"tensor_parallel": plan.tensor_parallel, "zero.stage": plan.zero, "precision": None,
             "optimizer.clip": plan.optimizer, "recompute.patterns[0]": plan.recompute, "pipeline.schedule": pipe}
    for key, (bad, reason, hint) in why.items():
        if bad:
            refuse(f"expert parallelism (mesh ep {m.ep}) with {reason}", key, nodes[key], hint)
