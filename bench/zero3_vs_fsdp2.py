"""parc ZeRO-3 vs PyTorch FSDP2 (`fully_shard` per block), 2 gloo ranks, same run.

Both train examples/gpt.py from the same weights on the same per-rank slices of
the same global batches with the same AdamW, no accumulation. The two alternate
round by round (bench/common.py), so both see the same noise.
Run: python bench/zero3_vs_fsdp2.py [--rounds 5] [--steps 4]
Target: parc/FSDP2 ≤ 1.0, in time and in peak memory.

Peak memory per rank, measured on one more step of each after the timed rounds: the state the
rank holds between steps, counted storage by storage (parc: `ZeroOptimizer.held`, its
weight, gradient and Adam ranges; FSDP2: the local shards of its parameters and of AdamW's
moments, its gradients being None after `zero_grad`), plus the most the CPU allocator's live
bytes rise during the step (bench/common.py `peak_rise`: the profiler's allocation and free
events in order): activations, gathered layers, gradients being reduced, and gloo's own copy of a
bucket while its collective runs (allocated on gloo's worker thread, inside the collective). A free
gloo's thread makes after a collective (its last reference to the work's buffers) is not seen; parc
joins each collective until gloo has let go (runtime/parallel/zero.py `_Collective`), FSDP2 does not,
so its figure can count such a buffer to the step's end. The step's input rows are the same for both.
"""

from __future__ import annotations


from common import compile_plan, interleave, mib, pair_args, peak_rise, report

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

    times = interleave({"parc": parc_step, "fsdp2": fsdp2_step}, rounds, steps)
    held = {"parc": _held_parc(trainer), "fsdp2": _held_fsdp2(model, opt)}
    rise = {"parc": peak_rise(parc_step), "fsdp2": peak_rise(fsdp2_step)}
    return times, {k: {"held": held[k], "rise": rise[k], "peak": held[k] + rise[k]} for k in held}


def _held_parc(trainer) -> int:
    from parc.runtime.memory import storage_bytes

    # between steps: ZeRO-3's gradient ranges are freed after each update, as FSDP2's `zero_grad(set_to_none)`
    # frees its gradients; both make them again in the step, so the step's rise counts them for both
    held = trainer.zero.held()
    return storage_bytes(held["params"]) + storage_bytes(held["grads"]) + \
        storage_bytes([t for t in held["optimizer"] if t.dim() > 0])


def _held_fsdp2(model, opt) -> int:
    """FSDP2's state between steps: each parameter's local shard, its gradient if kept, AdamW's moments."""
    from parc.runtime.memory import storage_bytes

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    moments = [local(v) for st in opt.state.values() for v in st.values() if hasattr(v, "dim") and v.dim() > 0]
    return storage_bytes(params) + storage_bytes(grads) + storage_bytes(moments)


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    ranks = spawn(2, _body, str(compile_plan(PLAN)), args.rounds, args.steps)
    times = ranks[0][0]
    print(report("ZeRO-3, examples/gpt.py, dp 2 gloo ranks, micro 8", times, "parc", "fsdp2", 1.0))
    for r, (_, mem) in enumerate(ranks):
        print(f"  rank {r} peak memory: " + ", ".join(
            f"{k} {mib(m['peak'])} (held {mib(m['held'])} + step {mib(m['rise'])})" for k, m in mem.items())
            + f"; ratio parc/fsdp2 = {mem['parc']['peak'] / mem['fsdp2']['peak']:.3f}")
    worst = max(m["parc"]["peak"] / m["fsdp2"]["peak"] for _, m in ranks)
    print(f"  memory ratio parc/fsdp2 (worst rank) = {worst:.3f} ({'meets' if worst <= 1.0 else 'misses'} "
          "the target ≤ 1.0)")


if __name__ == "__main__":
    main()
