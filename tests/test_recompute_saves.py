"""`parc report --recompute-saves`: another framework's op-level checkpointing, priced from what it keeps.

torchtitan's "selective op" activation checkpointing wraps each block in a checkpoint whose policy saves the
outputs of `aten.mm` and of the flash attention, except every second mm of the block, and recomputes every
other op (torchtitan/parallelisms/parallelize_llama.py `_custom_policy`). parc prices it with
`--recompute-saves matmul-odd,attention` (parc/analysis/activations.py `saved_ops`). Held here to torch running
that policy: bench/llama_sized.py (the published bench's Llama) at a tiny size, each layer checkpointed with the
policy, the tensors one forward leaves alive measured by runtime/memory.py's probe, against the kept bytes
parc's statistics give; and the compute: the saved matmuls and the attention are not run again.
"""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from helpers import ROOT
from parc.analysis import cost, report
from parc.cli import parser
from parc.grammar.parser import parse
from parc.runtime.memory import ActivationProbe
from parc.trace import load_user_module, trace

LLAMA = ROOT / "bench" / "llama_sized.py"
SHAPE = "2,64,4,2,160,256,32"   # layers, dim, heads, kv heads, ffn, vocab, sequence
MICRO = 2
# torchtitan's save list, with the attention kernel SDPA dispatches to on a CPU (its list names the CUDA ones)
SAVE = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default}
# the probe counts what the forward leaves alive, tensor by tensor; parc counts the traced graph's values. What
# differs is small (measured 348,424 B against 349,504 predicted under the op policy: 0.3%); 2% tells the
# policy from full recompute (0.43 of it), from saving every matmul (1.38×) and from not saving the attention
# (0.90×)
TOL = 0.02


def _titan_policy():
    """torchtitan's `_custom_policy`: save mm and attention outputs, except every second mm; recompute the rest."""
    meta = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            meta[f"{mode}_mm_count"] += 1
        save = func in SAVE and not (func == torch.ops.aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


@pytest.fixture(scope="module")
def user():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PARC_BENCH_LLAMA", SHAPE)   # read when the model file is imported
        return load_user_module(LLAMA)


def _measured(user, policy: bool) -> int:
    """Bytes one forward (and the loss) leaves alive for the backward, every layer checkpointed (`policy`:
    torchtitan's op policy; else full recompute)."""
    torch.manual_seed(0)
    model = user.build_model()
    for layer in model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False,
                                          **({"context_fn": _titan_policy} if policy else {}))
    idx, targets = user.get_batch(0, MICRO)
    probe = ActivationProbe(list(model.parameters()))
    probe.ignore((idx, targets))
    with probe.tracking():
        loss = user.loss_fn(model, idx, targets)
    kept = probe.sample((loss,))
    loss.backward()   # the policy's recompute runs: the same values
    return kept


@functools.lru_cache(maxsize=None)
def _traced(user):
    return trace(user, MICRO)


def _stats(user, saves: tuple) -> dict:
    plan = parse(f'mesh dp=1\nbatch global={MICRO} micro={MICRO}\nrecompute "layers.*"\n')
    (stage,) = cost.graph_stats(_traced(user), plan, saves)["stages"]
    return stage


def test_kept_bytes_are_what_the_op_policy_keeps(user):
    measured = _measured(user, policy=True)
    stage = _stats(user, ("matmul-odd", "attention"))
    predicted = stage["kept_bytes_sharded"] + stage["kept_bytes_replicated"]
    assert abs(predicted / measured - 1) < TOL, (predicted, measured)
    # and the policy is not full recompute, which keeps much less: the test tells the two apart
    full = _measured(user, policy=False)
    full_stage = _stats(user, ())
    assert abs((full_stage["kept_bytes_sharded"] + full_stage["kept_bytes_replicated"]) / full - 1) < TOL
    assert measured > 1.3 * full


def test_saved_ops_are_not_recomputed(user):
    """wq, wv, w1, w2 (the 1st, 3rd, 5th, 7th mm of a block) and the attention: kept, not run again; wk, wo, w3
    and every memory-bound op of the block run again in the backward."""
    ops = _stats(user, ("matmul-odd", "attention"))["ops"]
    d, kv, ffn = 64, 2 * 16, 160
    recomputed = sorted((n, k) for b, m, n, k, split, rec, count in ops["mm"] if rec for _ in range(count))
    assert recomputed == sorted([(kv, d), (d, d), (ffn, d)] * 2)   # wk, wo, w3 in each of the 2 layers
    # an attention row: batch·heads, T, head size, causal, split, recomputed, then kv_repeat and the count
    assert ops["attn"] and all(not rec for bh, t, hs, causal, split, rec, *_ in ops["attn"])
    full = _stats(user, ())["ops"]
    assert full["attn"] and all(rec for bh, t, hs, causal, split, rec, *_ in full["attn"])
    # memory-bound ops of the blocks run again as under full recompute
    rec_mem = lambda table: sorted(tuple(r) for r in table["mem"] if r[3])   # noqa: E731
    assert rec_mem(ops) == rec_mem(full) and rec_mem(ops)


def test_report_flag_prices_the_policy(tmp_path, monkeypatch):
    """`parc report --recompute-saves` changes the statistics it prices: between full recompute and none."""
    monkeypatch.setenv("PARC_BENCH_LLAMA", SHAPE)
    par = tmp_path / "p.par"
    steps = {}
    for name, rec, flags in (("full", True, []), ("op", True, ["--recompute-saves", "matmul-odd,attention"]),
                             ("none", False, [])):
        par.write_text("mesh dp=1\nbatch global=2 micro=2\n" + ('recompute "layers.*"\n' if rec else ""))
        args = parser().parse_args(["report", "--model", str(LLAMA), "--plan", str(par), "--preset", "a100", *flags])
        rep = report.build_from_args(args)
        steps[name] = (rep["utilization"]["hardware_flops_per_step"], rep["memory"]["per_pp_rank"][0])
        if flags:
            assert any("recompute saves matmul-odd,attention" in n for n in rep["notes"])
    # without a `recompute` line the flag has nothing to act on, and the report says so
    args = parser().parse_args(["report", "--model", str(LLAMA), "--plan", str(par), "--preset", "a100",
                                "--recompute-saves", "attention"])
    assert any("recomputes nothing" in n for n in report.build_from_args(args)["notes"])
    assert steps["none"][0] < steps["op"][0] < steps["full"][0]
    kept = {k: v[1]["activations_kept_bytes"] for k, v in steps.items()}
    assert kept["full"] < kept["op"] < kept["none"]
