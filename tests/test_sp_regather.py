"""Sequence parallelism keeps each column layer's input slice and gathers it again in backward
(runtime/parallel/sequence_regather.py), as Megatron-LM does, instead of keeping the gathered copy.

- The same bits: a run that re-gathers and one that keeps the gathered copies (`trainer.regather = None`,
  the runtime before this) give equal losses and parameters, exactly, in fp32 and in bf16 (where the saved
  copies are autocast's casts), with accumulation, under pipelines (1F1B, interleaved, and zero-bubble, whose
  input-gradient pass and later weight-gradient pass both unpack) and under ZeRO-3 (whose own saved-tensor
  claims share runtime/saved.py's hooks). That both train as the serial model does is
  tests/test_tensor_parallel.py's and the other sequence-parallel tests', which run this path.
- Less kept: the memory probe measures the forward's activations lower by the gathered copies, and each
  gathered input is all-gathered once more per micro-batch, in the backward, no more (q, k and v share one
  copy).
- A slice modified in place after the forward stops the backward with an error rather than a wrong gradient.
- The backward's first unpack of a gather starts the gather it needs next, once (`_Gather.prefetch`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from helpers import ROOT, compile_text, gpt_tp_rules, llama_tp_rules
from parc.runtime.launch import spawn
from parc.runtime.memory import ActivationProbe
from parc.runtime.parallel import ops
from parc.runtime.parallel.sequence_regather import _Gather
from parc.runtime.train import Trainer

STEPS = 2
LLAMA = ROOT / "tests" / "models" / "llama_tiny.py"
GPT_SP = "batch global=8 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n" + gpt_tp_rules(True)
PLANS = {
    "fp32": ("mesh tp=2\n" + GPT_SP, None),
    "bf16": ("mesh tp=2\nprecision bf16\n" + GPT_SP, None),
    "llama_bf16": ("mesh tp=2\nprecision bf16\nbatch global=4 micro=2\noptimizer adamw lr=1e-2\n"
                   + llama_tp_rules(True), LLAMA),
    "pp_1f1b": ("mesh tp=2 pp=2\npipeline schedule=1f1b\n" + GPT_SP, None),
    # zero-bubble: the input gradients first (the graph retained), the weight gradients later, each unpacking
    "pp_zb_h1_bf16": ("mesh tp=2 pp=2\nprecision bf16\npipeline schedule=zb_h1\n" + GPT_SP, None),
    "pp_interleaved": ("mesh tp=2 pp=2\npipeline schedule=interleaved_1f1b virtual=2\n" + GPT_SP, None),
    "zero3": ("mesh dp=2 tp=2\nzero stage=3\n" + GPT_SP, None),
}


def _runs(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        for regather in (True, False):
            trainer = Trainer.load(root, 0)
            assert trainer.regather is not None  # eager with tp: on by default
            if not regather:
                trainer.regather = None
            trainer.step(0)  # every buffer exists: the probe then sees activations only
            trainer.probe = ActivationProbe(trainer.state)
            with ops.record() as log:
                losses = [trainer.step(s).loss for s in range(1, STEPS + 1)]
            out[name, regather] = {"losses": trainer.global_losses(losses), "state": trainer.gathered_state(),
                                   "kept": trainer.probe.peak, "calls": Counter(log)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sp_regather")
    by_world: dict[int, dict[str, str]] = {}
    for name, (text, model) in PLANS.items():
        art = compile_text(text, tmp / name, **({"model": model} if model else {}))
        mesh = art.plan["plan"]["mesh"]
        by_world.setdefault(mesh["dp"] * mesh["tp"] * mesh["pp"], {})[name] = str(art.root)
    out = {}
    for world, roots in by_world.items():
        out.update(spawn(world, _runs, roots)[0])
    return out


@pytest.mark.parametrize("name", PLANS)
def test_the_same_bits_as_keeping_the_gathered_copy(runs, name):
    mine, kept = runs[name, True], runs[name, False]
    assert mine["losses"] == kept["losses"]
    assert mine["state"].keys() == kept["state"].keys()
    for k, v in kept["state"].items():
        assert torch.equal(mine["state"][k], v), k


@pytest.mark.parametrize("name", PLANS)
def test_less_kept_and_one_gather_more_per_input(runs, name):
    mine, kept = runs[name, True], runs[name, False]
    print(f"\n{name}: activations {kept['kept']} B keeping the gathered copies, {mine['kept']} B re-gathering")
    assert mine["kept"] < kept["kept"]
    more = mine["calls"] - kept["calls"]
    # only all-gathers in backward, over tp: as many as the forward's (every gathered input, once each)
    assert set(more) == {("all_gather", "tp", "bwd")} and not kept["calls"] - mine["calls"], more
    assert more[("all_gather", "tp", "bwd")] == mine["calls"][("all_gather", "tp", "fwd")]


def test_a_slice_changed_in_place_is_an_error():
    shard = torch.ones(2, 3)
    g = _Gather(shard, lambda s: lambda: torch.cat([s, s], 1), (2, 6), None)
    shard.add_(1)  # after the forward: the backward would gather another value
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        g.whole(None)


def test_the_first_unpack_starts_the_next_claimed_gather():
    """Backward meets the forward's gathers last first: a gather's first unpack starts the nearest earlier one
    whose saves were replaced (claimed), skipping one that was not (a recomputed region's), once."""
    started = []

    def gather(name):
        def start(shard):
            started.append(name)
            return lambda: torch.cat([shard, shard], 1)
        return start

    shard = torch.ones(2, 3)
    first = _Gather(shard, gather("first"), (2, 6), None)
    skipped = _Gather(shard, gather("skipped"), (2, 6), first)
    last = _Gather(shard, gather("last"), (2, 6), skipped)
    first.claimed = last.claimed = True
    last.whole(None)
    assert started == ["last", "first"]          # its own, then the next one backward needs
    assert torch.equal(first.whole(torch.bfloat16), torch.cat([shard, shard], 1).to(torch.bfloat16))
    assert started == ["last", "first"]          # the started gather is the one used: no second
    last.whole(None)
    assert started == ["last", "first"]
