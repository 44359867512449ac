"""Dropout under tensor parallelism: replicated regions draw the same mask on every tp rank,
sharded regions (attention on local heads) draw a different mask per tp rank
(runtime/ops.py "dropout streams", passes/tensor_parallel.py `own_stream`)."""

import math

import torch
import torch.distributed as dist

from helpers import ROOT, compile_text
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer

DROPOUT_GPT = ROOT / "tests" / "models" / "gpt_dropout.py"  # examples/gpt.py with dropout 0.1
PLAN = """
mesh tp=2
batch global=2 micro=2
tensor_parallel {
    "blocks.*.attn.qkv"  : column
    "blocks.*.attn.proj" : row
    "blocks.*.mlp.fc"    : column
    "blocks.*.mlp.proj"  : row
}
"""


def _masks_body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 3)
    ones = torch.ones(4096)
    replicated = torch.ops.aten.dropout.default(ones, 0.5, True)  # as a replicated-region line of a program
    x = torch.ops.parc.tp_rng_enter.default(ones, "tp")  # as a sharded-region dropout is bracketed
    sharded = torch.ops.parc.tp_rng_exit.default(torch.ops.aten.dropout.default(x, 0.5, True), "tp")
    after = torch.ops.aten.dropout.default(ones, 0.5, True)  # the replicated stream is still in step
    masks = torch.stack([replicated, sharded, after]) != 0
    gathered = [torch.empty_like(masks) for _ in range(2)]
    dist.all_gather(gathered, masks, group=trainer.ctx.groups["tp"])
    losses = trainer.global_losses([trainer.step(s).loss for s in range(2)])
    return {"masks": gathered, "losses": losses}


def test_dropout_streams_under_tp(tmp_path):
    compile_text(PLAN, tmp_path / "c", DROPOUT_GPT)
    src = (tmp_path / "c" / "programs" / "stage0_tp0.py").read_text()
    # attention (local heads) dropout is bracketed; the residual dropouts (replicated) are not
    lines = src.splitlines()
    sdpa = [i for i, ln in enumerate(lines) if "scaled_dot_product_attention.default(" in ln]
    assert sdpa and all("tp_rng_enter" in lines[i - 1] and "tp_rng_exit" in lines[i + 1] for i in sdpa)
    assert src.count("torch.ops.parc.tp_rng_enter") == len(sdpa)
    assert src.count("aten.dropout.default(") > 0

    r0, r1 = (r for r in spawn(2, _masks_body, str(tmp_path / "c")))
    m0, m1 = r0["masks"]
    assert torch.equal(m0, r1["masks"][0]) and torch.equal(m1, r1["masks"][1])  # both ranks saw the same gather
    assert torch.equal(m0[0], m1[0]), "replicated-region dropout masks differ across tp ranks"
    assert not torch.equal(m0[1], m1[1]), "sharded-region dropout masks are equal across tp ranks"
    assert not torch.equal(m0[0], m0[1])  # the tp stream is not the replicated stream
    assert torch.equal(m0[2], m1[2]), "the replicated stream fell out of step after a sharded region"
    assert 0.4 < m0[1].float().mean().item() < 0.6  # still dropout at p 0.5
    assert len(r0["losses"]) == 2 and all(math.isfinite(v) for v in r0["losses"])
