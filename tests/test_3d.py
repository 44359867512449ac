"""Hybrid 3D parallelism end to end: dp × pp × tp with sequence parallelism and ZeRO, on 8 CPU ranks.

One spawned 8-rank world trains four compiled plans, one after another (a world
costs more to start than a case to run):
  - examples/3d.par on examples/gpt.py (dp2 pp2 tp2, SP, ZeRO-1, 1F1B, clip 1.0);
  - the tiny HF Llama under the same shape (2 layers: one per stage);
  - the tied-embedding GPT under dp2 pp2 tp2, ZeRO-2 — tied gradients through ZeRO shards
    (embedding and head left tp-replicated here, the case with no rule on a tied weight; the tied
    vocab-parallel shard and SP with any head are tests/test_tp_tied.py and test_tp_sp_heads.py);
  - the GPT under dp2 pp2 tp2, SP, without ZeRO (bucketed dp all-reduce per stage).
Each must match the serial model (`parc.runtime.verify`), and the global grad norm
each rank clips by must be the serial model's (`parc.runtime.parallel.grad_norm`), with
clipping active (the norm is above `clip`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import GPT, ROOT, compile_text, gpt_tp_rules, llama_tp_rules
from parc import artifact
from parc.analysis import support
from parc.compiler import compile_model
from parc.errors import PlanError
from parc.grammar.parser import load_plan, parse
from parc.runtime.launch import spawn
from parc.runtime.checkpoint.state import build_reference
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

MODELS = Path(__file__).parent / "models"
STEPS = 3
# fp32, same tolerance as every other equivalence test (runtime/verify.py DEFAULT_TOLERANCE explains it)
TOL = 1e-4
# the norm is one float64 sum of the same squared fp32 gradients, cut differently: only the
# gradients' own rounding (different summation order of micro-batches and shards) differs
NORM_TOL = 1e-5

LLAMA_3D = """
mesh dp=2 pp=2 tp=2
batch global=8 micro=2
""" + llama_tp_rules(sequence_parallel=True) + """pipeline schedule=1f1b
zero stage=1
optimizer adamw lr=1e-2 clip=0.5
"""

TIED_ZERO2 = """
mesh dp=2 pp=2 tp=2
batch global=8 micro=2
tensor_parallel {
    "blocks.*.attn.qkv"  : column
    "blocks.*.attn.proj" : row
    "blocks.*.mlp.fc"    : column
    "blocks.*.mlp.proj"  : row
}
pipeline schedule=1f1b
zero stage=2
optimizer adamw lr=1e-2 clip=0.5
"""


# no ZeRO: the bucketed dp all-reduce per stage, SP partials and the norm summed over tp and pp
GPT_NO_ZERO = """
mesh dp=2 pp=2 tp=2
batch global=8 micro=2
""" + gpt_tp_rules(sequence_parallel=True) + """pipeline schedule=1f1b
optimizer adamw lr=1e-2 clip=0.5
"""


def _cases_body(ctx, roots: list[str]):
    out = []
    for root in roots:
        trainer = Trainer.load(root, 0)
        results = [trainer.step(s) for s in range(STEPS)]
        losses = trainer.global_losses([r.loss for r in results])
        state = trainer.gathered_state()
        out.append({"losses": losses, "norms": [float(r.grad_norm) for r in results],
                    "state": state if ctx.rank == 0 else None})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("3d")
    plan = load_plan(ROOT / "examples" / "3d.par")
    compile_model(GPT, plan, tmp / "gpt3d")
    roots = {"gpt3d": tmp / "gpt3d",
             "llama": compile_text(LLAMA_3D, tmp / "llama", model=MODELS / "llama_tiny.py").root,
             "tied_zero2": compile_text(TIED_ZERO2, tmp / "tied", model=MODELS / "gpt_tied.py").root,
             "no_zero": compile_text(GPT_NO_ZERO, tmp / "no_zero").root}
    results = spawn(8, _cases_body, [str(r) for r in roots.values()])
    return {name: (root, results[0][i], [r[i]["norms"] for r in results]) for i, (name, root) in enumerate(roots.items())}


def _serial_norm(root: Path) -> float:
    """The serial model's gradient norm on step 0's global batch."""
    art = artifact.load(root)
    user = load_user_module(art.root / "model" / "model.py")
    model = build_reference(user, 0)
    user.loss_fn(model, *user.get_batch(0, art.plan["plan"]["batch"]["global"])).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


CASES = ["gpt3d", "llama", "tied_zero2", "no_zero"]


@pytest.mark.parametrize("case", CASES)
def test_matches_serial(runs, case):
    root, got, _ = runs[case]
    art = artifact.load(root)
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    verdict = compare(got["losses"], serial_losses, got["state"], serial_state, TOL)
    assert verdict.ok, verdict.render()


@pytest.mark.parametrize("case", CASES)
def test_global_grad_norm_is_serial_and_clips(runs, case):
    root, _, norms = runs[case]
    clip = artifact.load(root).plan["plan"]["optimizer"]["grad_clip"]
    serial = _serial_norm(root)
    assert serial > clip  # clipping is active in this test, so a wrong norm would move the weights
    for rank, rank_norms in enumerate(norms):  # every rank of every axis clips by the same norm
        assert abs(rank_norms[0] - serial) / serial < NORM_TOL, (rank, rank_norms[0], serial)


def test_ranks_follow_the_stated_order(runs):
    """examples/3d.par says order=tp,pp,dp: tp innermost, dp outermost."""
    ranks = artifact.load(runs["gpt3d"][0]).plan["ranks"]
    assert [(r["dp"], r["pp"], r["tp"]) for r in ranks] == [(d, p, t) for d in (0, 1) for p in (0, 1) for t in (0, 1)]


@pytest.mark.parametrize("text,needle", [
    ("mesh dp=2 pp=2\nbatch global=8 micro=2\nzero stage=3\n", "zero stage=3 with pp 2 > 1 is not supported"),
    ("mesh dp=2 pp=2\nbatch global=8 micro=2\npipeline schedule=interleaved_1f1b virtual=2\nzero stage=1\n",
     "virtual stages (2 per pp rank)"),
    ('mesh dp=2\nbatch global=8 micro=2\nzero stage=3\nrecompute "blocks.*"\n', "recompute with zero stage=3"),
])
def test_unsupported_combinations_are_refused(text, needle):
    with pytest.raises(PlanError) as e:
        support.check(parse(text, file="t.par"))
    assert needle in e.value.render()

