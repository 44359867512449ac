"""Expert parallelism (passes/expert_parallel.py) trains exactly as the serial MoE model.

examples/moe.py's MoE GPT, shrunk (n_embd 16, 8 tokens a sample, 4 experts in blocks 1 and 3,
2 per ep rank), is compiled under `mesh dp=… ep=2` and trained on spawned gloo ranks for 2 steps; the serial
reference runs the same model one forward per micro-batch (`PER_MICRO_BATCH`: capacity couples
a forward's tokens) on the same batches from the same weights. Three runs cover ep groups
inside dp 2 and dp 4; in each, one MoE layer is top-1 and the other top-2, one with capacity
below what its tokens need and one above (checked: tokens are, and are not, dropped), so that
the two runs cover top-1 and top-2 each with and without drops. Each also checks that the bytes
the all-to-alls sent are the analytic volume of docs/moe.md.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import ROOT, compile_text
from parc import viz
from parc.analysis import report
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

MODEL = '''"""examples/moe.py, tiny; block 1's MoE top-{k1} at capacity factor {cf1}, block 3's top-{k3} at {cf3}
(written by tests/test_moe.py)."""
import sys
from dataclasses import replace
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, {examples!r})
import moe  # noqa: E402

CONFIG = replace(moe.CONFIG, gpt=replace(moe.CONFIG.gpt, n_embd=16, n_head=2, block_size=8))
PER_MICRO_BATCH = True


def build_model():
    model = moe.MoEGPT(CONFIG)
    model.blocks[1].moe.cfg = replace(CONFIG, top_k={k1}, capacity_factor={cf1})
    model.blocks[3].moe.cfg = replace(CONFIG, top_k={k3}, capacity_factor={cf3})
    return model


def get_batch(step, batch_size):
    idx, targets = moe.get_batch(step, batch_size)
    return idx[:, :8].contiguous(), targets[:, :8].contiguous()


def loss_fn(model, idx, targets):
    logits, aux = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + CONFIG.aux_weight * aux
'''

# An expert whose traced graph holds a view with its row count (the (cap, 2, 4C/2) grouping), which
# the pass cannot prove row-wise: it runs once per source rank (passes/expert_parallel.py `_per_source`)
PER_SOURCE = '''

class Grouped(moe.Expert):
    def forward(self, x):
        h = self.fc(x)
        return self.proj(F.gelu(h.view(h.shape[0], 2, -1)).flatten(1))


_build = build_model


def build_model():
    model = _build()
    for m in model.modules():
        if type(m) is moe.Expert:
            m.__class__ = Grouped
    return model
'''

STEPS = 2
MICRO = 2
# dp → the (top_k, capacity_factor) of blocks 1 and 3: cf 0.5 leaves slots for half the choices (tokens
# are dropped), cf E / k = 4 / k gives each expert as many slots as there are tokens (none can be); the
# two runs cover top-1 and top-2 each with and without drops
RUNS = {2: ((1, 0.5), (2, 2.0)), 4: ((2, 0.5), (1, 4.0))}


def _body(ctx, compiled: str):
    from parc.runtime.parallel import expert_parallel, ops

    trainer = Trainer.load(compiled, 0)
    with expert_parallel.traffic() as sent, ops.record() as kinds:
        local = [trainer.step(s).loss for s in range(STEPS)]
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None, "sent": sum(b for _, b in sent),
            "a2a": sum(k == "all_to_all" for k, _, _ in kinds)}


def _dropped(user, global_batch: int) -> list[int]:
    """Token choices the serial model drops at capacity in step 0, per MoE layer (over all micro-batches)."""
    from moe import capacity, route

    model = user.build_model()
    drops = {}

    def count(layer, args, out):
        tokens = args[0].reshape(-1, args[0].shape[-1])
        probs = torch.softmax(layer.router(tokens), dim=-1)
        dispatch, _ = route(probs, layer.cfg.top_k, capacity(tokens.shape[0], layer.cfg))
        drops[layer] = drops.get(layer, 0) + tokens.shape[0] * layer.cfg.top_k - int(dispatch.sum())

    layers = [m for n, m in model.named_modules() if n.endswith(".moe")]
    hooks = [m.register_forward_hook(count) for m in layers]
    idx, targets = user.get_batch(0, global_batch)
    with torch.no_grad():
        for i in range(0, global_batch, MICRO):
            user.loss_fn(model, idx[i:i + MICRO], targets[i:i + MICRO])
    for h in hooks:
        h.remove()
    return [drops[m] for m in layers]


@pytest.mark.parametrize("dp, mode, expert", [(dp, "none", "row-wise") for dp in RUNS]
                         + [(2, "aot_eager", "row-wise"), (2, "none", "per-source")])
def test_ep2_matches_serial(dp, mode, expert, tmp_path):
    """`mode`: the plan's `compile` (aot_eager: the all-to-all and its backward captured, runtime/compiled.py).
    `expert`: examples/moe.py's expert, which the pass runs once on every source's slots (batched), or
    PER_SOURCE's, which it runs once per source."""
    (k1, cf1), (k3, cf3) = RUNS[dp]
    model = tmp_path / f"moe_dp{dp}.py"
    model.write_text(MODEL.format(k1=k1, cf1=cf1, k3=k3, cf3=cf3, examples=str(ROOT / "examples"))
                     + (PER_SOURCE if expert == "per-source" else ""))
    text = (f'mesh dp={dp} ep=2\nbatch global={2 * dp * MICRO} micro={MICRO}\n'
            'expert_parallel {\n    "blocks.*.moe.experts"\n}\noptimizer adamw lr=1e-2\n'
            + (f"compile {mode}\n" if mode != "none" else ""))
    out = tmp_path / "compiled"
    art = compile_text(text, out, model)
    # the rewrite, visible in the one program all ranks run: two all-to-alls per MoE layer, and only the
    # slots of experts 0 and 1 (each rank's two experts) hold weights
    program = art.programs["stage0_tp0"]
    assert program.count("torch.ops.parc.alltoall_alltoall.default(") == 4
    assert "experts_1_fc_weight" in program and "experts_2_" not in program and "experts_3_" not in program
    assert "ep slot: ep 0: blocks.1.moe.experts.1.fc.weight, ep 1: blocks.1.moe.experts.3.fc.weight" in program
    # each local expert's region: once per MoE layer batched (2 experts × 2 layers), or once per source
    assert program.count("aten.gelu.default(") - 2 == (8 if expert == "per-source" else 4)  # 2: the dense MLPs
    results = spawn(art.world_size, _body, str(out))
    user = load_user_module(art.root / "model" / "model.py")
    drops = _dropped(user, art.plan["plan"]["batch"]["global"])
    assert drops[0] > 0 and drops[1] == 0, drops  # block 1 drops tokens, block 3 keeps them all
    serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
    # fp32: every token's row meets the serial model's arithmetic; only the order of fp32 sums differs (the
    # dp reduction, and a batched expert's weight gradient summing its sources' rows in one matmul)
    verdict = compare(results[0]["losses"], serial_losses, results[0]["state"], serial_state)
    assert verdict.ok, verdict.render()

    # per rank, per MoE layer and micro-batch: 2 all-to-alls forward, 2 backward, each sending
    # (ep - 1) / ep of the (E, cap, C) fp32 slots to the other ep rank
    cfg, tokens, ep = user.module.CONFIG, MICRO * 8, 2
    caps = [math.ceil(cf * k * tokens / cfg.num_experts) for k, cf in RUNS[dp]]
    micro_batches = STEPS * art.plan["plan"]["batch"]["accumulation"]
    volume = micro_batches * 4 * sum(cfg.num_experts * cap * cfg.gpt.n_embd * 4 for cap in caps) * (ep - 1) // ep
    calls = micro_batches * 4 * len(caps)
    assert all(r["a2a"] == calls and r["sent"] == volume for r in results), (calls, volume, results[0]["sent"])
    (row,) = [r for r in report.build(out)["communication"]["rows"] if r["axis"] == "ep"]
    assert (row["collective"], row["bytes_per_rank"], row["inter_bytes"]) == ("all-to-all", volume // STEPS, 0)  # per step, one node
    # the same figure analytically, from --model --plan (the pass's matcher on the traced graph, nothing
    # compiled): the same row, its time on the step, and memory holding each rank's 1/ep of the experts
    (tmp_path / "moe.par").write_text(text)
    rep = report.build(model=model, plan=tmp_path / "moe.par")
    (analytic,) = [r for r in rep["communication"]["rows"] if r["axis"] == "ep"]
    assert analytic == row, (analytic, row)
    compiled_rep = report.build(out)
    assert rep["memory"]["per_pp_rank"][0]["params_count"] == compiled_rep["memory"]["per_pp_rank"][0]["params_count"]
    assert rep["experts"] == compiled_rep["experts"]
    assert rep["communication"]["exposed_seconds"] >= row["seconds"]
    dot = viz.mesh_graph(art.plan).source  # parc viz: each ep group's ranks joined by an "ep" edge
    assert dot.count("label=ep") == dp // ep and "tp 0 ep 1" in dot
