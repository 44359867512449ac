"""A non-finite loss or gradient stops the run, with one line and exit 2, before anything is saved.

Start here: `Guard`, which parc/run.py feeds every step's result (`watch`) and asks at its log points
and before every checkpoint (`check`). `--on-nonfinite` chooses:

stop (default): no host sync is added per step. Each step's loss and gradient norm stay tensors on the
  device; `check` reads them where the run synchronizes anyway: at each log point (the loss is printed)
  and before each save. The losses are all-reduced over dp and pp first and the norm is already the
  whole model's, so every rank sees the same values and raises the same `Divergence` at the same
  point. Detection therefore lags by up to --log-every steps of wasted compute, never by a checkpoint:
  `checkpoint.save` also refuses any non-finite parameter or optimizer value, which catches a gradient
  gone non-finite under a finite loss when the plan has no `clip=` (then no norm is computed).
fp16 (runtime/loss_scale.py) skips every overflowed step in either mode, as DeepSpeed does: its flag is the
  one below, and `check` counts and announces those steps as skipped, not diverged.
skip: `Trainer.step` decides on the device, from one scalar all-reduce per mesh axis
  (`grad_norm.nonfinite`): if any rank's loss or any gradient element is nan/inf, the optimizer step
  leaves the parameters and optimizer state (Adam's moments and step count) as they were, as large runs
  do (Megatron and `torch.amp.GradScaler` skip a step on found_inf). No host sync is added either: the
  flag is a tensor the optimizer takes (runtime/optim_step.py `step_unless`), and `check` reads it with
  the losses, so a skipped step is announced at the next log point or save.
"""

from __future__ import annotations

import math
import sys

import torch

from parc.errors import ParcError


class Divergence(ParcError):
    """Training produced nan/inf; the run stops before saving it."""


class Guard:
    def __init__(self, trainer, mode: str, lead: bool):
        if mode not in ("stop", "skip"):
            raise ValueError(mode)
        self.trainer, self.mode, self.lead = trainer, mode, lead
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None, bool]] = []
        self.last_loss: float | None = None   # the global loss of the last step checked
        self.last_norm: float | None = None   # its global gradient norm, when it was computed
        self.saved: int | None = None         # steps held by the last checkpoint this run wrote
        self.skipped = 0

    def watch(self, step: int, result) -> None:
        """Remember `step`'s result (a `StepResult`); nothing is read from the device here."""
        self.pending.append((step, result.loss, result.grad_norm, result.skipped))

    def check(self) -> None:
        """Read the steps watched since the last check (collective over dp and pp); raise `Divergence` at the
        first non-finite one that was not skipped."""
        if not self.pending:
            return
        steps, losses, norms, skipped = zip(*self.pending)
        self.pending = []
        total = self.trainer.global_losses(list(losses))
        self.last_loss = total[-1]
        known = [n for n in norms if n is not None]
        values = iter(torch.stack(known).tolist() if known else [])
        flags = [s for s in skipped if torch.is_tensor(s)]  # skip mode: the step's device flag
        read = iter(torch.stack(flags).tolist() if flags else [])
        for step, loss, norm, skip in zip(steps, total, norms, skipped):
            value = next(values) if norm is not None else None
            self.last_norm = value
            skip = bool(next(read)) if torch.is_tensor(skip) else skip
            if skip:
                self.skipped += 1
                if self.lead:
                    why = ("a gradient overflowed fp16 under the loss scale, which is lowered (runtime/loss_scale.py)"
                           if getattr(self.trainer, "scaler", None) else
                           "its loss or a gradient is nan/inf (--on-nonfinite skip)")
                    print(f"parc.run: step {step} skipped: {why}; parameters and optimizer state unchanged",
                          file=sys.stderr, flush=True)
            if skip or (math.isfinite(loss) and (value is None or math.isfinite(value))):
                continue
            what = f"loss {loss}" + (f", gradient norm {value}" if value is not None else "")
            last = f"the last checkpoint is step_{self.saved}" if self.saved else "this run saved nothing"
            raise Divergence(f"training diverged at step {step}: {what}; stopped before saving it ({last}); "
                             f"lower the lr, or run with --on-nonfinite skip to skip such steps")

    def note_saved(self, steps: int) -> None:
        self.saved = steps
