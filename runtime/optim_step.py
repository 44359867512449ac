"""The optimizer step without host synchronisation: which kernel steps, and how a non-finite step is skipped.

Start here for `--on-nonfinite skip` and for the optimizer's kernels. Two things:

- `kernel_kwargs(params)`: on CUDA, when every parameter is a CUDA fp32 tensor
  (the fp32 masters of runtime/precision.py always are), AdamW/Adam/SGD take
  `fused=True`: one kernel for the whole update, step counts on the device. On
  the CPU nothing changes (torch's default per-tensor loop, what every
  equivalence test was measured with).
- `step_unless(optimizer, found)`: the step, unless `found` (a 0-dim float
  tensor on the device, > 0 when some rank saw a nan/inf) says to skip it. The
  decision never reaches the host. A fused optimizer takes it as `found_inf`,
  the flag `torch.amp.GradScaler` hands it: its kernel leaves parameters and
  moments alone and its step count is decremented again. Any other optimizer
  steps, then every tensor it updated is put back with `torch.where(found,
  before, after)` from a copy taken before the step: exact (the old values
  themselves), at the price of that copy, which the fused path does not need.
"""

from __future__ import annotations

import torch

FUSABLE = ("adamw", "adam", "sgd")


def kernel_kwargs(name: str, params: list) -> dict:
    """Extra keyword arguments of optimizer `name` over `params` (tensors, or param-group dicts as
    runtime/param_groups.py makes them): `fused=True` where it is supported."""
    params = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    if name in FUSABLE and params and all(p.is_cuda and p.dtype == torch.float32 for p in params):
        return {"fused": True}
    return {}


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_device(optimizer: torch.optim.Optimizer, device) -> torch.device:
    """Where `optimizer` keeps its step counts (what a resume puts them back on): on the device for a fused
    optimizer, whose kernel reads them there; on the CPU otherwise (torch's default: read on the host)."""
    return torch.device(device) if _fused(optimizer) else torch.device("cpu")


def step_unless(optimizer: torch.optim.Optimizer, found: torch.Tensor | None) -> None:
    """`optimizer.step()`; where `found` > 0, parameters and optimizer state end as they began."""
    if found is None:
        optimizer.step()
        return
    if _fused(optimizer):
        optimizer.found_inf = found.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    before = [(p.detach().clone(), {k: v.clone() for k, v in optimizer.state.get(p, {}).items() if torch.is_tensor(v)})
              for p in params]
    optimizer.step()
    keep = found > 0
    with torch.no_grad():
        for p, (old, state) in zip(params, before):
            p.copy_(torch.where(keep, old, p))
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v):  # state the step created (the first step's moments) goes back to zeros
                    v.copy_(torch.where(keep, state.get(k, torch.zeros_like(v)), v))
