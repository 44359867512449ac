"""parc on one rank is eager PyTorch, bit for bit: what makes bench/single_device.py's ratio a fair one.

The plan bench/single_device.py times (dp 1, micro 8, fp32, `compile none`) and the eager loop it
times against (the model built under the same seed, `get_batch(i, 8)`, `loss_fn`, backward, the
plan's AdamW, `zero_grad(set_to_none=True)`) must compute the same losses and parameters exactly:
the generated program runs the model's own aten ops, and at dp 1 the trainer hands autograd's
gradients to the optimizer as eager does (runtime/parallel/data_parallel.py), so there is no tolerance to
explain. A difference here means parc computes something eager does not, or eager something parc
does not, and the benchmark compares two different computations.
"""

from __future__ import annotations

import torch

from helpers import GPT, compile_text
from parc.runtime.launch import spawn

PLAN = "mesh dp=1\nbatch global=8 micro=8\nprecision fp32\ncompile none\n"
STEPS = 3


def _body(ctx, compiled: str):
    from parc.runtime.checkpoint.state import build_reference
    from parc.runtime.train import Trainer, make_optimizer

    trainer = Trainer.load(compiled, 0)
    parc_losses = [trainer.step(i).loss.item() for i in range(STEPS)]
    user = trainer.user
    model = build_reference(user, 0)
    opt = make_optimizer(list(model.parameters()), trainer.art.plan["plan"]["optimizer"])
    eager_losses = []
    for i in range(STEPS):  # bench/single_device.py eager_step, fp32
        loss = user.loss_fn(model, *user.get_batch(i, 8))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager_losses.append(loss.item())
    theirs = dict(model.named_parameters())
    mismatched = [fqn for fqn, t in trainer.gathered_state().items() if not torch.equal(t, theirs[fqn].detach())]
    return {"parc": parc_losses, "eager": eager_losses, "mismatched": mismatched, "n": len(theirs)}


def test_one_rank_trains_bit_for_bit_as_eager(tmp_path):
    compiled = str(compile_text(PLAN, tmp_path / "compiled").root)
    out = spawn(1, _body, compiled)[0]
    assert out["parc"] == out["eager"]
    assert out["parc"][0] != out["parc"][-1]  # it trained
    assert out["mismatched"] == [], f"{len(out['mismatched'])} of {out['n']} parameters differ"
