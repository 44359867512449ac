"""parc pipeline vs torch.distributed.pipelining Schedule1F1B, 2 gloo ranks, same run.

Both train examples/gpt.py split after `blocks.1` (stage 0: embeddings and
blocks 0–1; stage 1: blocks 2–3, ln_f, lm_head) with 8 micro-batches per step
and the same AdamW. parc runs its compiled stage programs under its 1F1B
schedule; torch wraps the same two halves of the eager model in PipelineStage
and Schedule1F1B. Rounds alternate, so both see the same machine noise. Then it
traces one step of parc under GPipe, 1F1B and ZB-H1 and prints each measured
bubble fraction beside the simulator's (unit costs F = 1, B = 2, I = W = 1).
Run: python bench/pp_vs_torch_pipelining.py [--rounds 5] [--steps 3]
Target: parc/torch ≤ 1.0.
"""

from __future__ import annotations

from pathlib import Path

from common import compile_plan, interleave, pair_args, report

M = 8


def _plan(schedule: str) -> str:
    return f"""
mesh pp=2
batch global={4 * M} micro=4
pipeline schedule={schedule} stages=2 {{
    cut after "blocks.1"
}}
optimizer adamw lr=3e-4
"""


def _halves(model):
    import torch
    import torch.nn as nn

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.drop, self.blocks = model.wte, model.wpe, model.drop, model.blocks[:2]

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for b in self.blocks:
                x = b(x)
            return x

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.ln_f, self.lm_head = model.blocks[2:], model.ln_f, model.lm_head

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    return First(), Last()


def _body(ctx, compiled: dict, rounds: int, steps: int):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from parc import artifact
    from parc.passes.schedule import Schedule
    from parc.passes.simulate import simulate
    from parc.runtime.parallel import pipeline
    from parc.runtime.context import ParallelContext
    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer
    from parc.trace import load_user_module

    def trainer_for(name):
        art = artifact.load(Path(compiled[name]))
        return Trainer(art, ParallelContext.create(art.plan), load_user_module(art.root / "model/model.py"), 0)

    trainer = trainer_for("1f1b")
    user = trainer.user
    half = _halves(build_reference(user, 0))[ctx.rank]
    opt = make_optimizer(list(half.parameters()), trainer.opt_cfg)
    stage = PipelineStage(half, ctx.rank, 2, trainer.ctx.device, group=dist.group.WORLD)

    def loss(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    schedule = Schedule1F1B(stage, M, loss_fn=loss)
    counter = {"parc": 0, "torch": 0}

    def parc_step():
        trainer.step(counter["parc"])
        counter["parc"] += 1

    def torch_step():
        idx, targets = user.get_batch(counter["torch"], trainer.global_batch)
        if ctx.rank == 0:
            schedule.step(idx)
        else:
            schedule.step(target=targets)
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter["torch"] += 1

    times = interleave({"parc": parc_step, "torch": torch_step}, rounds, steps)
    bubbles = {}
    for name in ("gpipe", "1f1b", "zb_h1"):
        t = trainer if name == "1f1b" else trainer_for(name)
        t.step(0)  # warm
        t.pipeline.trace = True
        t.step(1)
        events = t.pipeline.gather_trace()
        sched = Schedule.from_json(t.art.plan["schedule"])
        bubbles[name] = (pipeline.measured_bubble(events), simulate(sched).bubble_fraction)
        if ctx.rank == 0:
            pipeline.write_chrome_trace(events, Path(compiled["out"]) / f"trace_{name}.json")
    return times, bubbles


def main() -> None:
    args = pair_args(__doc__, steps=3)
    from parc.runtime.launch import spawn

    compiled = {s: str(compile_plan(_plan(s))) for s in ("gpipe", "1f1b", "zb_h1")}
    compiled["out"] = str(Path(compiled["1f1b"]).parent)
    times, bubbles = spawn(2, _body, compiled, args.rounds, args.steps, timeout=1200)[0]
    print(report(f"PP, examples/gpt.py, pp 2 × m {M}, 2 gloo ranks, 1F1B: parc vs torch.distributed.pipelining",
                 times, "parc", "torch", 1.0))
    for name, (measured, sim) in bubbles.items():
        print(f"  bubble {name:<6} measured {measured:.3f}  simulator {sim:.3f}")
    print(f"  Chrome traces (Perfetto): {compiled['out']}/trace_*.json")


if __name__ == "__main__":
    main()
