"""parc ring attention vs PyTorch's `context_parallel` (its ring attention), cp 2 on 2 gloo ranks, same run.

Both train bench/gpt_long.py (examples/gpt.py's GPT over 2048-token windows, 2 layers, width 64, 4 heads:
at this length the attention's T² work is most of a step) from the same weights on the same batches with the
same AdamW, each sequence split over the 2 ranks in the same load-balanced layout (rank r holds chunks r and
3 − r of 4). parc runs its compiled program (`mesh cp=2`, `context_parallel ring`: passes/context_parallel.py,
runtime/parallel/ring_attention.py). The peer is the eager model under
`torch.distributed.tensor.experimental.context_parallel(mesh, buffers=[tokens, targets, positions])`, torch's
own API: it shards the buffers with its head-tail load balancer and patches F.scaled_dot_product_attention to
its ring (`_templated_ring_attention`: K/V rotated, block results merged by their log-sum-exps, a ring
backward). Positions are a buffer it shards, as torchtitan passes `freqs_cis` (the model's own
`arange(T)` would read local positions under torch's API: parc's pass rewrites it, torch cannot see it).
The peer's loss is each rank's mean over its tokens (equal counts: the mean of the two is the serial mean)
and its gradients one flat all-reduce over cp, divided by cp; parc's loss is each rank's share of the mean
(passes/context_parallel.py `Share`) and its gradients its buckets' all-reduce over dp × cp. Neither step
reads its loss across ranks: both are read after the checked steps, as a training loop reads them at a
log point (parc: `Trainer.global_losses`).

**Why torch needs two kernels added here.** As shipped (torch 2.13), `context_parallel` does not run on CPU:
on a CPU tensor SDPA dispatches to `aten._scaled_dot_product_flash_attention_for_cpu`, which its dispatch
table does not list (it knows the CUDA flash, efficient and cuDNN kernels), and the forward fails with
`NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered`. `_cpu_ring_kernels` adds that kernel and its backward to the same table,
each calling torch's own `_templated_ring_attention` / `_templated_ring_attention_backward` with the CPU
kernel where the GPU path passes the CUDA one; everything else (sharding, load balancing, rotation,
merging, the backward's dK/dV ring) is torch's. So the comparison is torch's ring algorithm with torch's
fused CPU attention kernel per block against parc's ring, whose blocks run the same fused kernel
(runtime/parallel/ring_attention.py); the two differ in their rings, not their block kernels.

Checked, not assumed: the first `--check-steps` steps (3) of each are compared before timing: every step's
loss and the final parameters, within 1e-5 / 1e-4 relative (fp32; the two sum the same products in another
order, as tests/test_context_parallel.py's tolerances explain); the script exits 1 past them.
Run: python bench/cp_vs_torch.py [--rounds 5] [--steps 3] [--seq 2048] [--profile]
Target: parc/torch ≤ 1.0.
"""

from __future__ import annotations

import os

from common import ROOT, compile_plan, interleave, pair_args, report

PLAN = """
mesh cp=2
batch global=2 micro=2
context_parallel ring
optimizer adamw lr=1e-3 weight_decay=0.0
"""
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # fp32, the same sums in another order (the docstring)


def _cpu_ring_kernels() -> None:
    """Adds CPU SDPA (`_scaled_dot_product_flash_attention_for_cpu`, forward and backward) to
    `context_parallel`'s dispatch table, each running torch's own templated ring with the CPU kernel for a
    block. The local results are wrapped as torch's handler wraps them: sharded along the sequence (dim 2)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    aten = torch.ops.aten

    def sharded(local, mesh):
        shape = list(local.shape)
        shape[2] *= mesh.size()
        meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
        return DTensor._op_dispatcher.wrap(local, DTensorSpec(mesh, (Shard(2),), tensor_meta=meta))

    def forward(op_call, args, kwargs):
        q, k, v, *rest = args
        dropout_p = rest[0] if len(rest) > 0 else kwargs.get("dropout_p", 0.0)
        is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
        if kwargs.get("attn_mask") is not None or dropout_p:
            raise ValueError("this bench registers a CPU ring without masks or dropout: bench/gpt_long.py uses neither")
        mesh = q.device_mesh
        out, lse = cpa._templated_ring_attention(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu.default, q.to_local(),
            k.to_local(), v.to_local(), is_causal=is_causal, dropout_p=0.0, scale=kwargs.get("scale"))
        return sharded(out, mesh), sharded(lse, mesh)

    def backward(op_call, args, kwargs):
        grad_out, q, k, v, out, lse, dropout_p, is_causal = args
        mesh = q.device_mesh
        dq, dk, dv = cpa._templated_ring_attention_backward(
            mesh.get_group(), 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            grad_out=grad_out.to_local(), grad_out_name="grad_out", query=q.to_local(), key=k.to_local(),
            value=v.to_local(), out=out.to_local(), logsumexp=lse.to_local(), is_causal=is_causal,
            dropout_p=0.0, scale=kwargs.get("scale"))
        return tuple(sharded(t, mesh) for t in (dq, dk, dv))

    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = forward
    cpa.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = backward


def _positions_from_buffer(model, holder: list):
    """examples/gpt.py's forward, reading its positions from `holder[0]` (a buffer context_parallel shards)
    instead of `arange(T)` of the local length."""
    def forward(idx):
        x = model.drop(model.wte(idx) + model.wpe(holder[0]))  # (B, T/cp, C)
        for block in model.blocks:
            x = block(x)
        return model.lm_head(model.ln_f(x))  # (B, T/cp, vocab)

    model.forward = forward


def contenders(compiled: str) -> tuple[dict, object, object, object]:
    """In a rank: ({"parc": step, "torch": step}, parc's Trainer, torch's model, losses); each step trains the
    next global batch and returns this rank's part of its loss, unread (no step waits on another rank for its
    log: torchtitan's loop reads the loss at log points); `losses(name, parts)` reads the steps' losses."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    _cpu_ring_kernels()
    trainer = Trainer.load(compiled, 0)
    user = trainer.user
    model = build_reference(user, 0)
    holder: list = [None]
    _positions_from_buffer(model, holder)
    opt = make_optimizer(list(model.parameters()), trainer.art.plan["plan"]["optimizer"])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    cp = mesh.size()
    counter = {"parc": 0, "torch": 0}

    def parc_step():
        share = trainer.step(counter["parc"]).loss  # this rank's share of the loss (passes/context_parallel.py)
        counter["parc"] += 1
        return share

    def torch_step():
        ((idx, tgt),) = trainer.local_batches(counter["torch"])  # one micro-batch: the whole (B, T)
        idx, tgt, pos = idx.clone(), tgt.clone(), torch.arange(idx.shape[1])
        with context_parallel(mesh, buffers=[idx, tgt, pos], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={idx, tgt, pos}):
            holder[0] = pos  # this rank's global positions, in its load-balanced order
            loss = user.loss_fn(model, idx, tgt)  # the mean over this rank's B·T/cp tokens
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)  # the cp ranks' shares of each gradient; / cp: the gradient of the mean
        flat /= cp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter["torch"] += 1
        return loss.detach()

    def losses(name: str, local: list) -> list[float]:
        """The micro-batch losses of steps whose per-rank values are `local`, read after the steps as a
        training loop reads them at a log point: parc's shares summed over cp (`Trainer.global_losses`),
        torch's per-rank means averaged (equal token counts: their mean is the serial mean)."""
        if name == "parc":
            return trainer.global_losses(local)
        stacked = torch.stack(local)
        dist.all_reduce(stacked)
        return (stacked / cp).tolist()

    return {"parc": parc_step, "torch": torch_step}, trainer, model, losses


def _profiles(steps_of: dict, rows: int = 12) -> dict[str, str]:
    """One more step of each under torch.profiler: the ops by self CPU time (`--profile`)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in steps_of.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return out


def _body(ctx, compiled: str, rounds: int, steps: int, check_steps: int, profile: bool):
    steps_of, trainer, model, read = contenders(compiled)
    parc_step, torch_step = steps_of["parc"], steps_of["torch"]
    # agreement first, from the same weights on the same batches
    losses = {name: read(name, [step() for _ in range(check_steps)]) for name, step in steps_of.items()}
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses["parc"], losses["torch"]))
    ours = trainer.gathered_state()
    theirs = dict(model.named_parameters())
    num = sum(float((ours[n] - p.detach()).double().pow(2).sum()) for n, p in theirs.items())
    den = sum(float(p.detach().double().pow(2).sum()) for p in theirs.values())
    param_rel = (num / den) ** 0.5
    times = interleave({"parc": parc_step, "torch": torch_step}, rounds, steps)
    return times, losses, loss_rel, param_rel, _profiles(steps_of) if profile else {}


def main() -> None:
    import argparse
    import sys

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--seq", type=int, default=2048)
    pre.add_argument("--check-steps", type=int, default=3)
    pre.add_argument("--profile", action="store_true", help="print rank 0's ops by self CPU time, one step each")
    known, rest = pre.parse_known_args()
    sys.argv = [sys.argv[0], *rest]
    args = pair_args(__doc__, steps=3, rounds=5)
    os.environ["PARC_BENCH_LONG"] = f"{known.seq},2"  # read by bench/gpt_long.py here and in the ranks
    from parc.runtime.launch import spawn

    compiled = compile_plan(PLAN, ROOT / "bench" / "gpt_long.py")
    times, losses, loss_rel, param_rel, profiles = spawn(2, _body, str(compiled), args.rounds, args.steps,
                                                         known.check_steps, known.profile)[0]
    for name, table in profiles.items():
        print(f"{name}, one step on rank 0:\n{table}")
    print(f"agreement over {known.check_steps} steps: losses parc {['%.6f' % x for x in losses['parc']]}, "
          f"torch {['%.6f' % x for x in losses['torch']]}; worst loss rel {loss_rel:.2e} (tolerance {LOSS_TOL}), "
          f"parameters rel L2 {param_rel:.2e} (tolerance {PARAM_TOL})")
    print(report(f"CP ring attention, bench/gpt_long.py T={known.seq}, cp 2 on 2 gloo ranks, micro 2", times,
                 "parc", "torch", 1.0))
    if loss_rel > LOSS_TOL or param_rel > PARAM_TOL:
        print("the two disagree: the timing compares different computations")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
