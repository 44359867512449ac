"""A parameter two pipeline stages hold (a tied embedding and lm head) costs one all-reduce of its gradient over
those pp ranks a step (runtime/parallel/pipeline.py `sync_tied`; DeepSpeed's `_exec_reduce_tied_grads`): the
statistics list the tie, and the estimate adds the all-reduce to the step, derived here by hand."""

from pathlib import Path

import pytest
from parc.analysis import cost, report

ROOT = Path(__file__).resolve().parents[1]
PLAN = """mesh dp=1 pp=2
topology nodes=1 gpus_per_node=2 preset=a100
batch global=4 micro=1
pipeline schedule=1f1b stages=2
precision bf16
"""


def test_a_tied_embedding_adds_one_all_reduce_of_its_gradient_over_its_stages(tmp_path, monkeypatch):
    # bench/gpt_sized.py's GPT, 2 layers of 256, vocabulary 1000, tied: wte is used by stage 0 (the embedding)
    # and by stage 1 (the logits). Its gradient, 1000 × 256 fp32 (bf16's gradient layout: 4 bytes), is summed over
    # the two pp ranks on one node: a ring all-reduce of n = 2 moves 2 (n − 1)/n of it at NVLink's bandwidth, and
    # walks 2 (n − 1) steps at NVLink's latency
    monkeypatch.setenv("PARC_BENCH_GPT", "2,256,4,1000,64,tied")
    path = tmp_path / "t.par"
    path.write_text(PLAN)
    plan, stats, _, _ = report._inputs(None, ROOT / "bench" / "gpt_sized.py", path)
    assert stats["tied"] == [{"stages": [0, 1], "elements": 1000 * 256, "sharded": False}]
    hw = cost.hardware("a100", plan.topology)
    est = cost.estimate(plan, stats, hw)
    untied = cost.estimate(plan, {k: v for k, v in stats.items() if k != "tied"}, hw)
    row, = [c for c in est.comms if c.axis == "pp" and c.collective == "all-reduce"]
    by_hand = 1000 * 256 * 4 / hw.intra_bw + 2 * hw.latency_intra
    assert row.bytes == pytest.approx(1000 * 256 * 4)
    assert row.seconds == pytest.approx(by_hand)
    assert est.step_seconds - untied.step_seconds == pytest.approx(by_hand)
    assert est.p2p_exposed_seconds - untied.p2p_exposed_seconds == pytest.approx(by_hand)
    assert any("tied parameters" in n for n in est.notes)
