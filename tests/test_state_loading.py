"""Starting state: one rank per host builds the model and sends the others their shards (runtime/checkpoint/state.py).

Each rank's tensors must equal, bit for bit, its shards of the model built under
the seed, and the model must be built once per host, not once per rank.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import compile_text, gpt_tp_rules
from parc import artifact
from parc.runtime.context import ParallelContext
from parc.runtime.launch import spawn
from parc.runtime.checkpoint.state import build_reference, host_ranks, load_state, materialize
from parc.trace import load_user_module

# dp 2 × tp 2: the two tp ranks hold different shards, the two dp ranks the same ones
PLAN = "mesh dp=2 tp=2\nbatch global=8 micro=2\n" + gpt_tp_rules()


def _body(ctx, compiled: str):
    art = artifact.load(Path(compiled))
    pctx = ParallelContext.create(art.plan)
    user = load_user_module(art.root / "model" / "model.py")
    builds = []
    counting = SimpleNamespace(build_model=lambda: builds.append(1) or user.build_model())
    entries = lambda r: art.plan["programs"][art.plan["ranks"][r]["program"]]["state"]  # noqa: E731
    state = load_state(entries, ctx.rank, pctx.world_size, counting, 0, pctx.device)
    return {"builds": len(builds), "state": [t.detach() for t in state],
            "grad": [t.requires_grad for t in state]}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return compile_text(PLAN, tmp_path_factory.mktemp("state") / "c").root


@pytest.mark.parametrize("per_host", [4, 2])
def test_each_rank_gets_its_shards_from_one_builder_per_host(compiled, per_host):
    results = spawn(4, _body, str(compiled), env={"LOCAL_WORLD_SIZE": str(per_host)})
    assert [r["builds"] for r in results] == [1 if r % per_host == 0 else 0 for r in range(4)]
    art = artifact.load(compiled)
    user = load_user_module(art.root / "model" / "model.py")
    model = build_reference(user, 0)
    for rank, got in enumerate(results):
        entries = art.plan["programs"][art.plan["ranks"][rank]["program"]]["state"]
        want = materialize(entries, model, torch.device("cpu"))
        assert len(got["state"]) == len(want)
        for e, g, w in zip(entries, got["state"], want):
            assert torch.equal(g, w), (rank, e["fqn"])
        assert got["grad"] == [w.requires_grad for w in want]


def test_host_ranks_follow_torchrun_numbering(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_ranks(11, 16) == list(range(8, 16))
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert host_ranks(3, 4) == [0, 1, 2, 3]  # unset: one host
