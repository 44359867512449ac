"""The planner searches context parallelism (issue 27): cp candidates (`mesh … cp=N`, `context_parallel
ring|alltoall`) for a model with self-attention, priced as `parc report` prices them (parc/analysis/cp_cost.py).

A Llama 3 8B-shaped model at 128k tokens (tests/models/llama_long.py) on 64 H100s: without cp, the plans that fit
in 80 GiB all have tp and recompute, and they are slower than the cp winner; the written plan reads back with its
cp lines. Traced on meta once per search (~10 s CPU each).
"""

from __future__ import annotations

import pytest
from helpers import ROOT

from parc.analysis import planner
from parc.grammar.parser import parse

LONG = ROOT / "tests" / "models" / "llama_long.py"


@pytest.fixture(scope="module")
def every():
    """No candidate bounded out (top beyond them all): each plan that fits is estimated and ranked."""
    return planner.search(LONG, gpus=64, preset="h100", global_batch=32, top=10 ** 9)


def test_128k_tokens_on_64_h100s_pick_cp_over_the_plans_without_it(every):
    """Without cp, a plan fits only with tp (its logits and activations split over the tp group) and recompute,
    and the fastest of those is well behind the cp winner. (Until the loss's logits were priced as each tp rank's
    slice, no plan without cp fitted: the report held them whole on every tp rank.)"""
    assert every.winner.plan.mesh.cp > 1, every.winner.describe()
    ranked = [c for c in every.ranked if c.plan.mesh.cp == 1]
    assert ranked and all(c.plan.mesh.tp > 1 and c.plan.recompute.patterns for c in ranked)
    assert min(c.step for c in ranked) > 1.2 * every.winner.step
    plain = [c for c in every.dropped if c.plan.mesh.cp == 1 and c.plan.batch is not None]
    unfit = [c for c in plain if c.reason.startswith("does not fit")]
    assert any(c.plan.mesh.tp == 1 for c in unfit)
    assert any(c.plan.mesh.tp == 8 and c.plan.tensor_parallel.sequence_parallel and c.plan.recompute.patterns
               for c in unfit)
    # the search's top is beyond every plan: none was bounded out
    assert not any(c.reason.startswith("bounded out") for c in plain)


def test_cp_winner_is_the_same_at_top_1_and_reads_back(every):
    one = planner.search(LONG, gpus=64, preset="h100", global_batch=32, top=1)
    assert one.winner.plan == every.winner.plan and one.winner.step == every.winner.step
    text = planner.plan_text(one, "parc plan")
    plan = parse(text, "written.par")
    assert plan.mesh.cp == one.winner.plan.mesh.cp and plan.context_parallel == one.winner.plan.context_parallel


def test_no_attention_no_cp_candidates():
    """examples/gpt.py has attention over its block size: cp candidates; a model without SDPA gets none."""
    from types import SimpleNamespace as NS

    assert planner.attention_length(NS(gm=NS(graph=NS(nodes=[])))) is None


def test_cp_with_tp_is_searched_and_compiles(every):
    # cp × tp (tests/test_cp_tp.py) is in the search: priced, with and without sequence parallelism, and the
    # best such plan is one compile's passes accept; on this model and cluster it does not win (cp 16
    # all-to-all with ZeRO-3 needs no tp), but it fits
    from parc.trace import load_user_module, trace

    both = [c for c in every.ranked if c.plan.mesh.cp > 1 and c.plan.mesh.tp > 1]
    assert both and {c.plan.tensor_parallel.sequence_parallel for c in both} == {False, True}
    assert {c.plan.context_parallel.method for c in both} == {"ring", "alltoall"}
    assert planner._pass_refusal(trace(load_user_module(LONG), 1), both[0].plan) is None, both[0].describe()
    # all-to-all scatters a tp rank's heads over cp: 32 heads / tp 8 = 4 do not divide over cp 8
    assert any(c.plan.mesh.tp == 8 and c.plan.mesh.cp == 8 and "32 heads / tp 8 = 4 are not divisible by cp 8"
               in c.reason for c in every.dropped)


def test_cp_winner_passes_check_with_the_model(every, tmp_path, capsys):
    """`parc check --model` measures a cp plan's memory as the planner and `parc report` price it (each rank
    keeps T/cp tokens' activations: cp_cost.estimate_plan): the written winner is accepted. It was refused as
    not fitting (the whole sequence's activations a rank, cp times too many)."""
    from parc.cli import main

    par = tmp_path / "winner.par"
    par.write_text(planner.plan_text(every, "parc plan"))
    assert main(["check", str(par), "--model", str(LONG)]) == 0, capsys.readouterr().err
    assert "needs" not in capsys.readouterr().err
