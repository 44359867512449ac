"""parc tensor parallelism vs torch.distributed.tensor.parallel, 2 gloo ranks, same run.

Both train examples/gpt.py from the same weights on the same batches with the
same AdamW, under the same Megatron plan: qkv and fc column-wise, the two
projections row-wise, the embedding split by vocabulary rows, the lm head split
by vocabulary columns. parc runs its compiled program; DTensor wraps the eager
model with `parallelize_module` (ColwiseParallel / RowwiseParallel) and its
`loss_parallel()` cross-entropy. One difference is forced by the model, not
chosen: examples/gpt.py splits the fused qkv output into C-wide pieces, which a
plain local shard cannot do, and DTensor has no sharding rule for CPU SDPA, so
qkv's output is all-gathered (`output_layouts=Replicate()`), attention runs on
all heads on every rank, and proj takes its replicated input
(`input_layouts=Replicate()`) and slices it locally. parc shards qkv per block
instead and keeps attention on local heads.
Run: python bench/tp_vs_dtensor.py [--rounds 5] [--steps 4]
Target: parc/DTensor ≤ 0.8.
"""

from __future__ import annotations


from common import compile_plan, interleave, pair_args, report

PLAN = """
mesh tp=2
batch global=8 micro=8
optimizer adamw lr=3e-4
tensor_parallel {
    "blocks.*.attn.qkv"  : column
    "blocks.*.attn.proj" : row
    "blocks.*.mlp.fc"    : column
    "blocks.*.mlp.proj"  : row
    "wte"                : vocab
    "lm_head"            : vocab
}
"""


def _dtensor_model(model, tp: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        plan |= {f"blocks.{i}.attn.qkv": ColwiseParallel(output_layouts=Replicate()),
                 f"blocks.{i}.attn.proj": RowwiseParallel(input_layouts=Replicate()),
                 f"blocks.{i}.mlp.fc": ColwiseParallel(),
                 f"blocks.{i}.mlp.proj": RowwiseParallel()}
    assert dist.get_world_size() == tp
    return parallelize_module(model, mesh, plan)


def _body(ctx, compiled: str, rounds: int, steps: int):
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    trainer = Trainer.load(compiled, 0)
    user = trainer.user
    model = _dtensor_model(build_reference(user, 0), ctx.world_size)
    opt = make_optimizer(list(model.parameters()), trainer.art.plan["plan"]["optimizer"])
    counter = {"parc": 0, "dtensor": 0}

    def parc_step():
        trainer.step(counter["parc"])
        counter["parc"] += 1

    def dtensor_step():
        idx, targets = trainer.local_batches(counter["dtensor"])[0]
        with loss_parallel():
            logits = model(idx)  # DTensor (B, T, vocab) sharded on vocab
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter["dtensor"] += 1

    return interleave({"parc": parc_step, "dtensor": dtensor_step}, rounds, steps)


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    times = spawn(2, _body, str(compile_plan(PLAN)), args.rounds, args.steps)[0]
    print(report("TP, examples/gpt.py, 2 gloo ranks, micro 8", times, "parc", "dtensor", 0.8))


if __name__ == "__main__":
    main()
