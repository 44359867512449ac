"""Which combinations of features the runtime can train, checked before compiling.

Start here when `parc compile` refuses a plan that `parc check` accepts. The
plan language can state more than the runtime implements; a plan asking for
something parc would silently ignore, or run without a test proving it matches
the serial model, is refused here with the reason. What is proven (tests/):

  dp × tp × pp with sequence parallelism, every schedule        test_3d, test_pipeline, test_tensor_parallel
  ZeRO-1/2/3 alone (dp)                                          test_zero
  ZeRO-1/2 with pp (one stage per rank) and tp                   test_3d, test_zero_combos
  ZeRO-3 with tp                                                 test_zero_combos
  recompute with dp, tp + SP, pp (1F1B, ZB-H1), ZeRO-2, and 3D   test_recompute, test_report_memory

`compile_errors(traced, plan)` is the rest of what `parc compile` refuses, the
part that needs the model: it runs the compiler's passes as compile does (without
writing anything) and returns their diagnostics, so `parc check --model` reports
them together with the plan's own errors.

Assumes: the plan passed `parc.grammar.validate.validate`.
Guarantees: `check` returns only if the runtime implements every feature the plan
asks for; `compile_errors` is empty exactly when compile's passes accept the plan.
"""

from __future__ import annotations

from parc.errors import Diagnostic, ParcError, PlanError
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
    if out:
        raise PlanError(diagnostics=out)


def compile_errors(traced, plan: Plan) -> list[Diagnostic]:
    """The diagnostics `parc compile` would stop with after tracing: tensor parallelism (every width tp does
    not divide, shared weights, ops it cannot shard), the pipeline split, ZeRO, a parameter two stages of one
    pp rank share, a constant too large to carry. Runs each stage's program for tp rank 0 only: the tp ranks'
    programs differ only in shard indices and vocab offsets, which no check reads. Assumes
    `pipeline_split.assign_stages` already ran on `traced` (as `parc check` and compile both do)."""
    from parc import compiler  # the driver imports this module: import it when called

    _, virtual = compiler._pipeline(plan)
    n = plan.mesh.pp * virtual
    whole: dict = {}
    programs = {}
    try:
        for stage in range(n):
            gm, _ = compiler.compile_program(traced, plan, stage, 0, stages=n, whole=whole)
            held = {x.name for x in gm.graph.nodes if x.op == "placeholder"}
            programs[stage] = {"stage": stage, "state": [{"fqn": s.fqn, "kind": s.kind, "requires_grad": s.requires_grad}
                                                         for s in traced.state if s.name in held]}
        if n > 1:
            compiler._tied(programs, plan.mesh.pp)
        for spec in traced.state:
            if spec.fqn in traced.constants:
                compiler._state_entry(spec, None, traced.constants, set())
    except ParcError as e:
        return e.diagnostics
    return []
