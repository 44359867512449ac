"""The serial reference of `--verify` and the equivalence tests: the user's own model and loss, trained
in one process.

Start here: `train_serial`. It builds the model under the run's seed (or loads its --weights whole),
and trains it with the plan's optimizer, weight-decay groups and lr schedule on the same global batches
as the parallel run — each step one forward and backward over the whole global batch (one per
micro-batch for a model that declares PER_MICRO_BATCH), with no communication. Dropout draws the
compiled programs' masks (`serial_keys`, runtime/dropout.py); `precision bf16` computes with bf16
copies of fp32 masters, as the parallel run does (`compute_copies`, runtime/precision.py), and `precision fp16`
the same with fp16 copies and the loss scaler of runtime/loss_scale.py (`_Fp16Steps`).
runtime/verify.py compares its losses and parameters with the parallel run's, runtime/verify_grads.py
its first step's gradients.
"""

from __future__ import annotations

import contextlib
import math

import torch

from parc.runtime import param_groups, schedule_lr
from parc.runtime.dropout import key_scope, serial_keys
from parc.runtime.precision import autocast, compute_dtype
from parc.runtime.checkpoint.state import build_reference
from parc.runtime.loss_scale import LossScaler
from parc.runtime.optim_step import step_unless


def train_serial(user, plan_json: dict, seed: int, steps: int,
                 batch_of=None, weights=None, grad_observer=None,
                 per_micro_batch: bool = False, scale_log: list | None = None, observe_step: int = 0,
                 skip_steps=()) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`batch_of(step)`: the whole global batch of `step` from the run's data source (runtime/data.py;
    default the model file's get_batch). The optimizer's weight-decay groups and lr schedule are the
    parallel run's (runtime/param_groups.py, runtime/schedule_lr.py).
    `weights`: the run's --weights (runtime/checkpoint/weights.py), loaded whole into the serial model.
    `grad_observer(model)`: called once, after step `observe_step`'s backward and before clipping and the update
    (the parallel run's `Trainer.grad_observer` is called at the same point; runtime/verify_grads.py).
    `skip_steps`: steps whose update is skipped whatever their gradients (the fp32 reference of an fp16 run skips
    the steps the serial fp16 run skipped on overflow, so that both start the next step from the same weights).
    `per_micro_batch`: one forward and backward per micro-batch of the plan, summed into the gradients,
    as every model declaring PER_MICRO_BATCH is run (runtime/verify_grads.py: bf16 rounds each
    micro-batch's gradient, so the grouping decides the rounding).
    `scale_log`: under fp16, (the loss scale the step ran with, whether it was skipped) is appended per step."""
    model, optimizer = serial_model(user, plan_json, seed, weights)
    cfg = plan_json["plan"]["optimizer"]
    global_batch = plan_json["plan"]["batch"]["global"]
    batch_of = batch_of or (lambda step: user.get_batch(step, global_batch))
    losses = []
    compute = plan_json["plan"].get("precision", "fp32")
    # A model whose forward couples its samples (an MoE's capacity and balance loss) declares
    # PER_MICRO_BATCH: its serial run is one forward per micro-batch, as each dp rank runs it.
    # `per_micro_batch` asks the same of any model: its sums then group as the parallel run's do.
    fp16 = _Fp16Steps.of(plan_json)
    # fp16: one forward per micro-batch, as each rank runs it, so the fp16 values that may overflow are the
    # rank's (runtime/loss_scale.py); a step over the whole batch would overflow at another scale
    per_micro_batch = per_micro_batch or getattr(user.module, "PER_MICRO_BATCH", False) or fp16 is not None
    micro = plan_json["plan"]["batch"]["micro"] if per_micro_batch else global_batch
    keys = serial_keys(model, plan_json.get("dropout", {}).get("sites", []), micro,
                       plan_json["plan"]["batch"]["micro"])
    for step in range(steps):
        batch = batch_of(step)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for first in range(0, global_batch, micro):
            keys.new_forward()
            # the forward's first global sample keys its dropouts (runtime/dropout.py keys by global sample)
            with key_scope(seed, step, first), keys:
                # same layout as the parallel run (runtime/precision.py): bf16 copies of the fp32 masters, autocast
                with autocast(compute, "cpu"), compute_copies(model, compute_dtype(compute)):
                    loss = user.loss_fn(model, *(t[first:first + micro] for t in batch)).float()
                if fp16:
                    fp16.backward(loss)
                else:
                    (loss * (micro / global_batch)).backward()  # the mean over the global batch's forwards
            total += loss.item() * micro / global_batch
        found = fp16.unscale(model, total) if fp16 else None
        if step in skip_steps:
            found = torch.ones(())
        if step == observe_step and grad_observer is not None:
            grad_observer(model)
        if fp16 and scale_log is not None:
            scale_log.append((fp16.scaler.scale.item(), bool(found.item())))
        update(model, optimizer, cfg, step, found)
        if fp16:
            fp16.scaler.update(found)
        losses.append(total)
    # every name of a tied parameter (wte.weight and lm_head.weight are one tensor): the trace may
    # have kept either name
    return losses, {k: v.detach() for k, v in model.named_parameters(remove_duplicate=False)}


def serial_model(user, plan_json: dict, seed: int, weights=None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The serial model, built under `seed` (or given --weights `weights` whole), and the plan's optimizer over
    it with the parallel run's weight-decay groups (runtime/param_groups.py)."""
    from parc.runtime.train import make_optimizer
    from parc.runtime.checkpoint.weights import reference

    model = reference(user, seed, weights) if weights is not None else build_reference(user, seed)
    cfg = plan_json["plan"]["optimizer"]
    decay = param_groups.decays(param_groups.classify(model), cfg)
    optimizer = make_optimizer(param_groups.torch_groups([(p, decay[n]) for n, p in model.named_parameters()]), cfg)
    return model, optimizer


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: dict, step: int,
           found: torch.Tensor | None = None) -> None:
    """Step `step`'s update from the gradients in `model`'s `.grad`: clipped to the plan's global norm, at the lr
    schedule's lr, skipped where `found` > 0 (fp16's overflow: runtime/optim_step.py)."""
    if cfg["grad_clip"] is not None:
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg["grad_clip"])
    schedule_lr.set_lr(optimizer, schedule_lr.lr_at(cfg, step))
    step_unless(optimizer, found)


class _Fp16Steps:
    """fp16's loss scaling in the serial run, as each parallel rank does it: each micro-batch's loss times
    S / accumulation before backward (the rank's fp16 gradients, runtime/train.py `_backward`), the sum over
    every micro-batch of the global batch divided by dp (the dp average of the ranks' sums), unscaled, and the
    step skipped where the loss or a gradient is nan/inf."""

    def __init__(self, plan_json: dict):
        self.scaler = LossScaler(plan_json["plan"]["loss_scaling"], "cpu")
        self.accumulation = plan_json["plan"]["batch"]["accumulation"]
        self.dp = plan_json["plan"]["mesh"]["dp"]

    @classmethod
    def of(cls, plan_json: dict):
        return cls(plan_json) if plan_json["plan"].get("precision") == "fp16" else None

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.loss_factor(self.accumulation)).backward()

    def unscale(self, model: torch.nn.Module, loss: float) -> torch.Tensor:
        """The master gradients as the optimizer reads them; returns the step's found-inf flag (0-dim)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if self.dp > 1:
            for g in grads:
                g.div_(self.dp)
        self.scaler.unscale_(grads)
        bad = not math.isfinite(loss) or any(not torch.isfinite(g).all() for g in grads)
        return torch.tensor(float(bad))


@contextlib.contextmanager
def compute_copies(model: torch.nn.Module, dtype: torch.dtype | None):
    """Inside: `model`'s trainable parameters read as their `dtype` copies (differentiable casts of the fp32
    masters, so gradients accumulate in the masters' fp32 `.grad`); nothing changes for dtype None.
    Tied parameters stay tied: one copy per tensor."""
    if dtype is None:
        yield
        return
    copies = {id(p): p.to(dtype) for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    swapped = []  # (module, attribute, master)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in copies:
                swapped.append((module, name, p))
                del module._parameters[name]
                setattr(module, name, copies[id(p)])  # a plain attribute while inside
    try:
        yield
    finally:
        for module, name, p in swapped:
            delattr(module, name)
            module._parameters[name] = p
