"""HF GPT-2's transposed `Conv1D` (weight (in, out), `addmm(b, x, w)`) under tensor parallelism: column shards
the weight along dim 1 (the fused c_attn per q/k/v block), row along dim 0; tp=2 trains like serial."""

import torch

from helpers import ROOT, compile_text, parallel_vs_serial
from parc.runtime.checkpoint.state import shard, unshard

MODEL = ROOT / "tests" / "models" / "gpt2_tiny.py"
# lm_head is tied to transformer.wte (one placeholder, used by the embedding and the head); here both stay
# replicated (tests/test_tp_tied.py shards such a table with `vocab`).
PLAN = """
mesh tp=2
batch global=4 micro=2
optimizer adamw lr=1e-2 clip=1.0
tensor_parallel {
    "transformer.h.*.attn.c_attn" : column
    "transformer.h.*.attn.c_proj" : row
    "transformer.h.*.mlp.c_fc"    : column
    "transformer.h.*.mlp.c_proj"  : row
}
"""
# fp32, dropout 0; same tolerances and reasons as tests/test_tensor_parallel.py (row sums in another order,
# Adam magnifies the rounding of near-zero gradients). A wrong shard or a missing all-reduce is 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def test_gpt2_conv1d_tp2_matches_serial(tmp_path):
    art = compile_text(PLAN, tmp_path / "c", MODEL)
    src = (tmp_path / "c" / "programs" / "stage0_tp1.py").read_text()
    assert "aten.addmm" not in src and src.count("aten.linear.default(") == 9  # 4 per block + lm_head
    shards = {e["fqn"]: e["shard"] for e in art.plan["programs"]["stage0_tp1"]["state"]}
    h0 = "transformer.h.0."
    assert shards[h0 + "attn.c_attn.weight"] == {"dim": 1, "parts": 2, "index": 1, "blocks": 3}
    assert shards[h0 + "attn.c_attn.bias"] == {"dim": 0, "parts": 2, "index": 1, "blocks": 3}
    assert shards[h0 + "attn.c_proj.weight"] == {"dim": 0, "parts": 2, "index": 1}
    assert shards[h0 + "attn.c_proj.bias"] is None  # added once, after the all-reduce
    assert shards[h0 + "mlp.c_fc.weight"] == {"dim": 1, "parts": 2, "index": 1}
    assert shards[h0 + "mlp.c_proj.weight"] == {"dim": 0, "parts": 2, "index": 1}
    # rank r's c_attn columns are [q_r, k_r, v_r] of the user's (in, 3·hidden) tensor; unshard inverts it
    w = torch.arange(8 * 12.0).view(8, 12)
    spec = shards[h0 + "attn.c_attn.weight"]
    parts = [shard(w, dict(spec, index=r)) for r in range(2)]
    assert parts[1][:, :2].equal(w[:, 2:4]) and parts[1][:, 2:4].equal(w[:, 6:8])
    assert unshard(parts, spec).equal(w)

    verdict = parallel_vs_serial(tmp_path / "c", steps=3)
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained
