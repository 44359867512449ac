"""Keyed dropout (passes/dropout.py, runtime/dropout.py): every plan draws the serial model's masks.

The mask is a pure function of (seed, step, call site, global element index): unit tests check that
slicing by samples and sharding along any dim (with fused blocks) leave it unchanged, that other keys
give other masks, and that it keeps 1 − p of the elements. Then models with dropout 0.1 train under
dp, tp + sequence parallel, pp with recompute and ZeRO, and match the serial model as closely as the
same models without dropout do. A random op parc cannot key makes `--verify` refuse before training.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, compile_text, gpt_tp_rules, parallel_vs_serial
from parc.runtime import dropout as D

GPT = ROOT / "tests" / "models" / "gpt_dropout.py"  # examples/gpt.py, dropout 0.1: embedding, SDPA, residual
GPT2 = ROOT / "tests" / "models" / "gpt2_dropout.py"  # HF GPT-2, its default dropout 0.1: embd, attn (SDPA), resid
SITE = D.site_id("blocks.0.attn", 0)


def _mask(shape, full, per_sample, shard=(), sample0=0, seed=0, step=0, site=SITE, p=0.25):
    return D.keep_mask(shape, p, (seed, step, sample0), site, list(full), per_sample, list(shard), "cpu")


# --- the mask itself ---------------------------------------------------------------------

def test_mask_is_the_same_under_sample_slicing_and_sharding():
    full = [4, 6, 8]  # (B, T, H): 48 elements per sample
    whole = _mask(full, full, 48)
    # a dp rank / micro-batch holding samples 2..3 of the global batch: its own full shape is (2, 6, 8)
    assert torch.equal(_mask([2, 6, 8], [2, 6, 8], 48, sample0=2), whole[2:])
    for r in range(2):  # sequence parallel: tp rank r holds tokens [3r, 3r + 3)
        assert torch.equal(_mask([4, 3, 8], full, 48, [1, 2, r, 1]), whole[:, 3 * r:3 * r + 3])
    for r in range(2):  # a fused projection's output, 2 blocks of 4 features: rank r holds [2r, 2r+2) of each
        local = _mask([4, 6, 4], full, 48, [2, 2, r, 2])
        assert torch.equal(local, torch.cat([whole[..., 2 * r:2 * r + 2], whole[..., 4 + 2 * r:4 + 2 * r + 2]], -1))
    # samples flattened into dim 0, (B·T, H), then sharded along it: still the same elements
    assert torch.equal(_mask([12, 8], [24, 8], 48, [0, 2, 1, 1]), whole.reshape(24, 8)[12:])


def test_other_keys_draw_other_masks():
    full = [8, 64, 64]
    base = _mask(full, full, 4096)
    for other in (dict(seed=1), dict(step=1), dict(site=D.site_id("blocks.0.attn", 1)),
                  dict(site=D.site_id("blocks.1.attn", 0))):
        differ = (_mask(full, full, 4096, **other) != base).float().mean().item()
        # independent masks disagree on 2·p·(1 − p) = 0.375 of 32768 elements; σ = 0.0027, so ±0.02 is > 7σ
        assert abs(differ - 0.375) < 0.02, other


def test_keep_probability_is_one_minus_p():
    n = 1 << 20
    for p in (0.1, 0.5):
        kept = _mask([n], [n], n, p=p).float().mean().item()
        # binomial: σ = √(p(1 − p)/n) ≤ 5e-4; 3e-3 is 6σ at p 0.5. The 24-bit threshold is exact to 6e-8.
        assert abs(kept - (1 - p)) < 3e-3, (p, kept)


def test_mask_is_the_python_reference():
    """int64 products wrap like uint64's, shifts are logical and the unsigned compare is right, including
    for hashes with the sign bit set (about half) and indices past 2^32."""
    p, n, per_sample, sample0 = 0.3, 256, 2**40, 3
    got = _mask([n], [n], per_sample, sample0=sample0, seed=5, step=7, p=p).tolist()
    key = D.stream_key(5, 7, SITE)
    threshold = round((1 - p) * 2**24)
    want = [D.mix64(key + (sample0 * per_sample + i) * D._GOLDEN) >> 40 < threshold for i in range(n)]
    assert got == want


def test_op_backward_uses_the_forward_mask_and_forward_needs_a_key():
    x = torch.randn(4, 6, 8, requires_grad=True)
    with D.key_scope(0, 0, 0):
        y, saved = torch.ops.parc.keyed_dropout(x, 0.25, SITE, [4, 6, 8], 48, [])
    keep = _mask([4, 6, 8], [4, 6, 8], 48)
    assert torch.equal(saved, keep) and torch.equal(y, x * (keep.float() * (1 / 0.75)))
    y.backward(torch.ones_like(y))  # outside the key scope: backward reads the saved mask
    assert torch.equal(x.grad, keep.float() * (1 / 0.75))
    with pytest.raises(RuntimeError, match="no dropout key is set"):
        torch.ops.parc.keyed_dropout(x, 0.25, SITE, [4, 6, 8], 48, [])


@pytest.mark.parametrize("gqa,causal,float_mask", [(False, True, False), (True, False, True)])
def test_keyed_attention_is_sdpa(gqa, causal, float_mask):
    """At p 0 nothing is dropped: the written-out attention and its backward are SDPA's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, requires_grad=True)
    kv = 2 if gqa else 4
    k, v = (torch.randn(2, kv, 5, 8, generator=g, requires_grad=True) for _ in range(2))
    mask = torch.randn(5, 5, generator=g) if float_mask else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    with D.key_scope(0, 0, 0):
        out = torch.ops.parc.keyed_attention(q, k, v, mask, 0.0, causal, None, gqa, SITE, [2, 4, 5, 5], 100, [])
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    # fp32, the same math in another order than SDPA's CPU kernel: ~1e-7 relative; 1e-5 absolute on O(1) values
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


# --- parallel equals serial, dropout 0.1 ---------------------------------------------------

# fp32 with the same masks: what differs is only the summation order (micro-batch means, the dp and tp
# reductions), as in tests/test_tensor_parallel.py without dropout: losses ~1e-7, parameters ~1e-6
# model-wide (Adam magnifies near-zero gradients' rounding). Different masks (the bug this fixes) showed
# losses 3.8e-3 at dp 2; a wrong shard offset or a mask reused across micro-batches shows ≥ 1e-3.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4

CASES = {
    "gpt_tp2_sp": (GPT, "mesh tp=2\nbatch global=4 micro=2\n" + gpt_tp_rules(sequence_parallel=True)),
    "gpt_pp2_recompute": (GPT, "mesh pp=2\nbatch global=4 micro=1\npipeline schedule=1f1b\nrecompute \"blocks.*\"\n"),
    "gpt_dp2_zero2": (GPT, "mesh dp=2\nbatch global=4 micro=1\nzero stage=2\n"),
    "gpt2_dp2": (GPT2, "mesh dp=2\nbatch global=4 micro=1\n"),
    "gpt2_tp2": (GPT2, """mesh tp=2
batch global=4 micro=2
tensor_parallel {
    "transformer.h.*.attn.c_attn" : column
    "transformer.h.*.attn.c_proj" : row
    "transformer.h.*.mlp.c_fc"    : column
    "transformer.h.*.mlp.c_proj"  : row
}
"""),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dropout_matches_serial(case, tmp_path):
    model, plan = CASES[case]
    art = compile_text(plan, tmp_path / "c", model)
    sites = art.plan["dropout"]["sites"]
    assert sites and not art.plan["dropout"]["unkeyed"]
    assert {s["kind"] for s in sites} == {"dropout", "attention"}
    for name, src in art.programs.items():
        assert "aten.dropout" not in src and "scaled_dot_product_attention" not in src, name
    if case == "gpt_tp2_sp":  # the residual dropouts on sequence chunks, attention on local heads: rank 1's offsets
        src = art.programs["stage0_tp1"]
        assert src.count("[2, 32, 64], 2048, [1, 2, 1, 1])") == 1 + 2 * 4  # embedding + 2 per block, dim 1 = tokens
        assert src.count("[2, 4, 32, 32], 4096, [1, 2, 1, 1])") == 4  # (B, nh, T, T), dim 1 = heads
    verdict = parallel_vs_serial(tmp_path / "c", steps=3)
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # it trained


# --- what cannot be keyed is refused before training -------------------------------------

NOISY = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8)])  # parc's plan checks want at least one layer
        self.drop, self.off, self.noise = nn.Dropout(0.1), nn.Dropout(0.0), Noise()
    def forward(self, x):
        return self.noise(self.off(self.drop(self.layers[0](x))))

class Noise(nn.Module):
    def forward(self, x):
        return x * torch.bernoulli(torch.full_like(x, 0.9))

def build_model():
    return Net()

def get_batch(step, batch_size):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(step)),)

def loss_fn(model, x):
    return model(x).square().mean()
'''


def test_verify_refuses_an_unkeyed_random_op_before_training(tmp_path):
    model = tmp_path / "noisy.py"
    model.write_text(textwrap.dedent(NOISY))
    art = compile_text("mesh dp=1\nbatch global=2 micro=2\n", tmp_path / "c", model)
    assert [(s["module"], s["kind"]) for s in art.plan["dropout"]["sites"]] == [("drop", "dropout")]  # not p=0's
    assert [u["module"] for u in art.plan["dropout"]["unkeyed"]] == ["noise"]
    src = art.programs["stage0_tp0"]  # the p 0.1 dropout keyed; p 0 and bernoulli left as they were
    assert src.count("keyed_dropout.default(") == 1 and "aten.dropout.default(" in src and "bernoulli" in src
    r = subprocess.run([sys.executable, "-m", "parc.run", str(tmp_path / "c"), "--steps", "2", "--verify"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "`noise` (aten.bernoulli" in r.stderr and "turn these ops off" in r.stderr, r.stderr
    assert "step" not in r.stdout and "Traceback" not in r.stderr  # refused before training, one clear message
