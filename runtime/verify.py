"""`--verify`: train the serial model in-process and compare with the parallel run.

The serial reference is the user's own model and loss, built under the same seed,
trained with the same optimizer on the same global batches — each step one
forward and backward over the whole global batch, with no micro-batching and no
communication. Agreement is measured as relative differences: per-step loss
|a − b| / |b|, and for the parameters ‖a − b‖₂ / ‖b‖₂ over the whole model.

Why model-wide: some parameters have a gradient that is zero in exact arithmetic
(an attention key bias: softmax ignores a shift of its row). In fp32 that
gradient is rounding noise, and Adam divides it by its own magnitude, so any two
summation orders move such an entry by a different ±lr. Per tensor this looks
like an O(1) error; model-wide it is the ~1e-6 it really is. A real mistake — a
wrong shard, a lost micro-batch — moves whole tensors and shows at 1e-3 or more.
The worst single tensor is still reported, for diagnosis.

Dropout. The compiled programs key every dropout mask by (seed, step, call
site, global element index) (passes/dropout.py, runtime/dropout.py); the serial
reference runs the user's eager model under `serial_keys`, which keys each
`F.dropout` and attention dropout the same way, so both runs drop exactly the
same elements. Random ops parc does not key (`unkeyed`) are refused before
training by `dropout_refusal`, naming their modules.
"""

from __future__ import annotations

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
TOLERANCES = {"fp32": DEFAULT_TOLERANCE, "bf16": BF16_TOLERANCE}


@dataclass
class Verdict:
    loss_rel: float
    param_rel: float
    worst_param: str
    tolerance: float
    serial_losses: list[float]

    @property
    def ok(self) -> bool:
        return self.loss_rel <= self.tolerance and self.param_rel <= self.tolerance

    def render(self) -> str:
        word = "PASS" if self.ok else "FAIL"
        return (f"verify {word}: largest relative difference vs serial — losses {self.loss_rel:.2e}, "
                f"parameters {self.param_rel:.2e} ({self.worst_param}); tolerance {self.tolerance:.0e}")


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
            serial_state: dict[str, torch.Tensor], tolerance: float = DEFAULT_TOLERANCE) -> Verdict:
    loss_rel = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(parallel_losses, serial_losses)), default=0.0)
    aliases: dict[int, list[str]] = {}
    for fqn, ref in serial_state.items():
        aliases.setdefault(ref.data_ptr(), []).append(fqn)
    missing = sorted(names[0] for names in aliases.values() if not any(n in parallel_state for n in names))
    if missing:
        raise RuntimeError(f"parallel run lacks parameters {missing[:5]}")
    diff2 = ref2 = 0.0
    worst, worst_rel = "-", 0.0
    for fqn, ref in serial_state.items():
        if fqn not in parallel_state:  # another name of a tied tensor, compared under that name
            continue
        d2 = (parallel_state[fqn].double() - ref.double()).square().sum().item()
        r2 = ref.double().square().sum().item()
        diff2, ref2 = diff2 + d2, ref2 + r2
        rel = (d2 / max(r2, 1e-30)) ** 0.5
        if rel > worst_rel:
            worst, worst_rel = fqn, rel
    param_rel = (diff2 / max(ref2, 1e-30)) ** 0.5
    return Verdict(loss_rel, param_rel, f"worst tensor {worst}: {worst_rel:.1e}", tolerance, serial_losses)
