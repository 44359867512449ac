"""Expert parallelism composed with pipeline parallelism trains exactly as the serial MoE model.

tests/test_moe.py's tiny MoE GPT (4 blocks, MoE in blocks 1 and 3: one MoE layer per pipeline stage)
under `mesh dp=2 ep=2 pp=2` on 4 gloo ranks, 1F1B and GPipe, 2 steps of 4 micro-batches, against the
serial model run one forward per micro-batch (`PER_MICRO_BATCH`) on the same batches from the same
weights. Block 1 is top-1 below capacity (tokens dropped), block 3 top-2 above it. Each ep group
holds the two dp ranks of one stage (parc/mesh.py expert_groups), so both run that stage's schedule
in the same order and their all-to-alls pair up; each stage's expert gradients are reduced over its
edp group (runtime/parallel/pipeline.py StageBuckets). Also checks every rank issued one stage's all-to-alls.
"""

from __future__ import annotations

import pytest

from helpers import ROOT
from parc import artifact
from parc.compiler import compile_model
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module
from test_moe import MICRO, MODEL, STEPS, _body, _dropped

ACCUMULATION = 4  # ≥ pp, so 1F1B has a steady phase interleaving forwards and backwards


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_ep2_pp2_matches_serial(schedule, tmp_path):
    model = tmp_path / "moe_pp.py"
    model.write_text(MODEL.format(k1=1, cf1=0.5, k3=2, cf3=2.0, examples=str(ROOT / "examples")))
    text = (f'mesh dp=2 ep=2 pp=2\nbatch global={ACCUMULATION * 2 * MICRO} micro={MICRO}\n'
            f'pipeline schedule={schedule}\n'
            'expert_parallel {\n    "blocks.*.moe.experts"\n}\noptimizer adamw lr=1e-2\n')
    out = tmp_path / "compiled"
    compile_model(model, parse(text, str(tmp_path / "moe.par")), out)
    art = artifact.load(out)
    for stage, block in ((0, 1), (1, 3)):  # each stage rewrites its own MoE layer only
        program = art.programs[f"stage{stage}_tp0"]
        assert program.count("torch.ops.parc.alltoall_alltoall.default(") == 2, stage
        assert f"ep 1: blocks.{block}.moe.experts.3.fc.weight" in program
        assert f"blocks.{4 - block}.moe" not in program
    results = spawn(art.world_size, _body, str(out))
    user = load_user_module(art.root / "model" / "model.py")
    drops = _dropped(user, art.plan["plan"]["batch"]["global"])
    assert drops[0] > 0 and drops[1] == 0, drops  # block 1 drops tokens, block 3 keeps them all
    serial_losses, serial_state = train_serial(user, art.plan, 0, STEPS)
    # fp32 tolerance of compare (as tests/test_moe.py): the experts see the serial model's (cap, C)
    # slots, so only the order of the dp sums and of the micro-batch accumulation differs
    verdict = compare(results[0]["losses"], serial_losses, results[0]["state"], serial_state)
    assert verdict.ok, verdict.render()
    # per rank: its stage's one MoE layer, 2 all-to-alls forward and 2 backward per micro-batch
    assert all(r["a2a"] == STEPS * ACCUMULATION * 4 for r in results), [r["a2a"] for r in results]


def test_unproven_schedules_refused_at_their_token():
    from parc.analysis import support
    from parc.errors import ParcError

    for line in ("pipeline schedule=zb_h1", "pipeline schedule=interleaved_1f1b virtual=2"):
        text = f'mesh dp=2 ep=2 pp=2\n{line}\nexpert_parallel {{ "blocks.*.moe.experts" }}\n'
        with pytest.raises(ParcError) as info:
            support.check(parse(text, "t.par"))
        (d,) = info.value.diagnostics
        assert d.message.startswith("expert parallelism (mesh ep 2) with pipeline schedule=") and d.span.line == 2, d
    support.check(parse('mesh dp=2 ep=2 pp=2\npipeline schedule=gpipe\nexpert_parallel { "blocks.*.moe.experts" }\n'))
