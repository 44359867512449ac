"""The GPT-3-sized model (175B parameters, 96 layers) compiles with tp=8 on the meta device.

No weights exist anywhere: tracing and every pass run on meta tensors. The
check is structural — eight programs, each holding exactly 1/8 of every
tensor-parallel weight — not a timing (the benchmark bench/compile_gpt3.py
reports the time).
"""

import math
import time

from helpers import ROOT, compile_text, gpt_tp_rules

GPT3 = ROOT / "bench" / "gpt3.py"
PLAN = "mesh tp=8\nbatch global=1 micro=1\n" + gpt_tp_rules(sequence_parallel=True)


def test_gpt3_compiles_with_tp8_on_meta(tmp_path):
    t0 = time.perf_counter()
    art = compile_text(PLAN, tmp_path / "c", model=GPT3)
    print(f"\nGPT-3 tp=8 compile: {time.perf_counter() - t0:.1f}s")
    assert art.plan["model"]["param_count"] > 174e9 and art.plan["model"]["num_layers"] == 96
    programs = art.plan["programs"]
    assert sorted(programs) == [f"stage0_tp{t}" for t in range(8)]
    for name, prog in programs.items():
        for e in prog["state"]:
            if e["shard"] is not None:
                full = [d * (e["shard"]["parts"] if i == e["shard"]["dim"] else 1) for i, d in enumerate(e["shape"])]
                assert e["shard"]["parts"] == 8 and math.prod(full) == 8 * math.prod(e["shape"]), e
        sharded = {e["fqn"] for e in prog["state"] if e["shard"] is not None}
        assert "blocks.95.mlp.fc.weight" in sharded and "wte.weight" in sharded and "lm_head.weight" in sharded
        assert "torch.ops.parc.vocab_parallel_cross_entropy" in art.programs[name]
