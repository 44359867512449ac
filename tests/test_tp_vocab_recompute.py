"""A vocab-parallel embedding followed directly by a recomputed layer (bench/llama_sized.py: torchtitan's Llama,
whose first layer's RMSNorm reads the embedding's output first). passes/tensor_parallel.py masks the ids out of
the rank's rows and zeroes their rows after the lookup; those two nodes are inserted before the embedding's
next node and once took that node's module, the first layer, so the all-reduce of the embedding (its own
module) sat between two pieces of layers.0 and compile refused `recompute "layers.*"` under tp ("layers.0 is
not one region"). `parc plan` then could not recompute any tp plan of such a model: on a Llama 3 405B shape it
proposed tp 64 across 8 nodes (issue 27). Now they keep the embedding's module; the plan compiles and trains
as the serial model does."""

from __future__ import annotations

import pytest
from helpers import ROOT, compile_text, parallel_vs_serial

LLAMA = ROOT / "bench" / "llama_sized.py"
SHAPE = "2,64,4,2,128,256,16"   # layers, dim, heads, kv heads, ffn, vocab, sequence
RULES = "".join(f' "{p}" : {s}\n' for p, s in (
    ("layers.*.attention.wq", "column"), ("layers.*.attention.wk", "column"), ("layers.*.attention.wv", "column"),
    ("layers.*.attention.wo", "row"), ("layers.*.feed_forward.w1", "column"), ("layers.*.feed_forward.w3", "column"),
    ("layers.*.feed_forward.w2", "row"), ("tok_embeddings", "vocab"), ("output", "vocab")))
# one reduction over 2 ranks in fp32 (tp's all-reduces), as tests/test_recompute.py's tolerances
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


@pytest.mark.parametrize("sp", [False, True])
def test_llama_tp_with_recomputed_layers_trains_like_serial(sp, tmp_path, monkeypatch):
    monkeypatch.setenv("PARC_BENCH_LLAMA", SHAPE)   # read by the model file in every rank
    text = ("mesh tp=2\nbatch global=4 micro=2\ntensor_parallel {\n" + RULES + (" sequence_parallel\n" if sp else "")
            + '}\nrecompute "layers.*"\nprecision fp32\noptimizer adamw lr=1e-3\n')
    art = compile_text(text, tmp_path / "c", LLAMA)
    assert all("torch.utils.checkpoint.checkpoint(" in p for p in art.programs.values())
    verdict = parallel_vs_serial(art.root, steps=2)
    assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()
