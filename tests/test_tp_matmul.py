"""Linear layers written as matmuls (`x @ w.t() + b`, `addmm`) shard like nn.Linear under tp;
a rule whose module's parameter meets an op parc cannot shard is a compile error, never a no-op."""

import pytest

from helpers import ROOT, compile_text, parallel_vs_serial
from parc.errors import ParcError

MODEL = ROOT / "tests" / "models" / "matmul_linears.py"
PLAN = """
mesh tp=2
batch global=4 micro=4
tensor_parallel {
    "blocks.*.fc"   : column
    "blocks.*.proj" : row
    %s
}
"""


def test_matmul_and_addmm_linears_match_serial(tmp_path):
    art = compile_text(PLAN % "", tmp_path / "c", MODEL)
    src = (tmp_path / "c" / "programs" / "stage0_tp1.py").read_text()
    assert "aten.matmul" not in src and "aten.addmm" not in src and src.count("aten.linear.default(") == 5
    assert art.plan["programs"]["stage0_tp1"]["state"][1]["shard"] == {"dim": 0, "parts": 2, "index": 1}
    verdict = parallel_vs_serial(tmp_path / "c", steps=3)
    # fp32; same tolerances and reasons as tests/test_tensor_parallel.py (row sums in another order)
    assert verdict.loss_rel < 1e-5 and verdict.param_rel < 1e-4, verdict


def test_rule_on_a_parameter_parc_cannot_shard_is_an_error(tmp_path):
    with pytest.raises(ParcError, match=r"`column` on module `norm`: its parameter `p_model_norm_g` is used by `mul`"):
        compile_text(PLAN % '"norm" : column', tmp_path / "c", MODEL)
