"""What context parallelism (mesh cp > 1) composes with so far, checked on the plan alone.

Start here when `parc compile` refuses a plan with `mesh … cp=N`. Proven so far (tests/test_context_parallel.py,
tests/test_cp_compositions.py, tests/test_cp_tp.py, tests/test_cp_dropout.py): cp × dp, × pp (1F1B, GPipe,
interleaved, zero-bubble), ring and all-to-all attention, fp32, bf16 and fp16, ZeRO 1–3 sharded over dp × cp
(HSDP: over K dp × cp, replicated over dp / K), ZeRO-Offload,
recompute, checkpoints, keyed dropout (attention dropout too, inside ring blocks and all-to-all heads), and
cp × tp (with sequence parallelism), alone and with dp, pp, ZeRO 1–3, bf16, fp16 and recompute; `compile`
(aot_eager and inductor);
every other feature a plan may state beside cp is refused here, each with its own located diagnostic,
all at once, rather than run without a test proving it equals the serial model. What needs the model
(the sequence length 2·cp divides, the attention the pass can rewrite, position-dependent ops) is
checked by passes/context_parallel.py.

Assumes: the plan passed `parc.grammar.validate.validate`.
Guarantees: `diagnostics(plan)` is empty only for plans the cp runtime implements.
"""

from __future__ import annotations

from parc.errors import Diagnostic
from parc.grammar.plan import CP_METHODS, Plan

BUILT = ("ring", "alltoall")  # methods the pass implements


def diagnostics(plan: Plan) -> list[Diagnostic]:
    """One error per feature the plan states that cp does not compose with yet (empty without cp)."""
    out: list[Diagnostic] = []
    m = plan.mesh

    def refuse(message: str, key: str, node, hint: str) -> None:
        span = plan.spans.get(key) or getattr(node, "span", None)
        out.append(Diagnostic(message, span, hint, "error", plan.source or None))

    method = plan.context_parallel.method
    if method not in CP_METHODS:
        refuse(f"unknown context_parallel method `{method}`", "context_parallel", plan.context_parallel,
               "valid: " + ", ".join(CP_METHODS))
    elif method not in BUILT:
        refuse(f"context_parallel {method} is not built yet: only ring attention is (issue 28)",
               "context_parallel", plan.context_parallel, "write `context_parallel ring`")
    if m.cp == 1:
        if plan.context_parallel.span is not None:  # a stated method that would change nothing
            refuse("context_parallel needs mesh cp > 1: with cp 1 the sequence is not split", "context_parallel",
                   plan.context_parallel, "add cp=N to the mesh, or drop the line")
        return out
    # expert parallelism: an MoE layer's capacity rule ranks all of a forward's tokens against each other (which
    # are dropped depends on every token's route, docs/moe.md "Why it is exact"), and a cp rank holds T / cp of them
    moe = ("an MoE layer's capacity rule ranks every token of the micro-batch against the others (which tokens an "
           "expert drops depends on all their routes, docs/moe.md), but a cp rank holds T / cp of them; cp × ep is "
           "not built (docs/context-parallel.md)")
    if m.ep > 1:
        refuse(f"mesh cp {m.cp} with ep {m.ep}: {moe}", "mesh.ep", m, "use ep=1 with cp, or cp=1")
    # ZeRO 1–3 shard over the dp × cp ranks (passes/zero.py); HSDP (`shard=K`) over K dp × cp (parc/mesh.py
    # zero_groups), replicated over dp / K; ZeRO-Offload's host step updates this rank's ranges of that cut,
    # whatever group reduced them
    if plan.expert_parallel.patterns:
        refuse(f"expert_parallel with mesh cp {m.cp}: {moe}", "expert_parallel", plan.expert_parallel,
               "drop the `expert_parallel` block with cp")
    return out
