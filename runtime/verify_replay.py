"""`--verify`'s parameter check under bf16/fp16: the serial optimizer replayed on the parallel run's own gradients.

Start here: `OptimizerReplay`. parc.run hands it, on rank 0, every step's complete gradients of the parallel run
(gathered whole, after the dp, tp and tied sums and fp16's unscaling, before clipping: runtime/verify_grads.py
`FirstGrads`, the point where the trainer calls its `grad_observer`). It holds the serial model built from the
same weights and the plan's optimizer over it (runtime/serial_reference.py `serial_model`), and applies each step's
update from those gradients: clipping, the lr schedule, weight decay, Adam's moments, fp16's skipped steps. After
the last step the parallel run's parameters must equal the replay's to fp32 rounding (`check`).

Why not compare the parameters with a serial run trained on its own gradients. Adam moves an element by about lr
whatever its gradient's size, so an element whose gradient is smaller than bf16's rounding of it takes the sign
that rounding gives: two bf16 runs move it ±lr apart, and after k steps elements differ by up to 2k·lr. How many
elements of a tensor sit that close to zero is chance, so the serial bf16 run is not a measure of the parallel
run's noise: on tests/models/norm_cast.py (dp 1, bf16, AdamW lr 1e-3, 3 steps) every tensor had an element
2·lr from serial fp32 (max |Δ| 2.0e-3 to 2.6e-3), the zero-initialised `model.layers.1.input_layernorm.bias`
too in the parc run, while serial bf16 happened to move none of its 32 elements the other way (3.2e-5): 0.48 of
its scale (its scale is itself ~3·lr) against 7.8e-3, and the three-way comparison failed a correct run. A floor
of c·lr per element would pass that, and would pass a lost update too, which is off by ≈ lr per element as well.

What the replay proves, exactly: given the gradients the parallel run computed, its optimizer did what the serial
optimizer does with them — every shard updated, with its own moments, at the right lr, clipped by the global
norm, weight-decayed as serial, none stale, none twice. Both sides are fp32 on the same inputs, so the only
differences are the order of the clipping norm's sum and of ZeRO's flat updates: fp32 rounding (`TOLERANCE`).
What it does not see: whether the gradients were right. That is the first-step gradient check's job (three-way
against serial fp32, runtime/verify.py `spreads`), and the losses'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parc.runtime.serial_reference import serial_model, update
from parc.runtime.verify import Judged

# fp32 on both sides from the same gradients, so a difference is measured against what the replay itself did
# to the tensor: its movement, max |replayed − initial| (`Drift`). An Adam update is lr · m̂ / (√v̂ + eps), the
# same elementwise arithmetic on the same inputs; what differs is the clipping coefficient (the global norm summed
# over shards in another order, ~1e-7 relative: it moves the update of an element whose |gradient| is near eps by
# ~1e-7 of lr) and ZeRO's per-range updates. A lost update is off by one step's move, ≥ 1/steps of the movement for
# the elements that moved most. TOLERANCE 1e-4 of the movement: measured noise in tests/test_verify_replay.py's
# docstring, and a step lost out of up to 10,000 still reads past it.
TOLERANCE = 1e-4
# Where a step's move is small next to the parameter (a large weight at a tiny lr), adding it rounds to the
# parameter's own ulp, and a move that differs in its last bits can round to the neighbouring value: one ulp of
# the tensor's largest element per step, on top of the movement's share. Twice that for margin.
ULPS_PER_STEP = 2


@dataclass
class Drift(Judged):
    """One tensor: the parallel run's parameter against the replay's, max |Δ| (`abs`); the replay's movement over
    the run, max |replayed − initial| (`movement`); `allowed` = TOLERANCE × movement + steps × ULPS_PER_STEP ulps of
    the tensor's largest element (`ulps`)."""
    name: str
    abs: float
    movement: float
    ulps: float

    @property
    def allowed(self) -> float:
        return TOLERANCE * self.movement + self.ulps

    @property
    def measured(self) -> float:
        return self.abs

    def render(self) -> str:
        return (f"{self.name}: max |Δ| {self.abs:.1e} from the replay, which moved it by {self.movement:.1e}; "
                f"allowed {TOLERANCE:.0e} × {self.movement:.1e} + {self.ulps:.1e} (rounding) = {self.allowed:.1e}")


class OptimizerReplay:
    """The serial model and optimizer, stepped with the parallel run's gradients; rank 0 only.
    `skips`: the parallel run skips a step whose gradients are not finite (fp16's overflow, `--on-nonfinite skip`);
    the replay skips the same steps, read from the same gradients."""

    def __init__(self, user, plan_json: dict, seed: int, weights=None, skips: bool = False):
        self.model, self.optimizer = serial_model(user, plan_json, seed, weights)
        self.initial = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.cfg = plan_json["plan"]["optimizer"]
        # parameters the loss does not read: serial's have no gradient, and its optimizer leaves them alone; the
        # parallel run's zero gradient moves them by nothing (runtime/train.py takes them out of weight decay)
        self.unread = set(plan_json.get("unread_params", ()))
        self.skips = skips
        self.steps = 0

    def feed(self, step: int, grads: dict[str, torch.Tensor]) -> None:
        """Step `step`'s update from the parallel run's gradients `grads` (by model FQN; a tied parameter under
        either of its names). Steps come in order from 0."""
        if step != self.steps:
            raise RuntimeError(f"optimizer replay: got step {step}'s gradients after {self.steps} steps")
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if name in self.unread or not p.requires_grad:  # a frozen one: serial's optimizer skips it too
                p.grad = None
            elif name in grads:  # a tied tensor: one of its names is in `grads`; each sets the same gradient
                p.grad = grads[name].detach().to(p.dtype).clone()
        missing = [n for n, p in self.model.named_parameters()
                   if p.grad is None and p.requires_grad and n not in self.unread]
        if missing:
            raise RuntimeError(f"optimizer replay: the parallel run gave no gradient for {missing[:5]}")
        found = None
        if self.skips:
            found = torch.tensor(float(any(not torch.isfinite(p.grad).all() for p in self.model.parameters()
                                           if p.grad is not None)))
        update(self.model, self.optimizer, self.cfg, step, found)
        self.steps += 1

    def state(self) -> dict[str, torch.Tensor]:
        """The replayed parameters, every name of a tied one (as `train_serial` returns them)."""
        return {k: v.detach() for k, v in self.model.named_parameters(remove_duplicate=False)}

    def check(self, parallel: dict[str, torch.Tensor]) -> list[Drift]:
        """The parallel run's final parameters against the replay's, worst (largest abs / allowed) first. Each
        tensor is looked up under the name the parallel run kept (a tied one under either name)."""
        out = []
        for name, p in self.model.named_parameters():
            names = [n for n, q in self.model.named_parameters(remove_duplicate=False) if q is p]
            got = next((parallel[n] for n in names if n in parallel), None)
            if got is None:
                raise RuntimeError(f"parallel run lacks parameter {name}")
            mine = p.detach().double()
            d = (got.double() - mine).abs().max().item() if p.numel() else 0.0
            moved = (mine - self.initial[name].double()).abs().max().item() if p.numel() else 0.0
            top = p.detach().abs().max().float() if p.numel() else torch.tensor(0.0)
            ulp = (torch.nextafter(top, torch.tensor(math.inf)) - top).item()
            out.append(Drift(name, math.inf if d != d else d, moved, self.steps * ULPS_PER_STEP * ulp))
        return sorted(out, key=lambda w: -w.ratio)
