"""What context parallelism (mesh cp > 1) composes with so far, checked on the plan alone.

Start here when `parc compile` refuses a plan with `mesh … cp=N`. Proven so far (tests/test_context_parallel.py,
tests/test_cp_compositions.py, tests/test_cp_tp.py, tests/test_cp_dropout.py): cp × dp, × pp (1F1B, GPipe,
interleaved, zero-bubble), ring and all-to-all attention, fp32, bf16 and fp16, ZeRO 1–3 sharded over dp × cp,
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
    later = "not yet proven with context parallelism (docs/context-parallel.md lists what is)"
    for axis, key in (("ep", "mesh.ep"),):
        if m.degree(axis) > 1:
            refuse(f"mesh cp {m.cp} with {axis} {m.degree(axis)}: {later}", key, m,
                   f"use {axis}=1 with cp, or cp=1")
    # ZeRO 1–3 shard over the dp × cp ranks (passes/zero.py); HSDP's shard groups and offload are not proven
    if plan.zero.stage > 0 and plan.zero.shard:
        refuse(f"zero stage={plan.zero.stage} shard={plan.zero.shard} with mesh cp {m.cp}: ZeRO shards over all "
               f"dp {m.dp} × cp {m.cp} = {m.dp * m.cp} ranks, but HSDP's shard and replicate groups are cut from "
               f"the dp groups alone (parc/mesh.py zero_groups, runtime/train.py); HSDP's shard groups are {later}",
               "zero.shard", plan.zero, "drop `shard=` with cp")
    if plan.zero.stage > 0 and plan.zero.offload:
        refuse(f"zero offload={plan.zero.offload} with mesh cp {m.cp}: {later}", "zero.offload", plan.zero,
               "drop `offload=` with cp")
    if plan.expert_parallel.patterns:
        refuse(f"expert_parallel with mesh cp {m.cp}: {later}", "expert_parallel", plan.expert_parallel,
               "drop the `expert_parallel` block with cp")
    return out
