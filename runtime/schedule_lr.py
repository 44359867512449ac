"""The learning rate of each step: the plan's `optimizer … warmup= decay= decay_steps= min_lr=`.

Start here: `lr_at(cfg, step)` (plan.json's optimizer summary, the 0-based step being run) and
`set_lr(optimizer, lr)`. The schedule is Megatron's and nanoGPT's, with their names:

  step s < warmup               lr · (s + 1) / warmup          (linear warmup, reaches lr at s = warmup − 1)
  warmup ≤ s < decay_steps      min_lr + (lr − min_lr) · f(r),  r = (s − warmup) / (decay_steps − warmup)
                                  cosine: f = ½ (1 + cos πr)     linear: f = 1 − r
  s ≥ decay_steps               min_lr
  decay=constant                lr after warmup (min_lr and decay_steps are refused by grammar/validate.py)

It is a pure function of the step, so a resumed run (which knows its step from the checkpoint)
continues the schedule exactly, and the serial reference (--verify) computes the same numbers.
"""

from __future__ import annotations

import math

import torch


def lr_at(cfg: dict, step: int) -> float:
    """The learning rate of 0-based step `step` under the plan's optimizer settings `cfg`."""
    lr, warmup = cfg["lr"], cfg.get("warmup", 0)
    if step < warmup:
        return lr * (step + 1) / warmup
    decay = cfg.get("decay", "constant")
    if decay == "constant":
        return lr
    low, end = cfg.get("min_lr") or 0.0, cfg["decay_steps"]
    if step >= end:
        return low
    r = (step - warmup) / (end - warmup)
    f = 0.5 * (1.0 + math.cos(math.pi * r)) if decay == "cosine" else 1.0 - r
    return low + (lr - low) * f


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every param group steps with `lr` (groups differ only in weight decay: runtime/param_groups.py)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def describe(cfg: dict) -> str:
    """The schedule in a few words, for the start line."""
    warm = f"warmup {cfg.get('warmup', 0)} steps, " if cfg.get("warmup", 0) else ""
    decay = cfg.get("decay", "constant")
    if decay == "constant":
        return f"lr {cfg['lr']:g} ({warm}constant)" if warm else f"lr {cfg['lr']:g} constant"
    return (f"lr {cfg['lr']:g} ({warm}{decay} decay to {cfg.get('min_lr') or 0.0:g} at step "
            f"{cfg['decay_steps']})")
