"""Selective recompute under `compile`: a recomputed region keeps its collectives' outputs.

Start at `save_collectives`, the `context_fn` a generated program passes to
`torch.utils.checkpoint.checkpoint` for a recomputed region that holds a forward
collective, when the plan says `compile inductor` or `compile aot_eager`
(passes/recompute.py decides, parc/codegen.py writes it).

Why: every op that communicates is an ORDERED effect (runtime/parallel/ops.py `mark_ordered`).
Recomputing one in backward makes AOTAutograd's partitioner save the effect tokens
that thread it, and torch 2.13's inductor then fails to unlift them ("forward
num_erased_outs:3 != expected 1"), so `compile inductor` could not run tp > 1 with
`recompute`. With this policy no ordered op is recomputed: its output is saved
(CheckpointPolicy.MUST_SAVE), every other op of the region runs again in backward
(PREFER_RECOMPUTE, which the partitioner treats as must-recompute), as Megatron's
and torchtitan's selective recompute avoid communicating twice.

Guarantees: the values are the same (the saved output is the one the forward
computed, where full recompute computes it again from the same inputs);
backward issues no forward collective again, on every rank alike, so the order
of collectives every rank issues is still the program's. What it changes is
memory: a region keeps, besides its inputs, the outputs of the collectives that
its backward needs (parc/analysis/activations.py counts them; `parc report`
says so). `compile none` keeps full recompute (passes/recompute.py).
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from parc.runtime.parallel import ops


def communicates(op) -> bool:
    """Is `op` (an OpOverload, or any fx node target) one of parc's collectives (an ordered effect)?"""
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.name in ops.ORDERED_EFFECTS


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if communicates(op) else CheckpointPolicy.PREFER_RECOMPUTE


def save_collectives():
    """The checkpoint `context_fn`: save the outputs of communicating ops, recompute the rest."""
    return create_selective_checkpoint_contexts(_policy)
