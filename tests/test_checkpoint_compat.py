"""A checkpoint written by an older parc resumes under today's (issue 25: "a checkpoint saved before this
change ... resumes"). tests/golden/ckpt_v0/step_2 was written by parc at 4727e8d under dp 2, bf16 ZeRO-1
(its README says how), when every rank kept whole fp32 masters; today bf16 ZeRO-1/2 shard them, ZeRO-3 and
HSDP cut other ranges, and the checkpoint gained entries. Resumed under the plan it was saved under, today's
parc trains the next two steps to the very losses that parc printed (continued.json); resumed under ZeRO-3 or
one rank, the state it loads is bitwise the saved state, and saving it again writes the same tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import compile_text
from parc import artifact
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer

GOLDEN = Path(__file__).parent / "golden" / "ckpt_v0"
MODEL = Path(__file__).parent / "models" / "gpt_ckpt_tiny.py"
SAVED_UNDER = (GOLDEN / "plan.par").read_text()
PLANS = {
    "saved_under": SAVED_UNDER,
    "zero3": SAVED_UNDER.replace("zero stage=1", "zero stage=3"),
    "one_rank": SAVED_UNDER.replace("mesh dp=2", "mesh dp=1").replace("zero stage=1\n", ""),
}


def _body(ctx, compiled: str, out: str):
    trainer = Trainer.load(compiled, 0)
    first = checkpoint.load(trainer, str(GOLDEN / "step_2"))
    checkpoint.save(trainer, out, first)
    losses = [trainer.global_losses([trainer.step(s).loss])[0] for s in (first, first + 1)]
    return {"first": first, "losses": losses} if ctx.rank == 0 else None


def _state(path: Path) -> dict:
    """The model and optimizer tensors of a checkpoint: RNG entries are per rank, so they follow the mesh."""
    return {k: v for k, v in checkpoint.read(path).items() if k.startswith(("model.", "optim."))}


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_checkpoint_of_an_older_parc_resumes(tmp_path, plan):
    compile_text(PLANS[plan], tmp_path / "c", MODEL)
    out = tmp_path / "ck"
    r = spawn(artifact.load(tmp_path / "c").world_size, _body, str(tmp_path / "c"), str(out))[0]
    assert r["first"] == 2
    saved, again = _state(GOLDEN / "step_2"), _state(checkpoint.resolve(out))
    assert sorted(saved) == sorted(again)
    assert [k for k in saved if not saved[k].equal(again[k])] == []
    then = json.loads((GOLDEN / "continued.json").read_text())["losses"]
    if plan == "saved_under":  # the same plan and ranks: the same arithmetic, so the same losses, bitwise
        assert r["losses"] == [then["2"], then["3"]]
    else:  # another reduction order (ZeRO-3's reduce-scatter, one rank's whole sum) in bf16: rounding only
        assert all(abs(a - b) < 1e-3 * abs(b) for a, b in zip(r["losses"], [then["2"], then["3"]])), r["losses"]
