"""The training loop a rank runs under `torchrun -m parc.run`.

Start here for the runtime. `Trainer` loads this rank's program from the
artifact, materializes its state from the user's model (same seed everywhere),
and runs steps: the rank's slice of the global batch is split into micro-batches,
each runs forward and backward with the loss scaled by 1/accumulation, gradients
are all-reduced across the dp group in buckets overlapped with the last
micro-batch's backward, then AdamW steps. Data are sharded deterministically:
dp rank i takes samples [i·G/dp, (i+1)·G/dp) of the global batch `get_batch(step, G)`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parc.artifact import Artifact
from parc.codegen import load_program
from parc.runtime.context import ParallelContext
from parc.runtime.data_parallel import GradBuckets
from parc.runtime.state import build_reference, materialize


def make_optimizer(params: list[torch.Tensor], cfg: dict) -> torch.optim.Optimizer:
    """The plan's optimizer (`parc.validate.OPTIMIZERS` lists the names the plan accepts)."""
    name = cfg["name"]
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    adam = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    return adam(params, lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"], weight_decay=cfg["weight_decay"])


@dataclass
class StepResult:
    loss: torch.Tensor   # this rank's mean micro-batch loss, detached
    seconds: float


class Trainer:
    def __init__(self, art: Artifact, ctx: ParallelContext, user, seed: int):
        self.art, self.ctx, self.user = art, ctx, user
        plan = art.plan
        self.name = plan["ranks"][ctx.rank]["program"]
        self.entry = plan["programs"][self.name]
        self.forward = load_program(art.programs[self.name], ctx.device, str(art.root / self.entry["file"]))
        reference = build_reference(user, seed)
        self.state = materialize(self.entry["state"], reference, ctx.device)
        del reference
        self.params = {e["name"]: t for e, t in zip(self.entry["state"], self.state) if t.requires_grad}
        self.buckets = GradBuckets(self.params, self.entry["buckets"], ctx.groups["dp"], ctx.degree["dp"])
        self.opt_cfg = plan["plan"]["optimizer"]
        self.optimizer = make_optimizer(list(self.params.values()), self.opt_cfg)
        batch = plan["plan"]["batch"]
        self.global_batch, self.micro, self.accumulation = batch["global"], batch["micro"], batch["accumulation"]
        torch.manual_seed(seed + 1 + ctx.rank)  # dropout streams: distinct per rank, fixed per run

    def local_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of global batch `step`."""
        batch = self.user.get_batch(step, self.global_batch)
        per_rank = self.global_batch // self.ctx.degree["dp"]
        lo = self.ctx.coord["dp"] * per_rank
        return [tuple(t[lo + k * self.micro: lo + (k + 1) * self.micro].to(self.ctx.device) for t in batch)
                for k in range(self.accumulation)]

    def step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        total = torch.zeros((), device=self.ctx.device)
        micro_batches = self.local_batches(step)
        for k, mb in enumerate(micro_batches):
            self.buckets.start_micro_batch(sync=k == len(micro_batches) - 1)
            (loss,) = self.forward(*self.state, *mb)
            (loss / self.accumulation).backward()
            total += loss.detach()
        self.buckets.finish()
        if self.opt_cfg["grad_clip"] is not None:
            torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.opt_cfg["grad_clip"])
        self.optimizer.step()
        self.buckets.zero()
        return StepResult(total / self.accumulation, time.perf_counter() - t0)

    def global_losses(self, local: list[torch.Tensor]) -> list[float]:
        """Mean over the dp group of each step's loss: the loss of the global batch."""
        stacked = torch.stack(local)
        if self.ctx.degree["dp"] > 1:
            dist.all_reduce(stacked, group=self.ctx.groups["dp"])
            stacked /= self.ctx.degree["dp"]
        return stacked.tolist()

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """Full parameters by model FQN, on CPU; tp shards are gathered along their dim."""
        out = {}
        for e, t in zip(self.entry["state"], self.state):
            if e["kind"] != "param":
                continue
            full = t.detach()
            if e["shard"] is not None:
                parts = [torch.empty_like(full) for _ in range(e["shard"]["parts"])]
                dist.all_gather(parts, full.contiguous(), group=self.ctx.groups["tp"])
                full = torch.cat(parts, dim=e["shard"]["dim"])
            out[e["fqn"]] = full.cpu()
        return out
