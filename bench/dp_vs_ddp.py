"""parc data parallelism vs torch DistributedDataParallel, 2 gloo ranks, same run.

Both train examples/gpt.py from the same weights on the same micro-batches with
the same AdamW: parc runs its compiled program with compiler-assigned gradient
buckets; DDP wraps the eager model (no_sync on all but the last micro-batch).
Run: python bench/dp_vs_ddp.py [--rounds 5] [--steps 4]
Target: parc/DDP ≤ 1.05.
"""

from __future__ import annotations


from common import compile_plan, interleave, pair_args, report

PLAN = """
mesh dp=2
batch global=32 micro=8      # accumulation 2
optimizer adamw lr=3e-4
"""


def _body(ctx, compiled: str, rounds: int, steps: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from parc.runtime.train import Trainer, make_optimizer
    from parc.runtime.checkpoint.state import build_reference

    trainer = Trainer.load(compiled, 0)
    user = trainer.user
    ddp = DDP(build_reference(user, 0))
    opt = make_optimizer(list(ddp.parameters()), trainer.art.plan["plan"]["optimizer"])
    counter = {"parc": 0, "ddp": 0}

    def parc_step():
        trainer.step(counter["parc"])
        counter["parc"] += 1

    def ddp_step():
        mbs = trainer.local_batches(counter["ddp"])
        for k, mb in enumerate(mbs):
            if k < len(mbs) - 1:
                with ddp.no_sync():
                    (user.loss_fn(ddp, *mb) / len(mbs)).backward()
            else:
                (user.loss_fn(ddp, *mb) / len(mbs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter["ddp"] += 1

    return interleave({"parc": parc_step, "ddp": ddp_step}, rounds, steps)


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    times = spawn(2, _body, str(compile_plan(PLAN)), args.rounds, args.steps)[0]
    print(report("DP, examples/gpt.py, 2 gloo ranks, micro 8 × accumulation 2", times, "parc", "ddp", 1.05))


if __name__ == "__main__":
    main()
