"""Top-k routing pinned to the fp32 run's choices, so the low-precision comparison sees rounding, not flips.

Start at `Routing`. A top-k router (an MoE's gate) is a discontinuity: a token whose two best scores are closer
than bf16's rounding goes to the other expert in one bf16 run and not in another, and that token's whole
contribution to every gradient upstream moves with it. On the zoo's tiny models (192 tokens, a handful of
flips) one flip more or less decides whether the parallel run sits 3× or 30× farther from fp32 than the serial
bf16 run (bench/zoo/bf16_diag.py: bailing_hybrid 2 flips against 0, its expert gradients 34× farther). So
bench/zoo/run.py records every `aten.topk` of the serial fp32 run and replays its choices in the serial and the
parallel low-precision runs: the routing becomes an input, like the batch. What stays compared: each run's own
scores, which the chosen experts' outputs are weighted by (the values are gathered from the run's own scores,
so the router's gradient and the weighting are the run's own arithmetic). A parallel run that computed wrong
router scores still differs in the gradients; one that routed by wrong scores is no longer seen routing
elsewhere, which is what the fp32 plans (tp2, tp2_sp, 3d) check exactly.

The replay pairs calls by order: valid where the parallel rank runs the same forwards over the same
micro-batches as the serial run per micro-batch (tp without dp, pp, ep or cp: every tp rank routes every
token). `pinnable(spec)` says which plans; a call whose scores' shape differs from the recorded one raises.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class Routing(TorchDispatchMode):
    """Inside: every aten.topk's scores and chosen indices are recorded in call order (`indices`, `scores`);
    with `pin`, the i-th call chooses `pin[i]` instead, its values gathered from its own scores (so autograd's
    backward follows the pinned choice)."""

    def __init__(self, pin: list[torch.Tensor] | None = None):
        super().__init__()
        self.indices: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.pin = pin
        self.unpinned = 0  # tokens whose own choice differed from the pinned one
        self.routed = 0    # tokens routed under a pin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not aten.topk.default:
            return func(*args, **kwargs)
        i = len(self.indices)
        self.scores.append(args[0].detach().float().clone())
        if self.pin is None:
            out = func(*args, **kwargs)
        else:
            if i >= len(self.pin):
                raise RuntimeError(f"top-k call {i}: the pinned run recorded only {len(self.pin)} calls")
            x = args[0]
            dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) % x.dim()
            idx = self.pin[i].to(x.device)
            if [n for j, n in enumerate(idx.shape) if j != dim] != [n for j, n in enumerate(x.shape) if j != dim]:
                raise RuntimeError(f"top-k call {i}: scores {tuple(x.shape)}, pinned choices {tuple(idx.shape)}: "
                                   "the runs' forwards do not pair")
            own = func(*args, **kwargs)[1]  # what this run would have chosen, counted in `unpinned`
            self.unpinned += int((own.sort(dim).values != idx.sort(dim).values).any(dim).sum())
            self.routed += own.numel() // own.shape[dim]
            out = (aten.gather.default(x, dim, idx), idx)
        self.indices.append(out[1].detach().clone())
        return out

    def check_paired(self) -> None:
        """Raise unless every pinned choice was replayed (the runs made as many top-k calls)."""
        if self.pin is not None and len(self.indices) != len(self.pin):
            raise RuntimeError(f"{len(self.indices)} top-k calls replayed {len(self.pin)} pinned ones: the runs' "
                               "forwards do not pair")

    def said(self) -> str:
        return f"{self.unpinned}/{self.routed} tokens" if self.pin is not None else "-"


def pinnable(spec) -> bool:
    """Whether a zoo plan's ranks run the serial per-micro-batch forwards one for one (tp alone)."""
    return all(kv.split("=")[0] == "tp" or kv.endswith("=1") for kv in spec.mesh.split())
