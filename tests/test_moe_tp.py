"""Expert parallelism composed with tensor parallelism trains exactly as the serial MoE model.

tests/test_moe.py's tiny MoE GPT under `mesh dp=2 ep=2 tp=2` (4 gloo ranks): the experts' fc/proj
are `column`/`row` as the dense MLP's are (Megatron-Core's expert tensor parallelism), attention too,
and the ep pass spreads the experts, now tp-sharded, over ep groups of ranks with the same tp
coordinate. Block 1's MoE is top-1 at capacity factor 0.5 (tokens dropped), block 3's top-2 at
2.0 (none dropped). Trained 2 steps against the serial model on the same batches and weights.
"""

from __future__ import annotations

import pytest
import torch

from helpers import ROOT
from parc import artifact
from parc.compiler import compile_model
from parc.errors import ParcError
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module
from test_moe import MICRO, MODEL, STEPS, _body, _dropped

PLAN = f'''mesh dp=2 ep=2 tp=2
batch global={2 * 2 * MICRO} micro={MICRO}
tensor_parallel {{
    "blocks.*.attn.qkv"            : column
    "blocks.*.attn.proj"           : row
    "blocks.*.mlp.fc"              : column
    "blocks.*.mlp.proj"            : row
    "blocks.*.moe.experts.*.fc"    : column
    "blocks.*.moe.experts.*.proj"  : row
}}
expert_parallel {{
    "blocks.*.moe.experts"
}}
optimizer adamw lr=1e-2
'''


def test_ep2_tp2_matches_serial(tmp_path):
    model = tmp_path / "moe_tp.py"
    model.write_text(MODEL.format(k1=1, cf1=0.5, k3=2, cf3=2.0, examples=str(ROOT / "examples")))
    out = tmp_path / "compiled"
    compile_model(model, parse(PLAN, str(tmp_path / "moe_tp.par")), out)
    art = artifact.load(out)
    # each tp rank's program: two all-to-alls per MoE layer, and an f/g pair inside each local expert, run
    # once on both sources' slots (2 local experts × 2 layers = 4) besides the dense ones (4 attn.proj + 2
    # mlp.proj = 6)
    for tp in (0, 1):
        program = art.programs[f"stage0_tp{tp}"]
        assert program.count("torch.ops.parc.alltoall_alltoall.default(") == 4
        assert program.count("allreduce_identity.default(") == program.count("identity_allreduce.default(") == 10
        assert "experts_2_" not in program and "experts_3_" not in program
    results = spawn(art.world_size, _body, str(out))
    user = load_user_module(art.root / "model" / "model.py")
    drops = _dropped(user, art.plan["plan"]["batch"]["global"])
    assert drops[0] > 0 and drops[1] == 0, drops
    serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
    assert set(results[0]["state"]) == set(serial_state)
    # fp32, compare()'s default tolerance as in test_moe: the experts see the serial model's (cap, C)
    # slots; what differs is summation order only: each expert linear's proj sums its hidden features
    # in two tp halves plus an all-reduce, and gradients are reduced over dp / edp
    verdict = compare(results[0]["losses"], serial_losses, results[0]["state"], serial_state)
    assert verdict.ok, verdict.render()
    assert all(r["a2a"] == results[0]["a2a"] > 0 for r in results)
    assert torch.is_tensor(next(iter(results[0]["state"].values())))


def test_ep_with_sequence_parallel_refused_at_the_block():
    """ep × tp is proven above without sequence parallelism only; with it, a located refusal."""
    from parc.analysis import support

    text = PLAN.replace('"blocks.*.moe.experts.*.proj"  : row\n', '"blocks.*.moe.experts.*.proj"  : row\n    sequence_parallel\n')
    with pytest.raises(ParcError) as info:
        support.check(parse(text, "t.par"))
    (d,) = info.value.diagnostics
    assert d.message.startswith("expert parallelism (mesh ep 2) with sequence_parallel") and d.span.line == 3
    support.check(parse(PLAN, "t.par"))  # and without it, accepted
