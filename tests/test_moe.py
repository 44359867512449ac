"""Expert parallelism (passes/expert_parallel.py) trains exactly as the serial MoE model.

examples/moe.py's MoE GPT, shrunk (n_embd 16, 8 tokens a sample, 4 experts in blocks 1 and 3),
is compiled under `mesh dp=… ep=2` and trained on spawned gloo ranks for 2 steps; the serial
reference runs the same model one forward per micro-batch (`PER_MICRO_BATCH`: capacity couples
a forward's tokens) on the same batches from the same weights. Three runs cover ep groups
inside dp 2 and dp 4, top-1 and top-2, and capacity below and above what the tokens need; each
checks that tokens were (or were not) dropped, so the capacity rule is exercised, and that the
bytes the all-to-alls sent are the analytic volume of docs/moe.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from parc import artifact
from parc.compiler import compile_model
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

MODEL = '''"""examples/moe.py, tiny: top_k {k}, capacity_factor {cf} (written by tests/test_moe.py)."""
import sys
from dataclasses import replace
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, {examples!r})
import moe  # noqa: E402

CONFIG = replace(moe.CONFIG, top_k={k}, capacity_factor={cf},
                 gpt=replace(moe.CONFIG.gpt, n_embd=16, n_head=2, block_size=8))
PER_MICRO_BATCH = True


def build_model():
    return moe.MoEGPT(CONFIG)


def get_batch(step, batch_size):
    idx, targets = moe.get_batch(step, batch_size)
    return idx[:, :8].contiguous(), targets[:, :8].contiguous()


def loss_fn(model, idx, targets):
    logits, aux = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + CONFIG.aux_weight * aux
'''

STEPS = 2
MICRO = 2
# (dp, top_k, capacity_factor, tokens dropped?): cf 0.5 leaves room for half the choices
RUNS = {"dp2_top1_drops": (2, 1, 0.5, True), "dp4_top2_drops": (4, 2, 0.5, True),
        "dp2_top2_no_drops": (2, 2, 2.0, False)}


def _body(ctx, compiled: str):
    from parc.runtime import expert_parallel, ops

    trainer = Trainer.load(compiled, 0)
    with expert_parallel.traffic() as sent, ops.record() as kinds:
        local = [trainer.step(s).loss for s in range(STEPS)]
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None, "sent": sum(b for _, b in sent),
            "a2a": sum(k == "all_to_all" for k, _, _ in kinds)}


def _dropped(user, global_batch: int) -> int:
    """Token choices the serial model drops at capacity in step 0 (all micro-batches, every MoE layer)."""
    from moe import capacity, route

    model = user.build_model()
    drops = []

    def count(layer, args, out):
        tokens = args[0].reshape(-1, args[0].shape[-1])
        probs = torch.softmax(layer.router(tokens), dim=-1)
        dispatch, _ = route(probs, layer.cfg.top_k, capacity(tokens.shape[0], layer.cfg))
        drops.append(tokens.shape[0] * layer.cfg.top_k - int(dispatch.sum()))

    hooks = [m.register_forward_hook(count) for n, m in model.named_modules() if n.endswith(".moe")]
    idx, targets = user.get_batch(0, global_batch)
    with torch.no_grad():
        for i in range(0, global_batch, MICRO):
            user.loss_fn(model, idx[i:i + MICRO], targets[i:i + MICRO])
    for h in hooks:
        h.remove()
    return sum(drops)


@pytest.mark.parametrize("run", list(RUNS))
def test_ep2_matches_serial(run, tmp_path):
    dp, k, cf, drops = RUNS[run]
    model = tmp_path / f"moe_{run}.py"
    model.write_text(MODEL.format(k=k, cf=cf, examples=str(ROOT / "examples")))
    text = (f'mesh dp={dp} ep=2\nbatch global={2 * dp * MICRO} micro={MICRO}\n'
            'expert_parallel {\n    "blocks.*.moe.experts"\n}\noptimizer adamw lr=1e-2\n')
    out = tmp_path / "compiled"
    compile_model(model, parse(text, str(tmp_path / "moe.par")), out)
    art = artifact.load(out)
    results = spawn(art.world_size, _body, str(out))
    user = load_user_module(art.root / "model" / "model.py")
    assert (_dropped(user, art.plan["plan"]["batch"]["global"]) > 0) == drops
    serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
    # fp32: the experts see the serial model's (cap, C) slots, so only the dp reduction's order differs
    verdict = compare(results[0]["losses"], serial_losses, results[0]["state"], serial_state)
    assert verdict.ok, verdict.render()

    # per rank, per MoE layer and micro-batch: 2 all-to-alls forward, 2 backward, each sending
    # (ep - 1) / ep of the (E, cap, C) fp32 slots to the other ep rank
    cfg, tokens = user.module.CONFIG, MICRO * 8
    cap = math.ceil(cf * k * tokens / cfg.num_experts)
    layers, accumulation = 2, art.plan["plan"]["batch"]["accumulation"]
    calls = STEPS * accumulation * layers * 4
    volume = calls * (cfg.num_experts * cap * cfg.gpt.n_embd * 4) // 2
    assert all(r["a2a"] == calls and r["sent"] == volume for r in results), (calls, volume, results[0]["sent"])
