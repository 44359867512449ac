"""parc expert parallelism vs a hand-written PyTorch expert-parallel MoE layer, 2 gloo ranks, same run.

Both train examples/moe.py (ep 2 inside dp 2: each rank holds 2 of each MoE layer's 4 experts)
from the same weights on the same micro-batches with the same AdamW. parc runs its compiled
program (passes/expert_parallel.py); the peer is the eager model with each MoE layer's expert
loop replaced by the usual hand-written layer: torch.distributed.nn's autograd all_to_all_single
out and back, each local expert run once on the slots of every source (ep × cap rows), then the
dense gradients all-reduced over dp and the expert gradients divided by dp (edp is 1 here).
Run: python bench/ep_vs_torch.py [--rounds 5] [--steps 4]
Target: parc/torch ≤ 1.0.
"""

from __future__ import annotations

from common import ROOT, compile_plan, interleave, pair_args, report

PLAN = """
mesh dp=2 ep=2
batch global=16 micro=4      # accumulation 2
expert_parallel {
    "blocks.*.moe.experts"
}
optimizer adamw lr=3e-4
"""


def _ep_forward(layer, ep: int, rank: int):
    """A hand-written expert-parallel forward for `layer` (examples/moe.py's MoE), keeping experts
    rank·L … rank·L+L-1; the others are dropped from the module."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.distributed.nn.functional import all_to_all_single

    # deprecated in torch 2.13, and still the autograd-aware all-to-all a hand-written layer reaches for
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*all_to_all_single is deprecated")

    from moe import balance_loss, capacity, route

    E = layer.cfg.num_experts
    L = E // ep
    layer.local = torch.nn.ModuleList(layer.experts[rank * L + j] for j in range(L))
    del layer.experts

    def forward(x):
        B, T, C = x.shape
        tokens = x.reshape(B * T, C)
        probs = F.softmax(layer.router(tokens), dim=-1)
        cap = capacity(B * T, layer.cfg)
        dispatch, combine = route(probs, layer.cfg.top_k, cap)
        expert_in = torch.einsum("nec,nd->ecd", dispatch, tokens)  # (E, cap, C)
        got = all_to_all_single(torch.empty_like(expert_in), expert_in.contiguous())  # (ep·L, cap, C)
        got = got.view(ep, L, cap, C)
        outs = [layer.local[j](got[:, j].reshape(ep * cap, C)).view(ep, cap, C) for j in range(L)]
        back = torch.stack(outs, dim=1).reshape(E, cap, C)
        expert_out = all_to_all_single(torch.empty_like(back), back.contiguous())
        y = torch.einsum("nec,ecd->nd", combine, expert_out)
        return y.reshape(B, T, C), balance_loss(probs, layer.cfg.top_k)

    layer.forward = forward


def _body(ctx, compiled: str, rounds: int, steps: int):
    import torch
    import torch.distributed as dist

    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    trainer = Trainer.load(compiled, 0)
    user = trainer.user
    model = build_reference(user, 0)
    for name, mod in model.named_modules():
        if name.endswith(".moe"):
            _ep_forward(mod, 2, ctx.rank)
    experts = {id(p) for n, p in model.named_parameters() if ".local." in n}
    opt = make_optimizer(list(model.parameters()), trainer.art.plan["plan"]["optimizer"])
    dp = dist.get_world_size()
    counter = {"parc": 0, "torch": 0}

    def parc_step():
        trainer.step(counter["parc"])
        counter["parc"] += 1

    def torch_step():
        mbs = trainer.local_batches(counter["torch"])
        for mb in mbs:
            (user.loss_fn(model, *mb) / len(mbs)).backward()
        dense = [p.grad for p in model.parameters() if id(p) not in experts]
        flat = torch.cat([g.reshape(-1) for g in dense]).div_(dp)
        dist.all_reduce(flat)  # dense gradients: averaged over dp, one flat all-reduce
        offset = 0
        for g in dense:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        for p in model.parameters():
            if id(p) in experts:
                p.grad.div_(dp)  # edp is one rank: the all-to-all already summed the ep group
        opt.step()
        opt.zero_grad(set_to_none=False)
        counter["torch"] += 1

    return interleave({"parc": parc_step, "torch": torch_step}, rounds, steps)


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    compiled = compile_plan(PLAN, ROOT / "examples" / "moe.py")
    times = spawn(2, _body, str(compiled), args.rounds, args.steps)[0]
    print(report("EP, examples/moe.py, dp 2 × ep 2 on 2 gloo ranks, micro 4 × accumulation 2", times, "parc",
                 "torch", 1.0))


if __name__ == "__main__":
    main()
