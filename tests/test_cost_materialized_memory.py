"""What a materialised attention keeps (`parc report --attention materialized|materialized-dropout`, issue 27: the
Megatron 2021 runs, BLOOM, MT-NLG): the softmax's T × T output in 16 bits, saved for the backward, and with dropout
on the probabilities its 1-byte mask and the 2-byte dropped probabilities: 2 and 5 bytes an element (Korthikanti et
al. 2023, arXiv:2205.05198 §4.1: "Softmax output with size 2as²b", "Only a mask with size as²b", "the dropout output
(2as²b)"). parc traces the flash kernel, which keeps none of them, so the report adds them; a recomputed attention's
only while its region runs again. Each difference derived by hand; analytic only (tracing on meta): seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
from parc import cli
from parc.analysis import report

ROOT = Path(__file__).resolve().parents[1]
SIZED = ROOT / "bench" / "gpt_sized.py"
TP_RULES = ('tensor_parallel {\n "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
            ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n "wte" : vocab\n "lm_head" : vocab\n}\n')
HEADS, T, MICRO, LAYERS = 8, 4096, 2, 2


def _memory(plan: Path, attention: str) -> dict:
    """The fullest rank's memory row of `parc report --attention <attention>` (bytes)."""
    args = cli.parser().parse_args(["report", "--model", str(SIZED), "--plan", str(plan), "--preset", "a100",
                                    "--attention", attention])
    return report.build_from_args(args)["memory"]["per_pp_rank"][0]


@pytest.fixture
def model(monkeypatch):
    monkeypatch.setenv("PARC_BENCH_GPT", f"{LAYERS},1024,{HEADS},50368,{T}")


def test_kept_probabilities_by_hand(tmp_path, model):
    """dp 8, no recompute, one micro-batch of 2 sequences in flight: every layer keeps 2 × 8 heads × 4096² elements,
    2 bytes each materialised, 5 with dropout, over the flash kernel's nothing."""
    plan = tmp_path / "p.par"
    plan.write_text(f"mesh dp=8\ntopology nodes=1 gpus_per_node=8\nbatch global=16 micro={MICRO}\nprecision bf16\n")
    flash, plain, dropout = (_memory(plan, a) for a in ("flash", "materialized", "materialized-dropout"))
    elements = LAYERS * MICRO * HEADS * T * T          # 268,435,456: 0.5 GiB at 2 bytes
    assert plain["activations_bytes"] - flash["activations_bytes"] == pytest.approx(2 * elements, abs=2)
    assert dropout["activations_bytes"] - flash["activations_bytes"] == pytest.approx(5 * elements, abs=2)
    assert dropout["total_bytes"] - flash["total_bytes"] == pytest.approx(5 * elements, abs=2)
    assert flash["inflight"] == 1


def test_recomputed_probabilities_only_while_recomputed_over_tp(tmp_path, model):
    """tp 2 (4 of the 8 heads a rank), every block recomputed: nothing more is kept between the forward and the
    backward; the recompute's peak grows by one layer's probabilities: 2 × 4 heads × 4096² × 5 bytes."""
    plan = tmp_path / "p.par"
    plan.write_text(f"mesh dp=4 tp=2\ntopology nodes=1 gpus_per_node=8\nbatch global=8 micro={MICRO}\n" + TP_RULES +
                    'recompute "blocks.*"\nprecision bf16\n')
    flash, dropout = _memory(plan, "flash"), _memory(plan, "materialized-dropout")
    one_layer = MICRO * HEADS // 2 * T * T * 5
    assert dropout["activations_kept_bytes"] == flash["activations_kept_bytes"]
    assert dropout["recompute_peak_bytes"] - flash["recompute_peak_bytes"] == pytest.approx(one_layer, abs=2)
