"""Parallel equals serial for data parallelism, with gradient accumulation."""

import pytest

from helpers import ROOT, compile_text, parallel_vs_serial

LLAMA = ROOT / "tests" / "models" / "llama_tiny.py"

# fp32. The serial step takes one mean over the whole global batch; the parallel
# step averages micro-batch means and then dp ranks: the same sums in another
# order. Losses then agree to ~1e-7 relative. Parameters agree to ~2e-5 (model-
# wide relative L2) after three AdamW steps at lr 1e-2: Adam divides each
# gradient by its own magnitude, which magnifies the rounding of entries whose
# gradient is near zero (see parc/runtime/verify.py). A real error — a rank on
# the wrong slice, a lost micro-batch, a missing all-reduce — is 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_serial(tmp_path, dp):
    plan = f"""
mesh dp={dp}
batch global={2 * 2 * dp} micro=2      # accumulation 2
optimizer adamw lr=1e-2 clip=1.0
"""
    verdict = parallel_vs_serial(compile_text(plan, tmp_path / "compiled").root, steps=3)
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    # the run trained: losses moved
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]


def test_hf_llama_dp_matches_serial(tmp_path):
    # the HF class runs unmodified: traced on meta, executed as a parc program
    plan = "mesh dp=2\nbatch global=4 micro=1\noptimizer adamw lr=1e-2\n"
    verdict = parallel_vs_serial(compile_text(plan, tmp_path / "c", model=LLAMA).root, steps=3)
    assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()
