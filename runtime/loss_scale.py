"""`precision fp16`'s dynamic loss scaler: DeepSpeed's DynamicLossScaler, kept on the device.

Start here for fp16's loss scaling (docs/precision.md "fp16"). fp16 has 5 exponent bits: a gradient under
2**-24 underflows to zero. So each micro-batch's loss is multiplied by the scale S before backward (the fp16
gradients are S times larger), and the fp32 master gradients, once summed over micro-batches and every mesh
axis, are multiplied by 1/S before anything reads them (clipping, the norm, the optimizer). S is a power of two
(it starts at 2**initial_scale_power and moves by factors of 2, DeepSpeed's fixed scale_factor), so scaling and
unscaling are exact and an fp16 run differs from bf16's layout only in its rounding.

If any rank's gradients hold an inf/nan (S too large: an fp16 value overflowed), the step is skipped and S
is lowered; after `loss_scale_window` steps without an overflow it is raised. DeepSpeed's rule, step by step:

  overflow:  hysteresis left > 1 → one less left (S kept);  else S = max(S / 2, min_loss_scale)
  no overflow: if steps since the last overflow (counting this one) is a multiple of the window:
               S = 2·S and hysteresis left back to `hysteresis`

`loss_scale > 0` fixes S (DeepSpeed's static scaling); overflowed steps are still skipped.

Nothing reads the device on the host: S, the hysteresis left and the count of steps since the last overflow are
0-dim tensors updated with `torch.where` from the step's found-inf flag, which is itself a tensor all-reduced over
every mesh axis (runtime/parallel/grad_norm.py `nonfinite`), so every rank of every group makes the same update.
The serial reference (runtime/serial_reference.py) runs the same class on the same flags, so the parallel and
serial scale histories are comparable step by step. The state is in every checkpoint (`state_dict`).
"""

from __future__ import annotations

import torch


class LossScaler:
    def __init__(self, cfg: dict, device):
        """`cfg`: plan.json's `plan.loss_scaling` (parc.grammar.plan.LossScaling as a dict)."""
        self.window = int(cfg["loss_scale_window"])
        self.hysteresis = int(cfg["hysteresis"])
        self.min_scale = float(cfg["min_loss_scale"])
        self.static = float(cfg["loss_scale"]) > 0
        first = float(cfg["loss_scale"]) if self.static else 2.0 ** int(cfg["initial_scale_power"])
        self.scale = torch.tensor(first, dtype=torch.float32, device=device)
        self.left = torch.tensor(self.hysteresis, dtype=torch.int64, device=device)  # overflows before a backoff
        self.since = torch.tensor(1, dtype=torch.int64, device=device)  # DeepSpeed's cur_iter - last_overflow_iter

    def loss_factor(self, accumulation: int) -> torch.Tensor:
        """What a micro-batch's loss is multiplied by before backward: S / accumulation (a 0-dim fp32 tensor),
        as DeepSpeed scales, then divides by the gradient accumulation steps."""
        return self.scale / accumulation if accumulation > 1 else self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Multiply the fp32 master gradients by 1/S in place (exact: S is a power of two); return 1/S."""
        inv = torch.reciprocal(self.scale)
        for g in grads:
            g.mul_(inv.to(g.dtype))
        return inv

    def update(self, found: torch.Tensor) -> None:
        """After the step: move S by DeepSpeed's rule (module docstring); `found` > 0 where the step overflowed."""
        if self.static:
            return
        over = found > 0
        backoff = over & (self.left <= 1)
        grow = ~over & (self.since % self.window == 0)
        lowered = torch.clamp(self.scale / 2, min=self.min_scale)
        self.scale.copy_(torch.where(backoff, lowered, torch.where(grow, self.scale * 2, self.scale)))
        self.left.copy_(torch.where(over & ~backoff, self.left - 1,
                                    torch.where(grow, torch.full_like(self.left, self.hysteresis), self.left)))
        self.since.copy_(torch.where(over, torch.ones_like(self.since), self.since + 1))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps (CPU copies): with it a resumed run scales and skips as the uninterrupted one."""
        return {"scale": self.scale.detach().cpu().clone(), "hysteresis_left": self.left.detach().cpu().clone(),
                "since_overflow": self.since.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.scale.copy_(state["scale"])
        self.left.copy_(state["hysteresis_left"])
        self.since.copy_(state["since_overflow"])


def for_plan(plan_summary: dict, device) -> LossScaler | None:
    """plan.json's scaler under `precision fp16`, else None (fp32 and bf16 scale nothing)."""
    if plan_summary.get("precision") != "fp16":
        return None
    return LossScaler(plan_summary["loss_scaling"], device)
