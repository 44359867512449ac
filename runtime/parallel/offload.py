"""ZeRO-Offload (`zero stage=N offload=cpu`): the fp32 masters, the optimizer state and the step in host memory.

Start here from `ZeroOptimizer.step` (runtime/parallel/zero.py), which hands this module its reduced
gradient ranges when the plan's partition table says `"offload": "cpu"`. As DeepSpeed's ZeRO-Offload
(Ren et al., 2021) does it, per bucket this rank holds in host memory, pinned when CUDA is present:

  its fp32 master range        4/N bytes a parameter    (the optimizer's parameters)
  the optimizer state          8/N (Adam's two moments) (created by the host step)
  a gradient buffer            4/N                      (what the reduced range is copied into)

and the step is the plan's optimizer on those host tensors, torch's `foreach` kernels (multi-tensor
loops, bitwise the per-tensor loop the serial reference runs; the fused CPU Adam is not, by 1 ulp on
some elements: measured 6e-8 after five AdamW steps, so it is not used and the tests stay exact).

One step, after `finish`, clipping and the nonfinite check have run on the device as without offload:

  1. device → host: each bucket's reduced fp32 gradient range into its host buffer (`non_blocking`:
     the copies of all buckets are queued on the device's stream back to back, then waited on once);
  2. the host step over all ranges (skipped where `found` says so: runtime/optim_step.py);
  3. host → device: each updated master range into the device's copy of the range (`non_blocking`),
     which the ZeRO runtime then casts and all-gathers as it does without offload; the copy and the
     gather are queued in stream order, and the gathers are waited on by the next forward layer by
     layer (zero.py "Overlap"), so the upload of later layers runs under earlier layers' compute.

What stays on the device: the program's weights and gradients as without offload, and the rank's
fp32 range of the parameters (`ZeroOptimizer.master`), which holds the reduced gradient (clipping and
the global norm read it there) and is what the all-gather sends. In fp32 at stages 1–2 that range is a
view into the flat parameter buffer, so offload frees the 8/N of optimizer state; under bf16 and at
stage 3 the fp32 range stays on the device beside the host master (DeepSpeed keeps a 2-byte copy).

On a CPU-only machine the "device" is the CPU: the same code path runs, and every copy above is a real
copy between separate buffers (tests/test_zero_offload.py proves the result equals the serial run's).
"""

from __future__ import annotations

import torch

from parc.runtime.optim_step import step_unless
from parc.runtime.param_groups import RangeGroups


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An uninitialised host tensor of `t`'s shape and dtype, page-locked when `pin` (so copies to and from
    the device run asynchronously on its copy engine)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)


class HostOptimizer:
    """This rank's ZeRO ranges in host memory, and the plan's optimizer stepping them there.

    `device_ranges`: the ZeRO runtime's fp32 ranges (one per bucket), which keep holding the reduced
    gradients and receive the updated values. `make_opt`, `buckets`, `rank`, `decay_of`: as for
    `ZeroOptimizer` (the optimizer sees the same decay runs, runtime/param_groups.py)."""

    def __init__(self, device_ranges: list[torch.Tensor], buckets: list[dict], rank: int, decay_of: dict,
                 make_opt, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.device_ranges = device_ranges
        self.master = [_host_like(m, self.pin) for m in device_ranges]
        self.grads = [_host_like(m, self.pin) for m in device_ranges]
        self.pull()
        self.pieces = RangeGroups(self.master, buckets, rank, decay_of)
        self.optimizer = make_opt(self.pieces.groups())
        for group in self.optimizer.param_groups:
            if "foreach" in group and not group.get("fused"):
                group["foreach"] = True  # multi-tensor host kernels: the serial loop's values, fewer launches

    def pull(self) -> None:
        """Host masters := the device ranges (at start, and after a checkpoint was loaded into them)."""
        with torch.no_grad():
            for h, d in zip(self.master, self.device_ranges):
                h.copy_(d)

    def step(self, found: torch.Tensor | None) -> None:
        """Gradients down, the host step, parameters up (the module docstring's 1–3)."""
        with torch.no_grad():
            for h, d in zip(self.grads, self.device_ranges):
                h.copy_(d.grad, non_blocking=True)
            _wait_for_device(self.device_ranges)  # the host step reads what the copies wrote
        for m, g in zip(self.master, self.grads):
            m.grad = g
        self.pieces.bind_grads()
        step_unless(self.optimizer, None if found is None else found.to("cpu"))
        with torch.no_grad():
            for h, d in zip(self.master, self.device_ranges):
                d.copy_(h, non_blocking=True)  # ordered before the all-gather that reads it, on d's stream

    def clear_grads(self) -> None:
        for m in self.master:
            m.grad = None
        self.pieces.clear_grads()

    def host_bytes(self) -> dict[str, int]:
        """What this rank holds in host memory, by kind (tests/test_zero_offload.py checks the report's rows)."""
        state = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"params": size(self.master), "grads": size(self.grads), "optimizer": size(state)}


def _wait_for_device(tensors: list[torch.Tensor]) -> None:
    """Block the host until the device's queued work on `tensors` is done (no-op for host tensors: a copy
    between CPU tensors has completed when it returns)."""
    if any(t.is_cuda for t in tensors):
        torch.cuda.current_stream().synchronize()
