"""`--verify`'s gradient check: the first step's gradients of the parallel run against the serial model's.

Start here: `FirstGrads`, then `check`. parc.run gives every rank's Trainer `FirstGrads.of_trainer`
as its `grad_observer`: the trainer calls it at every step when every gradient is complete (the dp
reduction, tp-partial and tied sums done: runtime/train.py `_complete_grads`) and before clipping and
the optimizer; it keeps the first step's (and under bf16/fp16 hands every step's to the optimizer
replay, runtime/verify_replay.py). It gathers each parameter's gradient whole, as
`Trainer.gathered_state` gathers the parameters (tp shards along their dim, ZeRO ranges over dp,
experts over ep, pp stages onto rank 0), and rank 0 keeps them. `check` then runs one step of the
serial reference (runtime/serial_reference.py) from the same weights on the same global batch, takes
its gradients at the same point (`of_model`), and ranks the tensors by runtime/verify.py's
`rank_tensors`.

Why the first step: its gradients come from identical weights, so they differ only by summation order,
and nothing stands between a wrong gradient and the check. Parameters after a few AdamW steps differ
by ±lr wherever a gradient is mostly rounding noise, which hides a small tensor's real error (a
per-head norm weight missing its tp sum) behind large absolute differences elsewhere.

Why the serial step runs per micro-batch: under bf16 each micro-batch's gradient is rounded to bf16
before it is summed in fp32, so one forward over the global batch and k micro-batch forwards round
differently: on examples/gpt.py a LayerNorm bias's gradient (a sum over tokens that mostly cancels)
differs by up to 1.5e-1 of its scale between the two (8 micro-batches of 2). Summed per micro-batch,
as the dp ranks sum, the serial gradients of a dp, accumulation or ZeRO plan agree to ~1e-8; what is
left under bf16 is tp's and sequence parallelism's own partial sums. The sum is the same gradient
either way; only its rounding is matched.
"""

from __future__ import annotations

import torch

from parc.runtime.serial_reference import train_serial
from parc.runtime.verify import Worst, rank_tensors

# fp32: one forward and backward from the same weights; the parallel run sums the same products in
# another order (the dp all-reduce, tp partial sums, a norm's statistics over shards), ~1e-7 relative per
# operation. Measured worst tensor: 5e-7 of its scale on examples/gpt.py (dp 2, tp 2 with SP, pp 2, ZeRO-3)
# and tests/models/qwen3_tiny.py (tp 2). A gradient missing a share (a tp sum, a micro-batch, a tied copy)
# is off by O(1) of its scale: 0.33 to 0.89 on qwen3_tiny's q_norm/k_norm weights without their tp sum.
# 1e-4 leaves 200× for deeper and wider models and is the losses' and parameters' fp32 tolerance too.
FP32_GRAD_TOLERANCE = 1e-4

# bf16 (bf16 copies of the fp32 masters, autocast; runtime/precision.py), serial run per micro-batch (see
# above): dp, accumulation and ZeRO measure ~1e-8; tp rounds each rank's partial matmul output to bf16
# (~4e-3 relative) before the all-reduce the serial matmul never splits: measured 1.1e-2 (tp 2) and 2.0e-2
# (tp 2 with SP) on examples/gpt.py, on LayerNorm weights and biases. A missing share is still O(1)
# (≥ 0.33 in the fp32 figures above): 1e-1 keeps 5× from the noise and 3× from the smallest real error.
BF16_GRAD_TOLERANCE = 1e-1
# fp16: the same per-micro-batch layout with finer rounding; bf16's bound applies (not measured separately)
GRAD_TOLERANCES = {"fp32": FP32_GRAD_TOLERANCE, "bf16": BF16_GRAD_TOLERANCE, "fp16": BF16_GRAD_TOLERANCE}


class FirstGrads:
    """One run's first-step gradients by model FQN, whole, on CPU (`grads`: None until observed; in the
    parallel run, on rank 0 only). `each_step(step, grads)`: gather every step's gradients, and hand them to it
    on rank 0 (the optimizer replay, runtime/verify_replay.py); every rank must be given one, or none (a
    gather is collective), rank 0's is the one called. Without it only the first step is gathered.
    `skips` (with `each_step`: fp16, or `--on-nonfinite skip`): a step whose gradients are not finite is skipped
    by the run, so `grads` are those of the first step that is not (`step`; fp16's first steps often overflow
    while the loss scale comes down)."""

    def __init__(self, each_step=None, skips: bool = False):
        self.grads: dict[str, torch.Tensor] | None = None
        self.step: int | None = None
        self.each_step = each_step
        self.skips = skips and each_step is not None
        self.observed = False

    def of_trainer(self, trainer) -> None:
        """The parallel run's `Trainer.grad_observer`: collective, every rank calls it, at every step."""
        if self.observed and self.each_step is None:
            return
        grads = trainer.gathered_state(grads=True)
        if trainer.ctx.rank == 0 and self.grads is None and (
                not self.skips or all(bool(torch.isfinite(v).all()) for v in grads.values())):
            self.grads = {k: v.detach().clone() for k, v in grads.items()}  # a copy: the next step zeroes them
            self.step = trainer.current_step
        if trainer.ctx.rank == 0 and self.each_step is not None:
            self.each_step(trainer.current_step, grads)
        self.observed = True

    def of_model(self, model: torch.nn.Module) -> None:
        """The serial run's `grad_observer`: every name of a tied parameter, one tensor for all its names
        (runtime/verify.py pairs names by tensor); zeros for a parameter without a gradient."""
        seen: dict[int, torch.Tensor] = {}
        self.grads = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen[id(p)] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.detach())
            self.grads[name] = seen[id(p)]


def check(parallel: FirstGrads, user, plan_json: dict, seed: int, batch_of=None, weights=None) -> Worst | None:
    """The first-step gradient worst relative to its own scale (runtime/verify.py `rank_tensors`), against
    one serial step per micro-batch (`train_serial`'s arguments); None, and no serial step, where the
    parallel run has none (a resumed run's first step is not step 0). Rank 0 only."""
    if parallel.grads is None:
        return None
    ranked = rank_tensors(parallel.grads, serial_grads(user, plan_json, seed, batch_of, weights))
    return ranked[0] if ranked else None


def serial_grads(user, plan_json: dict, seed: int, batch_of=None, weights=None,
                 precision: str | None = None, step: int = 0, skipped=()) -> dict[str, torch.Tensor]:
    """Step `step`'s gradients of the serial model, one step per micro-batch (`train_serial`'s arguments), in
    `precision` (default the plan's; "fp32" gives the low-precision check's reference, runtime/verify.py), the
    steps before it whose update is in `skipped` skipped (fp16's overflowed first steps)."""
    if precision is not None:
        plan_json = in_precision(plan_json, precision)
    serial = FirstGrads()
    train_serial(user, plan_json, seed, step + 1, batch_of=batch_of, weights=weights, grad_observer=serial.of_model,
                 per_micro_batch=True, observe_step=step, skip_steps=frozenset(skipped))
    return serial.grads


def in_precision(plan_json: dict, precision: str) -> dict:
    """`plan_json` with its precision replaced (a shallow copy): the serial fp32 reference of a bf16 run."""
    return {**plan_json, "plan": {**plan_json["plan"], "precision": precision}}
