"""The training loop a rank runs under `torchrun -m parc.run`.

Start here for the runtime. `Trainer` loads this rank's program from the
artifact, gets its own shards of the starting weights (docs/weights.md: runtime/checkpoint/weights.py,
runtime/checkpoint/init_shards.py, else the model built once per host under the seed, runtime/checkpoint/state.py),
and runs steps: the rank's slice of the global batch is split into micro-batches,
each runs forward and backward with the loss scaled by 1/accumulation, gradients
are all-reduced across the dp group in buckets overlapped with the last
micro-batch's backward, then AdamW steps (at the schedule's lr, runtime/schedule_lr.py, with
weight-decay groups, runtime/param_groups.py). Data are sharded deterministically:
dp rank i takes rows [i·G/dp, (i+1)·G/dp) of global batch `step` (runtime/data.py: from
`get_batch(step, G)`, or only those rows from `get_samples` or a token file).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from parc.artifact import Artifact
from parc.codegen import load_program
from parc.errors import ParcError
from parc.runtime.context import ParallelContext
from parc.runtime.parallel import pipeline
from parc.runtime.parallel.data_parallel import GradBuckets
from parc.runtime.memory import ActivationProbe
from parc.runtime.parallel.zero import ZeroOptimizer, shard_ranks
from parc.runtime.checkpoint.state import load_state, unshard
from parc.runtime.checkpoint.init_shards import own_init
from parc.runtime import compiled, dropout, loss_scale, precision
from parc.runtime.parallel import grad_norm, ops, sequence_regather, tensor_parallel
from parc.runtime import data, param_groups, schedule_lr
from parc.runtime.parallel import expert_parallel
from parc.runtime.checkpoint import weights as pretrained
from parc.runtime.optim_step import kernel_kwargs, step_unless


def make_optimizer(params: list[torch.Tensor], cfg: dict) -> torch.optim.Optimizer:
    """The plan's optimizer (`parc.grammar.validate.OPTIMIZERS` lists the names the plan accepts)."""
    name = cfg["name"]
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg["lr"], weight_decay=cfg["weight_decay"], **kernel_kwargs(name, params))
    adam = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    return adam(params, lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"], weight_decay=cfg["weight_decay"],
                **kernel_kwargs(name, params))  # fused on CUDA (runtime/optim_step.py)


def check_batch(batch, inputs: list[dict], step: int, batch_cfg: dict, dp: int, rows: int | None = None,
                call: str | None = None) -> None:
    """Refuse, naming get_batch, what `get_batch(step, global)` returned when it is not what the programs were
    compiled for (`inputs`: plan.json's, traced at `parc compile` from one micro-batch): the program itself
    would fail later with an error about its own code (`view size is not compatible`, an argument count).
    `rows`, `call`: a source that returns only this rank's rows (runtime/data.py), and how it was asked."""
    g = batch_cfg["global"]
    call = call or f"get_batch({step}, {g})"
    want = ", ".join(f"{tuple(i['shape'])} {i['dtype']}" for i in inputs)
    if not isinstance(batch, (tuple, list)):
        raise ParcError(f"{call} returned a {type(batch).__name__}; it must return a tuple of tensors, the "
                        f"arguments of loss_fn(model, *batch): {len(inputs)} here, per micro-batch {want}")
    if len(batch) != len(inputs):
        raise ParcError(f"{call} returned {len(batch)} values; the program was compiled for {len(inputs)} "
                        f"(per micro-batch {want}), what get_batch returned at `parc compile`")
    for k, (t, spec) in enumerate(zip(batch, inputs)):
        if not isinstance(t, torch.Tensor):
            raise ParcError(f"{call}: value {k} is a {type(t).__name__}, not a tensor")
        got = t.shape[0] if t.dim() else None
        if rows is not None and got != rows:
            raise ParcError(f"{call}: tensor {k} has {got if got is not None else 'no'} rows (dim 0) for "
                            f"{rows} sample indices: one row per index")
        if rows is None and got != g:
            raise ParcError(f"{call}: tensor {k} has {got if got is not None else 'no'} rows (dim 0) but a step "
                            f"takes the global batch, {g} = micro {batch_cfg['micro']} × accumulation "
                            f"{batch_cfg['accumulation']} × dp {dp} rows: get_batch must return batch_size rows")
        if list(t.shape[1:]) != list(spec["shape"][1:]):
            raise ParcError(f"{call}: tensor {k} has shape {tuple(t.shape)}, samples of shape "
                            f"{tuple(t.shape[1:])}; the program was compiled for samples of shape "
                            f"{tuple(spec['shape'][1:])} (micro-batch {tuple(spec['shape'])})")
        if t.dtype != getattr(torch, spec["dtype"]):
            raise ParcError(f"{call}: tensor {k} is {str(t.dtype).removeprefix('torch.')}; the program was "
                            f"compiled for {spec['dtype']}")


@dataclass
class StepResult:
    # this rank's mean micro-batch loss, detached; under context parallelism its share of it, the cp ranks' shares
    # summing to the loss (passes/context_parallel.py `Share`): read the loss through `Trainer.global_losses`
    loss: torch.Tensor
    seconds: float
    grad_norm: torch.Tensor | None = None  # the global norm before clipping (with `clip=`, or asked for), 0-dim
    # `step(skip_nonfinite=True)`: 1.0 where the step was non-finite and skipped (nothing was updated), a 0-dim
    # tensor on the device, read at the next log point (runtime/divergence.py); False otherwise
    skipped: torch.Tensor | bool = False
    lr: float | None = None  # the learning rate of the step (runtime/schedule_lr.py)


def zero_groups(table: dict, ctx: ParallelContext) -> tuple[object, int, int, tuple[object, int]]:
    """(group, size, this rank's index in it) ZeRO's ranges are cut over, and (replicate group, index in it):
    all of dp (× cp) and (None, 0), or under HSDP (`zero shard=K`) the shard and replicate groups (parc/mesh.py
    `zero_groups`: consecutive dp coordinates (× every cp coordinate) shard, every K-th replicates)."""
    dp, i, k = ctx.degree["dp"], ctx.coord["dp"], shard_ranks(table)
    cp = ctx.degree.get("cp", 1)
    if k == dp * cp and cp > 1:  # context parallelism: the dp × cp ranks that reduce gradients together
        return ctx.groups["dp_cp"], k, ctx.group_ranks["dp_cp"].index(ctx.rank), (None, 0)
    if k == dp * cp:
        return ctx.groups["dp"], dp, i, (None, 0)
    shard, replicate = ctx.group_ranks["zero_shard"], ctx.group_ranks["zero_replicate"]
    return ctx.groups.get("zero_shard"), k, shard.index(ctx.rank), \
        (ctx.groups.get("zero_replicate"), replicate.index(ctx.rank))


class Trainer:
    def __init__(self, art: Artifact, ctx: ParallelContext, user, seed: int, weights: str | Path | None = None):
        self.art, self.ctx, self.user, self.seed = art, ctx, user, seed
        self.current_step = 0  # the step being run: it keys dropout masks (runtime/dropout.py)
        plan = art.plan
        self.name = plan["ranks"][ctx.rank]["program"]
        self.pp = plan["mesh"]["pp"]
        # context parallelism: each cp rank's program returns its share of the loss (`global_losses` sums them)
        self.loss_share = bool((plan.get("context_parallel") or {}).get("loss_share"))
        self.entry = self._entry_of(ctx.rank)
        mode = plan["plan"].get("compile", "none")  # runtime/compiled.py; uncompiled: runtime/eager.py
        self.forward = load_program(art.programs[self.name], ctx.device, str(art.root / self.entry["file"]),
                                    eager=mode == "none")
        self.forward = compiled.program(self.forward, mode)
        # pretrained (--weights, or from_pretrained in build_model): each rank reads its own slices
        self.weights, skeleton = pretrained.resolve(user, weights, seed)
        stand_ins = pretrained.zero3_params(self.entry) if self.weights else set()
        if self.weights:
            self.state = self.weights.materialize(self.entry["state"], skeleton, ctx.device, stand_ins)
        else:  # the model's own init replayed per shard (runtime/checkpoint/init_shards.py), else built once per host
            self.state = own_init(self.entry["state"], user, seed, ctx.device)
            if self.state is None:
                self.state = load_state(lambda r: self._entry_of(r)["state"], ctx.rank, ctx.world_size, user, seed,
                                        ctx.device)
        low = precision.compute_dtype(plan["plan"]["precision"])
        # ZeRO computes in bf16 itself (runtime/parallel/zero.py): stage 3 gathers bf16, stages 1–2 hold a bf16
        # flat buffer beside their fp32 master ranges; no whole fp32 weight is left to copy
        zeroed = bool(self.entry.get("zero"))
        self.casts = precision.StepCasts(  # bf16: each fp32 master's compute copy, made once per step
            [t for t in self.state if t.requires_grad and t.is_floating_point()] if low and not zeroed else [],
            low or torch.bfloat16)
        self.forward = precision.wrap(self.forward, plan["plan"]["precision"], ctx.device, self.casts)
        self.scaler = loss_scale.for_plan(plan["plan"], ctx.device)  # fp16's loss scale (runtime/loss_scale.py)
        self.params = {e["name"]: t for e, t in zip(self.entry["state"], self.state) if t.requires_grad}
        ops.bind_groups(ctx)  # programs name mesh axes ("tp"); runtime/parallel/ops.py resolves them to groups
        self.tp_partial = [self.params[n] for n in self.entry.get("tp_partial_grads", []) if n in self.params]
        self.opt_cfg = plan["plan"]["optimizer"]
        # weight decay by the serial model's parameter, whatever the plan (runtime/param_groups.py)
        decay = param_groups.decays(param_groups.classify_user(user), self.opt_cfg)
        # a parameter the loss does not read (parc/traced.py unread_params) has no gradient in the serial run, so
        # its optimizer skips it; here it gets a zero one (data_parallel.py, ZeRO's flat ranges), which moves it
        # only by weight decay: none, and it stays as serial leaves it
        unread = set(plan.get("unread_params", ()))
        self.decay_of = {e["name"]: decay.get(e["fqn"], True) and e["fqn"] not in unread
                         for e in self.entry["state"] if e["name"] in self.params}
        self.zero = None
        if self.entry.get("zero"):  # ZeRO 1–3: one object reduces, shards and updates (parc.runtime.parallel.zero)
            group, k, index, replicas = zero_groups(self.entry["zero"], ctx)
            self.zero = ZeroOptimizer(expert_parallel.dense_params(self.params, self.entry), self.entry["zero"], group, k,
                                      index, lambda shards: make_optimizer(shards, self.opt_cfg),
                                      self.decay_of,
                                      pretrained.range_reader(self.weights, self.entry, ctx.device) if stand_ins else None,
                                      compute_dtype=low, reduce_dtype=precision.reduce_dtype(plan["plan"]),
                                      accumulate_dtype=precision.accumulate_dtype(plan["plan"]),
                                      divisor=ctx.degree["dp"], replicate=replicas[0], replica=replicas[1],
                                      # programs wait for each layer's post-step gather themselves, compiled
                                      # ones where their wait op declares it writes the weights (passes/zero.py)
                                      lazy_gather=self._gathers_wait_in_forward(mode))
            if self.entry.get("expert_zero"):  # the experts partitioned over edp (runtime/parallel/expert_parallel.py)
                self.zero = expert_parallel.ExpertZero(self.zero, self.params, self.entry, ctx,
                                                       lambda shards: make_optimizer(shards, self.opt_cfg), self.decay_of,
                                                       low, precision.reduce_dtype(plan["plan"]))
            self.buckets = self.optimizer = self.zero
        elif self.pp > 1:  # per stage: each arms its dp sync on its own last micro-batch
            self.buckets = pipeline.StageBuckets(plan, ctx.rank, self.params, *ctx.gradient_group(),
                                                 edp=(ctx.groups.get("edp"), len(ctx.group_ranks.get("edp", [0]))),
                                                 divisor=ctx.degree["dp"])
            self.optimizer = make_optimizer(self._groups(), self.opt_cfg)
        else:
            self.buckets = GradBuckets(self.params, self.entry["buckets"], *ctx.gradient_group(),
                                       divisor=ctx.degree["dp"], reduce_dtype=precision.reduce_dtype(plan["plan"]))
            self.optimizer = make_optimizer(self._groups(), self.opt_cfg)
        if self.entry.get("experts") and self.pp == 1 and not self.zero:  # expert gradients: summed over edp, averaged over dp
            self.buckets = expert_parallel.ExpertBuckets(self.buckets, self.params, self.entry["expert_buckets"], ctx)
        batch = plan["plan"]["batch"]
        self.global_batch, self.micro, self.accumulation = batch["global"], batch["micro"], batch["accumulation"]
        self.resumed_step = 0  # steps the checkpoint this run resumed from holds (runtime/checkpoint/sharded.py)
        # the rows of each step, read by this rank only (runtime/data.py); parc.run may pick another source
        self.data = data.source_for(user, self.entry["inputs"], self.global_batch, seed, None)
        torch.manual_seed(seed + 1 + ctx.coord["dp"] * ctx.degree["pp"] + ctx.coord["pp"])  # same on a tp group (docs/tensor-parallel.md "Dropout")
        self.probe: ActivationProbe | None = None  # set to measure activations (runtime/memory.py)
        # an eager program keeps sequence parallelism's slices, not its gathered inputs (runtime/parallel/
        # sequence_regather.py); a compiled one's graph keeps what it saves
        sp = plan["plan"].get("sequence_parallel") and ctx.degree.get("tp", 1) > 1
        self.regather = sequence_regather.Regather() if sp and mode == "none" else None
        self.pipeline = None
        self.tied: list[tuple[str, object]] = []  # (placeholder name, group of the pp ranks holding it)
        self.tied_elsewhere: set[str] = set()     # tied copies another pp rank counts in the grad norm
        if self.pp > 1:  # runtime/parallel/pipeline.py runs the micro-batch loop; it calls back `before_grad`
            self.pipeline = pipeline.build_executor(self)
            name_of = {e["fqn"]: e["name"] for e in self.entry["state"]}
            self.tied = [(name_of[fqn], pg) for fqn, pg in pipeline.tied_groups(plan, ctx.rank)]
            self.tied_elsewhere = grad_norm.tied_elsewhere(plan, ctx.coord["pp"], self.entry)
        # --verify: called at every step, with this trainer, when the step's gradients are complete (reduced over
        # every axis, unscaled under fp16) and not yet clipped or applied; every rank must be given one
        # (runtime/verify_grads.py)
        self.grad_observer = None
        # parc.run's hung-rank watchdog (runtime/watchdog.py): called with (step, "data") before this rank
        # fetches its batch (user code that may hang) and (step, "compute") once it has it
        self.progress = None
        self.compile_seconds = compiled.warm_up(self)  # `compile inductor`: compiled now, not in step 0

    @classmethod
    def load(cls, art: Artifact | str | Path, seed: int = 0, weights: str | Path | None = None) -> Trainer:
        """This rank's trainer for a compiled/ directory (or a loaded artifact); the process group is up."""
        from parc import artifact
        from parc.trace import load_user_module

        art = art if isinstance(art, Artifact) else artifact.load(Path(art))
        return cls(art, ParallelContext.create(art.plan), load_user_module(art.root / "model" / "model.py"), seed,
                   weights)

    def _entry_of(self, rank: int) -> dict:
        """Rank `rank`'s program entry; with pp, every stage program of the rank, one state list in stage order."""
        plan = self.art.plan
        entry = pipeline.merged_entry(plan, rank) if self.pp > 1 else plan["programs"][plan["ranks"][rank]["program"]]
        # an ep rank's expert entries name its own experts (runtime/parallel/expert_parallel.py)
        return expert_parallel.localize(entry, plan["ranks"][rank].get("ep", 0))

    def _gathers_wait_in_forward(self, mode: str) -> bool:
        """ZeRO-1/2: whether the program's own ops wait for each layer's post-step all-gather (runtime/parallel/
        zero.py "Overlap"): eager ones run in program order; a compiled graph only where its waits declare that
        they write the weights (`gather_waits` "declared"), else `step` waits for every gather itself."""
        waits = self.entry["zero"].get("gather_waits", False)
        return waits == "declared" or (bool(waits) and mode == "none")

    def _groups(self) -> list[dict]:
        return param_groups.torch_groups([(p, self.decay_of[n]) for n, p in self.params.items()])

    def before_grad(self, stage: int, last: bool) -> None:
        """Pipeline callback: a backward of `stage` is about to accumulate grads; `last` arms the dp sync."""
        if isinstance(self.buckets, pipeline.StageBuckets):
            self.buckets.start(stage, last)
        else:  # one stage on this rank
            self.buckets.start_micro_batch(sync=last)

    def local_batches(self, step: int, source=None) -> list[tuple[torch.Tensor, ...]]:
        """This rank's micro-batches of global batch `step` (of `source`: the training data by default)."""
        source = source or self.data
        per_rank = self.global_batch // self.ctx.degree["dp"]
        lo = self.ctx.coord["dp"] * per_rank
        cfg, dp = self.art.plan["plan"]["batch"], self.ctx.degree["dp"]
        if isinstance(source, data.GetBatch):  # the whole global batch, then this rank's rows
            batch = source.whole(step)
            check_batch(batch, self.entry["inputs"], step, cfg, dp, call=source.call(step, lo, per_rank))
        else:  # only this rank's rows
            batch, lo = source.local(step, lo, per_rank), 0
            check_batch(batch, self.entry["inputs"], step, cfg, dp, rows=per_rank, call=source.call(step, lo, per_rank))
        if lo == 0 and self.accumulation == 1 and all(t.shape[0] == self.micro for t in batch):
            return [tuple(t.to(self.ctx.device, non_blocking=True) for t in batch)]  # the rows are the batch
        return [tuple(t[lo + k * self.micro: lo + (k + 1) * self.micro].to(self.ctx.device, non_blocking=True)
                      for t in batch)
                for k in range(self.accumulation)]

    @contextlib.contextmanager
    def saving(self):
        """Around one forward: what autograd saves (runtime/saved.py), sequence parallelism's gathered inputs
        replaced by their slices, and the memory probe's watch when one is measuring."""
        with self.regather.forward() if self.regather else contextlib.nullcontext(), \
                self.probe.tracking() if self.probe else contextlib.nullcontext():
            yield

    def dropout_key(self, k: int):
        """Key the dropouts of this rank's micro-batch `k` of the current step by its first global sample."""
        first = self.ctx.coord["dp"] * (self.global_batch // self.ctx.degree["dp"]) + k * self.micro
        return dropout.key_scope(self.seed, self.current_step, first)

    def step(self, step: int, skip_nonfinite: bool = False, want_norm: bool = False) -> StepResult:
        """One optimizer step on global batch `step`. `skip_nonfinite`: if any rank's loss or gradient is
        nan/inf, update nothing (runtime/divergence.py), decided on the device: the step reads nothing on the
        host (runtime/optim_step.py). `want_norm`: compute the global gradient norm even without `clip=` (one
        scalar all-reduce per mesh axis; parc.run asks for it at log points)."""
        t0 = time.perf_counter()
        self.current_step = step
        if self.progress:
            self.progress(step, "data")
        micro_batches = self.local_batches(step)
        if self.progress:
            self.progress(step, "compute")
        self.casts.refresh()  # bf16: this step's compute copies of the masters (runtime/precision.py)
        if self.probe:  # the batch, and the compute copies (state: runtime/memory.py held_state)
            self.probe.ignore([*(t for mb in micro_batches for t in mb), *self.casts.copies()])
        with self.zero.active() if self.zero else contextlib.nullcontext():
            if self.pipeline is not None:
                if self.scaler:  # fp16: the last stage's backward starts from loss · S / accumulation
                    self.pipeline.scale = self.scaler.loss_factor(self.accumulation)
                total = self.pipeline.run(micro_batches, self)
            else:
                # the sum of the micro-batch losses; with one micro-batch its loss itself, and no division
                # by 1 in the step or in its backward (x / 1 is x: the same bits, two ops fewer)
                total = None
                for k, mb in enumerate(micro_batches):
                    self.buckets.start_micro_batch(sync=k == len(micro_batches) - 1)
                    with self.dropout_key(k):  # forward and backward: a recomputed region redraws its masks
                        with self.saving():
                            (loss,) = self.forward(*self.state, *mb)
                        if self.probe:
                            self.probe.sample([loss])
                        self._backward(loss)
                    total = loss.detach() if total is None else total + loss.detach()
            self.buckets.finish()
        self._complete_grads()
        updated = self.zero.master_grads() if self.zero else [p.grad for p in self.params.values()]
        updated = [g for g in updated if g is not None]  # what the optimizer reads: the fp32 master gradients
        if self.scaler:  # fp16: unscaled before anything reads them (--verify's observer, the norm, the step)
            self._multiplied(self.scaler.unscale_(updated))
        if self.grad_observer is not None:
            self.grad_observer(self)
        found = None
        if skip_nonfinite or self.scaler:  # a device flag: the optimizer leaves params and state as they were
            found = grad_norm.nonfinite(total, updated, self.ctx)  # where it is set (fp16: an overflow)
        norm = None
        if self.opt_cfg["grad_clip"] is not None:
            norm = self.clip(self.opt_cfg["grad_clip"])  # a tensor: reading it would sync the device
        elif want_norm:
            norm = self.global_grad_norm()
        lr = schedule_lr.lr_at(self.opt_cfg, step)
        schedule_lr.set_lr(self.zero.optimizer if self.zero else self.optimizer, lr)
        if self.zero:
            self.zero.step(found)
        else:
            step_unless(self.optimizer, found)
        if self.scaler:
            self.scaler.update(found)  # on the device: every rank holds the same flag, so the same scale
        self.buckets.zero()
        mean = total / self.accumulation if self.accumulation > 1 else total
        return StepResult(mean, time.perf_counter() - t0, norm,
                          skipped=found if found is not None else False, lr=lr)

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss, scaled by 1/accumulation (not divided by 1: the same bits, two ops
        fewer), and under fp16 by the loss scale as well (runtime/loss_scale.py)."""
        if self.scaler:
            (loss * self.scaler.loss_factor(self.accumulation)).backward()
        else:
            (loss / self.accumulation if self.accumulation > 1 else loss).backward()

    def _complete_grads(self) -> None:
        """The sums a gradient still lacks after the dp sync: sequence-parallel partials over tp, tied
        copies over the pp ranks holding them. Under ZeRO they act on this rank's reduced ranges: the
        dp reduce-scatter already ran, and sums over different axes commute."""
        if not self.zero:
            if self.tp_partial:  # sequence parallelism: replicated params used on a sequence slice
                tensor_parallel.sum_partial_grads(self.tp_partial)
            if self.pipeline is not None:
                self.pipeline.sync_tied([(self.params[n], pg) for n, pg in self.tied if n in self.params])
            return
        ranges = self.zero.grad_ranges()
        # tp ranks of one dp rank cut identical buckets (equal local shapes), so these lists agree
        partial = [ranges[n][0] for n in self.entry.get("tp_partial_grads", []) if n in ranges]
        if partial:
            tensor_parallel.sum_over_axis(partial)
        for name, pg in self.tied:
            # the tied copies' ranges differ between stages (different buckets): sum whole gradients
            full = torch.zeros(self.params[name].numel(), dtype=torch.float32, device=self.ctx.device)
            if name in ranges:
                view, a, e = ranges[name]
                full[a:e] = view
            if self.zero.dp > 1:  # over the ranks holding the other ranges: dp, or the shard group under HSDP
                dist.all_reduce(full, group=self.zero.group)
            dist.all_reduce(full, group=pg)
            if name in ranges:
                view.copy_(full[a:e])

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip to the serial model's global norm (`parc.runtime.parallel.grad_norm`); return that norm."""
        owned, grads, axes = self._owned_grads()
        norm, coef = grad_norm.clip_(owned, grads, max_norm, self.ctx, axes)
        self._multiplied(coef)
        return norm

    def _multiplied(self, factor: torch.Tensor) -> None:
        """Every gradient the optimizer reads was just multiplied in place by `factor` (fp16's 1/S, clipping's
        coefficient). ZeRO-Offload copied the reduced ranges to the host during backward: it multiplies its
        copies alike (runtime/parallel/offload.py `multiplied`)."""
        offload = getattr(self.zero, "offload", None)  # ep's ExpertZero has none (offload with ep is refused)
        if offload is not None:
            offload.multiplied(factor)

    def global_grad_norm(self) -> torch.Tensor:
        """The serial model's global gradient norm, unclipped (collective over the axes that split it)."""
        owned, _, axes = self._owned_grads()
        return grad_norm.global_norm(owned, self.ctx, axes)

    def _owned_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[str, ...]]:
        """(the gradient pieces this rank counts in the norm, every gradient it updates, the axes to sum over)."""
        names = grad_norm.counted(self.entry, self.ctx, self.tied_elsewhere)
        if self.zero:  # each dp rank owns its ranges: sum over dp too
            ranges = self.zero.grad_ranges()
            # HSDP: the replicas of a shard hold the same ranges; the first counts them (the sum runs over dp)
            owned = [ranges[n][0] for n in sorted(names) if n in ranges] if self.zero.counts_in_norm() else []
            # context parallelism: the ranges are cut over dp × cp (passes/zero.py), so summed over both
            return owned, self.zero.master_grads(), ("dp", "cp", "tp", "pp")
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        experts = set(self.entry.get("experts") or ())
        owned = grad_norm.owned_pieces(self.params, names - experts)
        if experts:  # each ep rank's experts differ: their squares are summed over ep (runtime/parallel/expert_parallel.py)
            owned.append(expert_parallel.ep_norm_piece(grad_norm.owned_pieces(self.params, names & experts), self.ctx))
        return owned, grads, ("tp", "pp")

    def global_losses(self, local: list[torch.Tensor]) -> list[float]:
        """Mean over the dp group of each step's loss: the loss of the global batch."""
        stacked = torch.stack(local)
        if self.pp > 1:  # only the last stage computed a loss; the others hold zeros
            dist.all_reduce(stacked, group=self.ctx.groups["pp"])
        if self.loss_share:  # each cp rank holds its share (summed here, at a log point, not in every forward)
            dist.all_reduce(stacked, group=self.ctx.groups["cp"])
        if self.ctx.degree["dp"] > 1:
            dist.all_reduce(stacked, group=self.ctx.groups["dp"])
            stacked /= self.ctx.degree["dp"]
        return stacked.tolist()

    def gathered_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters by model FQN, on CPU; tp shards are gathered along their dim. `grads`: their
        gradients instead, gathered the same way, as the optimizer would read them now (zeros where a
        parameter has none); they may alias the live buffers."""
        out = {}
        if grads:
            whole = self.zero.full_grads() if self.zero else {n: p.grad for n, p in self.params.items()
                                                              if p.grad is not None}
        else:
            whole = self.zero.full_params() if self.zero else {}  # ZeRO-3 keeps only shards: gather over dp
        local = [whole.get(e["name"], torch.zeros_like(t) if grads else t).detach()
                 for e, t in zip(self.entry["state"], self.state)]
        for e, full in zip(self.entry["state"], local):
            if e["kind"] != "param":
                continue
            if e["shard"] is not None:
                parts = [torch.empty_like(full) for _ in range(e["shard"]["parts"])]
                dist.all_gather(parts, full.contiguous(), group=self.ctx.groups["tp"])
                full = unshard(parts, e["shard"])
            out[e["fqn"]] = full.cpu()
        if self.entry.get("experts"):  # each ep rank holds E/ep experts: gather every one
            out.update(expert_parallel.gather_experts(self.entry, local, self.ctx))
        if self.pp > 1:  # every stage's parameters, merged on rank 0 (tied copies are equal)
            parts = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
            dist.gather_object(out, parts, dst=0)
            if self.ctx.rank == 0:
                out = {k: v for part in parts for k, v in part.items()}
        return out
