"""parc ZeRO-3 vs PyTorch FSDP2 (`fully_shard` per block), 2 gloo ranks, same run.

Both train examples/gpt.py from the same weights on the same per-rank slices of
the same global batches with the same AdamW, no accumulation. The two alternate
round by round (bench/common.py), so both see the same noise.
Run: python bench/zero3_vs_fsdp2.py [--rounds 5] [--steps 4]
Target: parc/FSDP2 ≤ 1.0.
"""

from __future__ import annotations


from common import compile_plan, interleave, pair_args, report

PLAN = """
mesh dp=2
batch global=16 micro=8      # no accumulation: 8 samples per rank per step
zero stage=3
optimizer adamw lr=1e-3
"""


def _body(ctx, compiled: str, rounds: int, steps: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    trainer = Trainer.load(compiled, 0)
    user = trainer.user
    model = build_reference(user, 0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = make_optimizer(list(model.parameters()), trainer.art.plan["plan"]["optimizer"])
    counter = {"parc": 0, "fsdp2": 0}

    def parc_step():
        trainer.step(counter["parc"])
        counter["parc"] += 1

    def fsdp2_step():
        (mb,) = trainer.local_batches(counter["fsdp2"])  # the same slice parc's rank trains on
        user.loss_fn(model, *mb).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter["fsdp2"] += 1

    return interleave({"parc": parc_step, "fsdp2": fsdp2_step}, rounds, steps)


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    times = spawn(2, _body, str(compile_plan(PLAN)), args.rounds, args.steps)[0]
    print(report("ZeRO-3, examples/gpt.py, dp 2 gloo ranks, micro 8", times, "parc", "fsdp2", 1.0))


if __name__ == "__main__":
    main()
