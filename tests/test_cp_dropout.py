"""Context parallelism × keyed dropout (issue 28): a token's mask is the serial model's, keyed by its global
position (runtime/dropout.py's LOAD_BALANCED record: this cp rank's chunks r and 2·cp−1−r), so a cp plan with
dropout trains like the serial model; attention dropout stays refused."""

import pytest
import torch

from helpers import ROOT, compile_text, gpt_tp_rules, parallel_vs_serial
from parc.errors import ParcError
from parc.runtime import dropout as D
from parc.runtime.parallel.ring_attention import local_positions

MODEL = ROOT / "tests" / "models" / "cp_dropout.py"  # gpt, dropout 0.1 on embedding and residuals, none in SDPA
SITE = D.site_id("blocks.0.mlp", 0)


def _mask(shape, full, shard=()):
    return D.keep_mask(shape, 0.25, (0, 3, 0), SITE, list(full), 48 * 4, list(shard), "cpu")


def test_mask_of_each_token_is_the_serial_one():
    full = [2, 16, 8]  # (B, T, C)
    whole = _mask(full, full)
    for cp in (2, 4):
        for r in range(cp):  # rank r's tokens, in its local (load-balanced) order
            pos = local_positions(16, r, cp)
            got = _mask([2, 16 // cp, 8], full, [1, cp, r, D.LOAD_BALANCED])
            assert torch.equal(got, whole[:, pos]), (cp, r)
            # sequence parallelism cuts rank r's tokens again over tp 2: tp rank t holds half t of them
            for t in range(2):
                half = 16 // cp // 2
                got = _mask([2, half, 8], full, [1, cp, r, D.LOAD_BALANCED, 1, 2, t, 1])
                assert torch.equal(got, whole[:, pos[t * half:(t + 1) * half]]), (cp, r, t)
            # tp 2 over the features (dim 2) beside cp over the sequence
            got = _mask([2, 16 // cp, 4], full, [1, cp, r, D.LOAD_BALANCED, 2, 2, 1, 1])
            assert torch.equal(got, whole[:, pos, 4:]), (cp, r)


# fp32 as tests/test_cp_compositions.py (1e-5 / 1e-4, its reasons): the masks are the serial ones, so dropout
# changes nothing in how the numbers are added. A token keyed by its local index instead of its global one
# drops other elements: losses then differ by ~1e-2 from the first step.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


@pytest.mark.parametrize("mesh,method,rules", [("dp=2 cp=2", "ring", ""),
                                               ("cp=2 tp=2", "ring", gpt_tp_rules(sequence_parallel=True))])
def test_dropout_matches_serial(tmp_path, mesh, method, rules):
    text = (f"mesh {mesh}\nbatch global=4 micro=2\ncontext_parallel {method}\n"
            f"optimizer adamw lr=1e-2 clip=1.0\n{rules}")
    art = compile_text(text, tmp_path / "c", model=MODEL)
    assert len(art.plan["dropout"]["sites"]) == 9  # the embedding's, and each of 4 blocks' two residual branches
    verdict = parallel_vs_serial(art.root, steps=3)
    print(mesh, verdict.render())
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]


def test_attention_dropout_refused(tmp_path):
    text = "mesh cp=2\nbatch global=4 micro=2\ncontext_parallel ring\n"
    with pytest.raises(ParcError) as e:
        compile_text(text, tmp_path / "c", model=ROOT / "tests" / "models" / "gpt_dropout.py")
    d = next(d for d in e.value.diagnostics if "attention dropout" in d.message)
    assert d.span.file.endswith("gpt.py") and "scaled_dot_product_attention" in \
        (ROOT / "examples" / "gpt.py").read_text().splitlines()[d.span.line - 1]
