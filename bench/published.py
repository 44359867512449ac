"""Published large-scale training throughput against parc's cost model (issue 14, 4c).

    python bench/published.py               # print the table (markdown) for docs/cost-model.md
    python bench/published.py --rows 2      # only the first rows (each traces a model on meta: ~1 s)

Each row is a published run: the model's shape, the parallel plan it ran, its
cluster, and the throughput it reports (per-GPU teraFLOP/s as the source counts
them, recompute included). parc traces examples/gpt.py's GPT at that shape
(bench/gpt_sized.py), writes the plan as a .par, and predicts the step time with
`parc.analysis.cost.estimate` under the shipped preset of the GPU type; the
predicted throughput is the source's own FLOP count over that step time.

One preset per GPU type, no constant tuned per row. What a row states beyond the
source's table is its system's entry in `SYSTEMS` (ZeRO stage, wire dtype, NICs per
node) and the attention kernel the system ran (materialized: every row predates
FlashAttention), chosen from the source's description, never to fit the figure;
the comments above ROWS say which figures were verified where.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench" / "gpt_sized.py"
TP_RULES = ('tensor_parallel {\n "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
            ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n "wte" : vocab\n "lm_head" : vocab\n}\n')

# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
# SC21 (arXiv:2104.04473), Table 1: A100-80GB (Selene: 8 per node, 8 × 200 Gbit/s HDR), vocab 51200,
# sequence 2048, mixed precision, full activation recompute; TFLOP/s per GPU counts the recompute
# (their eq. 3: 96·B·s·l·h²·(1 + s/6h + V/16lh)).
MEGATRON = "Megatron-LM 2021 Table 1"
BLOOM = "BLOOM (BigScience 2022)"
MTNLG = "MT-NLG (Smith et al. 2022)"
# What each system ran beyond the plan: ZeRO stage, bytes per gradient element on the dp wire, NICs per node.
# Megatron 2021 all-reduced fp16 gradients after the backward (its DDP had no overlap then). BLOOM's
# Megatron-DeepSpeed ran DeepSpeed's bf16 optimizer ("ZERO_STAGE=0 # bf16 must use z0! it implements its own
# zero stage 1 equivalent", tr11-176B-ml.slurm): fp32 gradients all-reduced, a ZeRO-1 sharded step; Jean Zay
# has 4 × 100 Gbit/s Omni-Path links per node of 8 GPUs. MT-NLG: DeepSpeed's fp16 ZeRO-1 (assumed: the
# stage is not in the quoted section), fp16 gradients, Selene's 8 HDR NICs per node.
SYSTEMS = {MEGATRON: dict(zero=0, dp_bytes=2, nics=0, inter=0.0),
           BLOOM: dict(zero=1, dp_bytes=4, nics=4, inter=12.5e9),
           MTNLG: dict(zero=1, dp_bytes=2, nics=0, inter=0.0)}
ROWS = [
    # name, source, (layers, hidden, heads, vocab, seq), tp, pp, gpus, global batch, micro, published TFLOP/s, preset
    ("GPT 18.4B", MEGATRON, (40, 6144, 48, 51200, 2048), 8, 1, 256, 1024, 1, 135, "a100"),
    ("GPT 39.1B", MEGATRON, (48, 8192, 64, 51200, 2048), 8, 2, 512, 1536, 1, 138, "a100"),
    ("GPT 76.1B", MEGATRON, (60, 10240, 80, 51200, 2048), 8, 4, 1024, 1792, 1, 140, "a100"),
    ("GPT 145.6B", MEGATRON, (80, 12288, 96, 51200, 2048), 8, 8, 1536, 2304, 1, 148, "a100"),
    ("GPT 310.1B", MEGATRON, (96, 16384, 128, 51200, 2048), 8, 16, 1920, 2160, 1, 155, "a100"),
    # micro-batch 1: pp 35 × 280 and pp 64 × 512 schedule slots
    ("GPT 529.6B", MEGATRON, (105, 20480, 128, 51200, 2048), 8, 35, 2520, 2520, 1, 163, "a100"),
    ("GPT 1008B", MEGATRON, (128, 25600, 160, 51200, 2048), 8, 64, 3072, 3072, 1, 163, "a100"),
    # BigScience, BLOOM-176B (bigscience.notion.site "BigScience 176B Model"; Le Scao et al. 2022,
    # arXiv:2211.05100 §3.4): 384 A100-80GB on Jean Zay (48 nodes of 8, 4 × 100 Gbit/s Omni-Path per
    # node), tp 4 × pp 12 × dp 8, global batch 2048, bf16, ZeRO-1, "about 150 TFLOPs" per GPU.
    ("BLOOM 176B", BLOOM, (70, 14336, 112, 250880, 2048), 4, 12, 384, 2048, 2, 150, "a100"),
    # Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990) §2.4,
    # as quoted by llm-analysis (github.com/cli99/llm-analysis, examples/megatron-turing-nlg): 105 × 20480,
    # 128 heads, sequence 2048, global batch 1920, tp 8 × pp 35 on 280 / 350 / 420 DGX A100 (Selene),
    # 60.1 / 50.2 / 44.4 s per iteration = 126 / 121 / 113 TFLOP/s per GPU (eq. 3 over those times gives
    # 125.7 / 120.4 / 113.5: the same count). Vocab: GPT-2's 50257 padded as Megatron pads (51200).
    ("MT-NLG 530B", MTNLG, (105, 20480, 128, 51200, 2048), 8, 35, 2240, 1920, 1, 126, "a100"),
    ("MT-NLG 530B", MTNLG, (105, 20480, 128, 51200, 2048), 8, 35, 2800, 1920, 1, 121, "a100"),
    ("MT-NLG 530B", MTNLG, (105, 20480, 128, 51200, 2048), 8, 35, 3360, 1920, 1, 113, "a100"),
]


def megatron_flops(layers, hidden, vocab, seq, batch) -> float:
    """FLOPs per step as Megatron counts them (recompute included): eq. 3 of the paper."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def plan_text(tp, pp, gpus, batch, micro, zero) -> str:
    dp = gpus // (tp * pp)
    return (f"mesh dp={dp} pp={pp} tp={tp}\ntopology nodes={gpus // 8} gpus_per_node=8\n"
            f"batch global={batch} micro={micro}\n" + TP_RULES +
            ("pipeline schedule=1f1b stages=auto\n" if pp > 1 else "") +
            (f"zero stage={zero}\n" if zero else "") + 'recompute "blocks.*"\nprecision bf16\n')


def predict(row):
    from parc.analysis import cost
    from parc.analysis.report import _trace_stats
    from parc.grammar.parser import parse

    name, source, shape, tp, pp, gpus, batch, micro, published, preset = row
    layers, hidden, heads, vocab, seq = shape
    os.environ["PARC_BENCH_GPT"] = ",".join(map(str, shape))
    system = SYSTEMS[source]
    plan = parse(plan_text(tp, pp, gpus, batch, micro, system["zero"]), file=f"{name}.par")
    stats = _trace_stats(MODEL, plan)
    hw = cost.hardware(preset, plan.topology)
    if system["nics"]:
        hw = replace(hw, nics_per_node=system["nics"], inter_bw=system["inter"])
    # every row predates FlashAttention (Dao et al., May 2022): Megatron's attention (megatron/model/
    # transformer.py, in Megatron-LM and the Megatron-DeepSpeed fork BLOOM ran) is baddbmm, a fused
    # scale-mask-softmax over the whole T × T scores, and --attention-dropout (default 0.1) on them
    est = cost.estimate(plan, stats, hw, p2p_scatter_gather=True, dp_bytes=system["dp_bytes"], overlap_dp=False,
                        attention="materialized", attention_dropout=True)
    flops = megatron_flops(layers, hidden, vocab, seq, batch)
    return flops / est.step_seconds / gpus / 1e12, est


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=len(ROWS))
    p.add_argument("--skip", type=int, default=0, help="start at this row")
    a = p.parse_args()
    print("| run | source | GPUs | tp × pp × dp | published TFLOP/s per GPU | predicted | error | step s | "
          "bubble | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors = []
    for row in ROWS[a.skip:a.rows]:
        t0 = time.time()
        pred, est = predict(row)
        name, source, _, tp, pp, gpus, batch, micro, published, preset = row
        err = pred / published - 1
        errors.append(abs(err))
        fits = max(r["total"] for r in est.memory) <= est.hw.memory
        print(f"| {name} | {source} | {gpus} {preset.upper()} | {tp} × {pp} × {gpus // (tp * pp)} | {published} | "
              f"{pred:.0f} | {err:+.0%} | {est.step_seconds:.1f} | {est.bubble:.0%} | {'yes' if fits else 'NO'} |",
              flush=True)
        print(f"<!-- {name}: traced and estimated in {time.time() - t0:.0f} s -->", file=sys.stderr)
    print(f"\nmean absolute error {sum(errors) / len(errors):.0%}, worst {max(errors):.0%} over the {len(errors)} runs "
          f"priced with their published plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
