"""`--verify`: train the serial model in-process and compare with the parallel run.

Start here: `compare`, which parc.run calls on rank 0 after training. The serial reference
(runtime/serial_reference.py) is the user's own model and loss, built under the same seed, trained with
the same optimizer on the same global batches — each step one forward and backward over the whole global
batch, with no micro-batching and no communication. Three checks, each named when it fails:

  loss        per-step |a − b| / |b|, the worst step;
  gradients   the first step's gradients, each tensor whole, before clipping and the update
              (runtime/verify_grads.py): a wrong gradient shows as itself, not through an optimizer;
  parameters  after the last step, ‖a − b‖₂ / ‖b‖₂ over the whole model.

Under bf16/fp16 (`compare_low_precision`, after the constants below) the losses and first-step gradients are
measured from a serial fp32 run, and the parameters against the serial optimizer replayed on the parallel run's
own gradients (runtime/verify_replay.py).

Why parameters are judged model-wide: some parameters have a gradient that is zero in exact arithmetic
(an attention key bias: softmax ignores a shift of its row). In fp32 that gradient is rounding noise,
and Adam divides it by its own magnitude, so any two summation orders move such an entry by a different
±lr. Per tensor this looks like an O(1) error; model-wide it is the ~1e-6 it really is. A real mistake
that moves whole tensors (a wrong shard, a lost micro-batch) shows at 1e-3 or more; one confined to a
small tensor (a 16-element norm weight) is drowned model-wide, which is what the gradient check is for.

Which tensor: every check that compares tensors ranks them by `rank_tensors`, the largest elementwise
difference relative to the tensor's own scale (with a floor, explained there), so a small broken tensor
outranks a big healthy one whose absolute differences are larger. The worst is named with its relative
and absolute difference.

Dropout. The compiled programs key every dropout mask by (seed, step, call
site, global element index) (passes/dropout.py, runtime/dropout.py); the serial
reference runs the user's eager model under `serial_keys`, which keys each
`F.dropout` and attention dropout the same way, so both runs drop exactly the
same elements. Random ops parc does not key (`unkeyed`) are refused before
training by `dropout_refusal`, naming their modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parc.runtime.serial_reference import train_serial  # noqa: F401  (the reference --verify trains; tests import it here)


# fp32: the parallel run sums the same products in another order (micro-batch
# means, then a dp all-reduce) — rounding differences of ~1e-7 relative per op,
# amplified a little by AdamW's normalisation over a few steps. 1e-4 leaves room
# for that and still catches any real mistake (a wrong shard, a missing
# all-reduce, a skipped micro-batch), which shows up as 1e-2 or more.
DEFAULT_TOLERANCE = 1e-4

# bf16 (precision bf16: bf16 copies of fp32 masters, autocast): each matmul rounds its inputs to
# 8 mantissa bits (~4e-3 relative). Both runs round the same fp32 inputs the same
# way, so the differences come from accumulation order (micro-batches, the dp
# reduction) pushed through bf16-rounded activations, then AdamW: an entry whose
# gradient is mostly rounding noise moves by ±lr either way, so the parameter
# difference grows with lr. Measured on examples/gpt.py, parameters: 3.4e-4 at
# lr 6e-4 (examples/zero.par, ZeRO-2 dp 4, 3 steps; losses 5e-6), 5.1e-3 at lr 1e-2
# (dp 2, 2 steps). 1e-2 passes that noise at the usual learning rates. It is
# looser than a small real mistake at a small lr (a quarter of the batch lost at
# lr 6e-4 measures parameters 7.2e-3, losses 4.5e-4); tests/test_bf16_layout.py
# therefore uses 2e-3 at lr 1e-3, and --tolerance tightens a run by hand.
BF16_TOLERANCE = 1e-2
# fp16 (runtime/loss_scale.py) rounds to 11 mantissa bits where bf16 rounds to 8, and its power-of-two loss
# scale adds no rounding: bf16's tolerance bounds it (tests/test_fp16.py holds dp, ZeRO, pp at 2e-3, tp 4e-3).
TOLERANCES = {"fp32": DEFAULT_TOLERANCE, "bf16": BF16_TOLERANCE, "fp16": BF16_TOLERANCE}


# Low precision (bf16, fp16): the standard comparison for low-precision kernels (FlashAttention's and Megatron's
# tests): a third run, the serial model in fp32 on the same batches from the same weights, is the reference, and
# the parallel run's distance to it must be within FACTOR × the serial low-precision run's distance to it, plus a
# floor: each step's loss and each first-step gradient tensor (`spreads`). Why not parallel against serial bf16 with
# a fixed tolerance: the serial bf16 run is itself one sample of bf16 rounding, and where a discontinuity amplifies
# rounding (a top-k router choosing another expert for a token whose two scores round to the other order; a gradient
# that is a sum cancelling to little) both bf16 runs sit far from fp32 and from each other (diffllama's `lambda_q2`
# gradient: 0.49 of its scale apart), while a run computing something else sits far from fp32 where serial bf16 is
# near it. FACTOR 3: two independent samples of the same rounding differ from the reference by comparable amounts,
# and the parallel run rounds more (tp's bf16 partial sums before their all-reduce, about one rounding more per
# sharded matmul): the worst tensor measured on the zoo sat 2.2× serial's distance (flex_olmo's k_norm gradient
# under tp 2, 6.2e-2 against 2.9e-2; bench/zoo/bf16_diag.py), where FlashAttention's 2 would leave no margin. A
# missing share of a gradient (a tp sum, a micro-batch) is O(1) of its scale where serial bf16 is ~1e-2 of it: a
# q_norm weight without its tp sum measured 15× past its bound (tests/test_verify_grads.py). Not the parameters:
# after Adam steps an element whose gradient is below bf16's rounding moves ±lr by rounding's sign, and whether
# serial bf16 flips any of a small tensor's elements is chance, so serial's distance is no measure of the parallel
# run's (a correct dp 1 run failed 19× past it). The parameters are held instead to the serial optimizer replayed on
# the parallel run's own gradients, exact to fp32 rounding (runtime/verify_replay.py).
LOW_PRECISION_FACTOR = 3.0
# The floors, as fractions of the reference's scale (the tensor's largest |fp32| element, floored as
# `rank_tensors` floors; a loss's |fp32| value): where the serial low-precision run happens to land on the fp32
# value (a gradient bf16 never rounds, a tensor no step touched), the parallel run may still round once where
# serial does not. Gradients: bf16's unit roundoff is 2**-8 = 3.9e-3 of a value; 1e-2 is between two and three
# roundings, a tenth of the smallest missing share measured (0.33, runtime/verify_grads.py). Losses: 1e-3 of
# their value. A loss is one number, so one bf16 run may land near the fp32 loss by chance where the other does
# not: two bf16 runs' losses measured up to 3.4e-4 apart on the zoo (exaone4; axk1's serial bf16 loss 2.7e-5 from
# fp32 where its tp run's is 1.7e-4).
LOW_PRECISION_GRAD_FLOOR = 1e-2
LOW_PRECISION_FLOOR = 1e-3


# The floor of a tensor's scale in `rank_tensors`, as a fraction of the largest |serial| element over all
# the tensors compared. Without it a tensor whose exact value is zero (a key bias's gradient, see above)
# would be divided by its own rounding noise and read as an O(1) error in a healthy run. That noise is
# ~1e-7 (fp32) of the values summed into it, themselves at most the model's largest gradient elements, so
# against 1e-3 of the largest element it reads ~1e-4 at the very worst; measured, examples/gpt.py's key
# biases stay under 1e-7 (runtime/verify_grads.py's figures). The price: a tensor whose whole scale is
# under 1e-3 of the largest element reads its error against the floor, smaller than against its own
# scale (a missing half of it reads 0.5 × its scale / the floor), so it is named later than it deserves.
SCALE_FLOOR = 1e-3


@dataclass
class Worst:
    """One tensor's difference: `rel` = max|parallel − serial| / max(max|serial|, floor), `abs` = max|…|."""
    name: str
    rel: float
    abs: float

    def render(self) -> str:
        return f"{self.name}: {self.rel:.1e} of its scale, max |Δ| {self.abs:.1e}"


def rank_tensors(parallel: dict[str, torch.Tensor], serial: dict[str, torch.Tensor],
                 floor: float = SCALE_FLOOR) -> list[Worst]:
    """Every tensor's difference relative to its own scale (floored at `floor` × the largest |serial| element
    of them all), worst first; nan counts as infinite. `serial` may hold several names of one tied tensor."""
    pairs = _paired(parallel, serial)
    scale = {name: b.abs().max().item() if b.numel() else 0.0 for name, _, b in pairs}
    least = floor * max(scale.values(), default=0.0)
    out = []
    for name, a, b in pairs:
        d = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
        d = float("inf") if d != d else d  # nan: a diverged tensor
        s = max(scale[name], least)
        out.append(Worst(name, d / s if s > 0 else (0.0 if d == 0 else float("inf")), d))
    return sorted(out, key=lambda w: -w.rel)


def _paired(parallel: dict[str, torch.Tensor], serial: dict[str, torch.Tensor]):
    """(name, parallel, serial) for each serial tensor, under the name the parallel run kept (the trace
    may have kept either name of a tied tensor: wte.weight and lm_head.weight are one)."""
    aliases: dict[int, list[str]] = {}
    for fqn, ref in serial.items():
        aliases.setdefault(ref.data_ptr(), []).append(fqn)
    missing = sorted(names[0] for names in aliases.values() if not any(n in parallel for n in names))
    if missing:
        raise RuntimeError(f"parallel run lacks parameters {missing[:5]}")
    return [(fqn, parallel[fqn], ref) for fqn, ref in serial.items() if fqn in parallel]


class Judged:
    """A measured distance (`measured`) against what is allowed (`allowed`), both given by the subclass: `Spread`
    (three-way, low precision) and runtime/verify_replay.py's `Drift` (the optimizer replay)."""
    measured: float
    allowed: float

    @property
    def ratio(self) -> float:
        """measured / allowed: ≤ 1 passes; nan counts as infinite."""
        r = self.measured / self.allowed if self.allowed > 0 else (0.0 if self.measured == 0 else math.inf)
        return math.inf if r != r else r

    @property
    def rel(self) -> float:  # what `Worst.rel` is to the exact comparison: the figure a verdict is judged by
        return self.ratio


@dataclass
class Spread(Judged):
    """One tensor (or one step's loss) under low precision: `parallel` and `serial` are the parallel run's and the
    serial same-precision run's distances to the fp32 reference, max|x − fp32| / the reference's scale; it passes
    while `parallel` ≤ `factor` × `serial` + `floor` (`allowed`)."""
    name: str
    parallel: float
    serial: float
    factor: float
    floor: float
    abs: float = 0.0  # max|parallel − fp32|

    @property
    def allowed(self) -> float:
        return self.factor * self.serial + self.floor

    @property
    def measured(self) -> float:
        return self.parallel

    def render(self) -> str:
        return (f"{self.name}: {self.parallel:.1e} of its scale from fp32, serial {self.serial:.1e}; allowed "
                f"{self.factor:g} × {self.serial:.1e} + {self.floor:.0e} = {self.allowed:.1e}")


def spreads(parallel: dict[str, torch.Tensor], serial: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
            floor: float, factor: float = LOW_PRECISION_FACTOR, scale_floor: float = SCALE_FLOOR) -> list[Spread]:
    """Every tensor's `Spread`, worst (largest parallel/allowed) first. A tensor's scale is its largest |fp32|
    element, floored at `scale_floor` × the largest of them all (as `rank_tensors`, for the same reason)."""
    same = {name: s for name, s, _ in _paired(serial, reference)}
    pairs = _paired(parallel, reference)
    scale = {name: r.abs().max().item() if r.numel() else 0.0 for name, _, r in pairs}
    least = scale_floor * max(scale.values(), default=0.0)
    out = []
    for name, p, r in pairs:
        s = max(scale[name], least)
        if s == 0 or not r.numel():
            out.append(Spread(name, 0.0, 0.0, factor, floor))
            continue
        r = r.double()
        dp = (p.double() - r).abs().max().item()
        ds = (same[name].double() - r).abs().max().item()
        out.append(Spread(name, math.inf if dp != dp else dp / s, math.inf if ds != ds else ds / s, factor, floor,
                          dp))
    return sorted(out, key=lambda w: -w.ratio)


def loss_spreads(parallel: list[float], serial: list[float], reference: list[float],
                 floor: float = LOW_PRECISION_FLOOR, factor: float = LOW_PRECISION_FACTOR) -> list[Spread]:
    """Each step's loss as a `Spread` (distances relative to |the fp32 loss|), worst first."""
    out = []
    for i, (p, s, r) in enumerate(zip(parallel, serial, reference)):
        scale = max(abs(r), 1e-12)
        out.append(Spread(f"loss at step {i}", abs(p - r) / scale, abs(s - r) / scale, factor, floor, abs(p - r)))
    return sorted(out, key=lambda w: -w.ratio)


@dataclass
class LowPrecisionVerdict:
    """`--verify` under bf16/fp16. Losses and first-step gradients: the parallel run against the serial run of the
    same precision, both measured from the serial fp32 run (see LOW_PRECISION_FACTOR), each check's worst
    `Spread`, passing while within its allowed distance. Parameters: against the serial optimizer replayed on the
    parallel run's own gradients (runtime/verify_replay.py `Drift`), the worst tensor's difference against its
    allowance (fp32 rounding), passing while within it."""
    precision: str
    loss: Spread | None
    worst_grad: Spread | None    # None: first-step gradients not compared
    # runtime/verify_replay.py `Drift` (which imports this module: typed by its base here)
    worst_param: Judged | None   # None: parameters not compared (no replay: a resumed run has no step 0)
    serial_losses: list[float]
    # fp16: the step whose gradients are compared, the first the serial fp16 run did not skip on overflow (the loss
    # scale comes down over the first steps); `grads_mismatch`: why the parallel run has none at that step
    grads_step: int | None = 0   # None: every step overflowed in serial, none applied
    grads_mismatch: str | None = None

    @property
    def failed(self) -> list[str]:
        out = [name for name, s in (("loss", self.loss), ("gradients", self.worst_grad))
               if s is not None and not s.ratio <= 1.0]
        if self.grads_mismatch and "gradients" not in out:
            out.append("gradients")
        if self.worst_param is not None and not self.worst_param.ratio <= 1.0:
            out.append("parameters")
        return out

    @property
    def ok(self) -> bool:
        return not self.failed

    # the exact verdict's figures, for callers that print or store them (bench/zoo/run.py)
    @property
    def loss_rel(self) -> float:
        return self.loss.parallel if self.loss else 0.0

    @property
    def param_rel(self) -> float:
        return self.worst_param.ratio if self.worst_param else 0.0

    def render(self) -> str:
        failed = self.failed
        word = f"FAIL ({', '.join(failed)})" if failed else "PASS"

        def one(what, s):
            return f"{what} {s.ratio:.2f} of allowed (worst {s.render()})" if s else f"{what} not compared"
        params = (f"parameters {self.worst_param.ratio:.2f} of allowed, against the serial optimizer replayed on "
                  f"this run's gradients (worst {self.worst_param.render()})"
                  if self.worst_param else "parameters not compared")
        grads = (f"step {self.grads_step}'s gradients (steps before it overflowed in serial {self.precision} "
                 f"and were skipped)" if self.grads_step else "first-step gradients")
        if self.grads_step is None:
            grads = f"gradients not compared (every step overflowed in serial {self.precision} and was skipped)"
        elif self.grads_mismatch or self.worst_grad is None:
            grads += " not compared"
        else:
            grads = one(grads, self.worst_grad)
        line = (f"verify {word}: {self.precision} against serial {self.precision}, both from serial fp32 (allowed: "
                f"{LOW_PRECISION_FACTOR:g} × serial's distance + a floor) — {one('losses', self.loss)}; "
                f"{grads}; {params}")
        if self.grads_mismatch:
            return line + f"\nverify: {self.grads_mismatch}"
        if not failed:
            return line
        if "gradients" in failed or "parameters" not in failed:
            culprit, what = (self.worst_grad, "first-step gradient") if "gradients" in failed else (self.loss, "value")
            return line + (f"\nverify: worst tensor {culprit.name} — its {what} is {culprit.parallel:.1e} of its "
                           f"scale from fp32 where serial {self.precision}'s is {culprit.serial:.1e} "
                           f"(max |Δ| {culprit.abs:.1e})")
        w = self.worst_param
        return line + (f"\nverify: worst tensor {w.name} — its parameter is {w.abs:.1e} from what the serial "
                       f"optimizer makes of this run's own gradients, {w.ratio:.1f}× the rounding allowed (the "
                       f"replay moved it by {w.movement:.1e}): an update lost, stale or applied otherwise")


def compare_low_precision(precision: str, parallel_losses: list[float], serial_losses: list[float],
                          reference_losses: list[float], grads: tuple[dict, dict, dict] | None = None,
                          replayed: list[Judged] | None = None, grads_step: int | None = 0,
                          grads_mismatch: str | None = None) -> LowPrecisionVerdict:
    """`grads`: step `grads_step`'s gradients of the parallel, serial same-precision and serial fp32 runs (None: not
    compared, a resumed run; `grads_mismatch`: why they could not be, a failure). `replayed`: the parallel run's
    parameters against the optimizer replayed on its gradients, worst first (runtime/verify_replay.py
    `OptimizerReplay.check`; None: not compared)."""
    loss = loss_spreads(parallel_losses, serial_losses, reference_losses)
    worst_grad = spreads(*grads, LOW_PRECISION_GRAD_FLOOR)[0] if grads and grads[0] is not None else None
    return LowPrecisionVerdict(precision, loss[0] if loss else None, worst_grad,
                               replayed[0] if replayed else None, serial_losses, grads_step, grads_mismatch)


@dataclass
class Verdict:
    loss_rel: float
    param_rel: float
    worst_param: Worst | None   # the parameter worst relative to its own scale (None: no parameters)
    tolerance: float            # losses and parameters
    serial_losses: list[float]
    worst_grad: Worst | None = None      # the first-step gradient check (None: not made)
    grad_tolerance: float | None = None

    @property
    def failed(self) -> list[str]:
        """The checks past their tolerance (`not <=`: a nan fails)."""
        out = [] if self.loss_rel <= self.tolerance else ["loss"]
        if self.worst_grad is not None and not self.worst_grad.rel <= self.grad_tolerance:
            out.append("gradients")
        return out + ([] if self.param_rel <= self.tolerance else ["parameters"])

    @property
    def ok(self) -> bool:
        return not self.failed

    def render(self) -> str:
        failed = self.failed
        word = f"FAIL ({', '.join(failed)})" if failed else "PASS"
        grads = (f"first-step gradients {self.worst_grad.rel:.2e} (worst {self.worst_grad.render()}; "
                 f"tolerance {self.grad_tolerance:.0e})" if self.worst_grad else "first-step gradients not compared")
        worst = f" (worst {self.worst_param.render()})" if self.worst_param else ""
        line = (f"verify {word}: relative difference vs serial — losses {self.loss_rel:.2e}; {grads}; "
                f"parameters {self.param_rel:.2e} model-wide{worst}; tolerance {self.tolerance:.0e}")
        if not failed:
            return line
        # the tensor to look at first: the gradient check's when it has one (no optimizer between it and
        # the cause), else the parameters'
        culprit, what = ((self.worst_grad, "first-step gradient") if self.worst_grad is not None
                         else (self.worst_param, "parameter"))
        if culprit is None:
            return line
        return line + (f"\nverify: worst tensor {culprit.name} — its {what} differs by {culprit.rel:.1e} of its "
                       f"scale (max |Δ| {culprit.abs:.1e})")


def dropout_refusal(plan_json: dict) -> str | None:
    """Why --verify cannot be exact for this artifact (random ops parc does not key), or None."""
    unkeyed = plan_json.get("dropout", {}).get("unkeyed", [])
    if not unkeyed:
        return None
    where = "; ".join(f"`{u['module'] or '<top level>'}` ({u['op']}: {u['why']})" for u in unkeyed[:5])
    more = f" and {len(unkeyed) - 5} more" if len(unkeyed) > 5 else ""
    return (f"--verify cannot match the serial model's random draws at {len(unkeyed)} op(s): {where}{more}; "
            "parc keys only F.dropout / nn.Dropout and attention dropout. To verify the plan, turn these ops "
            "off (a dropout: probability 0, e.g. the model config's *_dropout / *_pdrop), compile again and "
            "run --verify on that")


def compare(parallel_losses: list[float], serial_losses: list[float], parallel_state: dict[str, torch.Tensor],
            serial_state: dict[str, torch.Tensor], tolerance: float = DEFAULT_TOLERANCE,
            worst_grad: Worst | None = None, grad_tolerance: float | None = None) -> Verdict:
    """`worst_grad`, `grad_tolerance`: the first-step gradient check's result (runtime/verify_grads.py)."""
    loss_rel = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(parallel_losses, serial_losses)), default=0.0)
    diff2 = ref2 = 0.0
    for _, a, b in _paired(parallel_state, serial_state):
        diff2 += (a.double() - b.double()).square().sum().item()
        ref2 += b.double().square().sum().item()
    param_rel = (diff2 / max(ref2, 1e-30)) ** 0.5
    ranked = rank_tensors(parallel_state, serial_state)
    return Verdict(loss_rel, param_rel, ranked[0] if ranked else None, tolerance, serial_losses,
                   worst_grad, grad_tolerance)
