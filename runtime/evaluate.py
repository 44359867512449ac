"""`--eval-every N`: the loss on a held-out split, with the compiled programs, forward only.

Start here: `eval_loss(trainer, source, batches)` — the mean loss over `batches` global batches of
the held-out source (runtime/data.py: `--val-data FILE`, or the model file's `get_val_samples` /
`get_val_batch`), batch b being the source's global batch b, the same batches at every eval. Each
rank runs its rows' micro-batches through its programs under no_grad; the loss of the global batch
is the mean over micro-batches and the dp group, as training's (`Trainer.global_losses`), so it is
the serial model's loss on the same samples up to summation order (`serial_eval_loss`).

Pipelines run forward only, stage after stage: for each micro-batch, every stage in order, the rank
holding stage s receives its inputs from the holder of s − 1 (blocking send/recv on the pp group;
every rank walks the same (micro-batch, stage) order, so the pairs always meet) and sends its
outputs on. No schedule, no bubble filling: eval is rare and this is simple and exact.

Dropout: the programs are the training programs, so a model that drops out would be evaluated with
dropout; parc.run refuses --eval-every for such a plan (`refusal`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from parc.runtime.parallel.pipeline import rank_programs


def refusal(plan_json: dict) -> str | None:
    sites = plan_json.get("dropout", {}).get("sites", [])
    if not sites:
        return None
    return (f"--eval-every: the compiled programs drop out ({len(sites)} dropout site(s)), so an eval loss would "
            f"be noisy and not the model's; compile the model with dropout 0 to evaluate it")


def _stage_holders(plan_json: dict, ctx) -> dict[int, int]:
    """Stage → pp coordinate of the rank holding it, among this rank's dp and tp coordinates."""
    out = {}
    for r, me in enumerate(plan_json["ranks"]):
        if me["dp"] == ctx.coord["dp"] and me["tp"] == ctx.coord["tp"]:
            for name in rank_programs(plan_json, r):
                out[plan_json["programs"][name]["stage"]] = me["pp"]
    return out


def _pipeline_forward(trainer, micro_batches) -> torch.Tensor:
    """Sum of the last stage's micro-batch losses (0 on other ranks), forward only."""
    ex, ctx = trainer.pipeline, trainer.ctx
    holder = _stage_holders(trainer.art.plan, ctx)
    me, last = ctx.coord["pp"], max(holder)
    total = torch.zeros((), device=ctx.device)
    for j, mb in enumerate(micro_batches):
        carry: list[torch.Tensor] = []
        for s in range(last + 1):
            if holder[s] != me:
                continue
            st = ex.stages[s]
            if s > 0 and holder[s - 1] != me:
                carry = [ex._empty(spec) for spec in st.recv]
                for x in carry:
                    dist.recv(x, src=ex.pp_ranks[holder[s - 1]], group=ex.group)
            with trainer.dropout_key(j):
                out = st.forward(*st.state, *carry, *mb)
            if st.last:
                total += out[0].detach().float()
                continue
            carry = [o.detach().contiguous() for o in out]
            if holder[s + 1] != me:
                for x in carry:
                    dist.send(x, dst=ex.pp_ranks[holder[s + 1]], group=ex.group)
    return total


def eval_loss(trainer, source, batches: int) -> float:
    """Mean loss over held-out global batches 0…batches−1 (collective over every rank)."""
    local = []
    trainer.casts.refresh()  # bf16: copies of the masters as the last step left them (runtime/precision.py)
    with torch.no_grad(), (trainer.zero.active() if trainer.zero else contextlib.nullcontext()):
        for b in range(batches):
            micro_batches = trainer.local_batches(b, source)
            if trainer.pipeline is not None:
                total = _pipeline_forward(trainer, micro_batches)
            else:
                total = torch.zeros((), device=trainer.ctx.device)
                for k, mb in enumerate(micro_batches):
                    with trainer.dropout_key(k):
                        (loss,) = trainer.forward(*trainer.state, *mb)
                    total += loss.detach().float()
            local.append(total / trainer.accumulation)
    losses = trainer.global_losses(local)
    return sum(losses) / len(losses)


def serial_eval_loss(user, model: torch.nn.Module, batch_of, batches: int) -> float:
    """The serial model's mean loss over the same held-out global batches (`batch_of(b)`: batch b whole)."""
    with torch.no_grad():
        return sum(user.loss_fn(model, *batch_of(b)).float().item() for b in range(batches)) / batches

