"""Context parallelism (mesh cp, passes/context_parallel.py, runtime/parallel/ring_attention.py): ring
attention equals SDPA, cp plans train like the serial model, and what cp cannot run is refused, located."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, compile_text, parallel_vs_serial
from parc.errors import ParcError
from parc.runtime.launch import spawn

# fp32, dropout 0. Ring attention sums each row's softmax in cp·2 pieces merged by their log-sum-exps,
# and the loss is a sum over cp of per-rank sums: the same numbers added in another order, which moves
# losses by ~1e-7 relative (measured 1.7e-7 on dp 2 × cp 2). Parameters after three AdamW steps at lr
# 1e-2 agree to ~1e-6 model-wide (Adam divides each gradient by its own magnitude, magnifying the rounding
# of near-zero ones; runtime/verify.py). A wrong chunk order, mask or missing reduction is 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4
# one attention in fp32: the same products, summed blockwise: ~1e-7 of the values' scale
ATTN_TOL = 1e-5

UNFUSED = ROOT / "tests" / "models" / "cp_unfused.py"
POSBIAS = ROOT / "tests" / "models" / "cp_posbias.py"
MODELS = ROOT / "tests" / "models"


def _ring_body(ctx, causal: bool, shape: tuple, method: str = "ring", fused: bool = True):
    """Each rank: ring attention on its load-balanced chunks of one (q, k, v), forward and backward,
    against F.scaled_dot_product_attention on the whole sequence (computed on every rank). `fused`: its
    blocks as torch's CPU flash kernel (False: written out, the path off CPU)."""
    import torch.distributed as dist

    from parc.runtime.parallel import ops, ring_attention
    import parc.runtime.parallel.ulysses  # noqa: F401 — registers torch.ops.parc.ulysses_attention
    from parc.runtime.parallel.ring_attention import local_positions

    ring_attention.FUSED_ON_CPU = fused

    ops.bind_groups(SimpleNamespace(groups={"cp": dist.group.WORLD}))
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(shape, generator=g) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=causal)
    (ref * w).sum().backward()
    pos = local_positions(shape[-2], ctx.rank, ctx.world_size)
    local = [t[..., pos, :].clone().requires_grad_() for t in (q, k, v)]
    if method == "ring":
        out, _ = torch.ops.parc.ring_attention(*local, "cp", causal, shape[-1] ** -0.5, ctx.world_size)
    else:
        out = torch.ops.parc.ulysses_attention(*local, "cp", causal, shape[-1] ** -0.5, ctx.world_size)
    (out * w[..., pos, :]).sum().backward()
    # contiguous, as the ops' fakes say (a compiled graph plans its views from them; inductor checks the strides).
    # Ulysses at cp 4 with 4 heads has one head a rank, where its reshape once returned a strided view
    assert out.is_contiguous() and all(t.grad.is_contiguous() for t in local), \
        (out.stride(), [t.grad.stride() for t in local])
    scale = ref.abs().max().item()
    diffs = {"out": (out - ref[..., pos, :]).abs().max().item() / scale}
    for name, mine, whole in zip("qkv", local, full):
        diffs["d" + name] = (mine.grad - whole.grad[..., pos, :]).abs().max().item() / whole.grad.abs().max().item()
    return diffs


@pytest.mark.parametrize("cp,causal,fused", [(2, True, True), (4, True, True), (2, False, True), (2, True, False),
                                             (2, False, False)])
def test_ring_attention_equals_sdpa(cp, causal, fused):
    for rank, diffs in enumerate(spawn(cp, _ring_body, causal, (2, 3, 8 * cp, 4), "ring", fused)):
        assert max(diffs.values()) < ATTN_TOL, (rank, diffs)


@pytest.mark.parametrize("cp,causal", [(2, True), (4, True)])
def test_ulysses_attention_equals_sdpa(cp, causal):
    for rank, diffs in enumerate(spawn(cp, _ring_body, causal, (2, 4, 8 * cp, 4), "alltoall")):
        assert max(diffs.values()) < ATTN_TOL, (rank, diffs)


def test_load_balanced_layout():
    from parc.runtime.parallel.ring_attention import local_positions

    # T 16 over cp 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert local_positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    every = torch.cat([local_positions(32, r, 4) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))


def _plan(mesh: str, extra: str = "") -> str:
    return f"mesh {mesh}\nbatch global=4 micro=2\ncontext_parallel ring\noptimizer adamw lr=1e-2 clip=1.0\n{extra}"


def _check(verdict):
    assert verdict.loss_rel < LOSS_TOL, verdict.render()
    assert verdict.param_rel < PARAM_TOL, verdict.render()
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # the run trained


@pytest.mark.parametrize("mesh", ["cp=2", "dp=2 cp=2"])
def test_gpt_cp_matches_serial(tmp_path, mesh):
    _check(parallel_vs_serial(compile_text(_plan(mesh), tmp_path / "c").root, steps=3))


def test_program_shards_sequence_and_rings_attention(tmp_path):
    art = compile_text(_plan("dp=2 cp=2"), tmp_path / "c")
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    assert src.count("torch.ops.parc.ring_attention") == 4  # one per layer
    assert "scaled_dot_product_attention" not in src
    assert src.count("torch.ops.parc.cp_shard") == 2  # idx and targets
    assert "torch.ops.parc.cp_positions" in src and "aten.arange" not in src  # wpe reads global positions
    # no all-reduce in the forward: each rank's loss is its share (summed by Trainer.global_losses), and the
    # mean's count of targets is taken on the whole targets input every rank holds
    assert "torch.ops.parc.cp_sum" not in src
    assert "aten.ne.Scalar(batch_1, -100)" in src
    plan = art.plan
    assert plan["groups"]["cp"] == [[0, 1], [2, 3]] and plan["groups"]["dp"] == [[0, 2], [1, 3]]
    assert plan["groups"]["dp_cp"] == [[0, 1, 2, 3]]
    assert plan["context_parallel"] == {"method": "ring", "cp": 2, "seq_len": 32, "inputs": ["batch_0", "batch_1"],
                                        "attentions": 4, "positions": 1, "masks_folded": 0, "loss_share": True,
                                        "token_counts": {"whole": 1, "summed": 0}}


def test_plan_language_round_trips():
    from parc.grammar.parser import parse
    from parc.grammar.printer import format_plan

    for text in ("mesh dp=2 pp=1 tp=1 cp=2\ncontext_parallel ring\n",
                 "mesh dp=2 pp=1 tp=1 cp=2 order=cp,tp,pp,dp\n"):
        plan = parse(text, file="t.par")
        assert parse(format_plan(plan), file="t.par") == plan
    plan = parse("mesh dp=2 cp=2\n", file="t.par")
    assert plan.mesh.world_size == 4 and plan.mesh.order == ("tp", "cp", "pp", "dp")


def test_order_must_name_cp():
    from parc.grammar.parser import parse

    with pytest.raises(ParcError) as e:
        parse("mesh dp=2 cp=2 order=tp,pp,dp\n", file="t.par")
    assert "mesh order must name each of dp, pp, tp, cp once" in e.value.message
    assert (e.value.span.line, e.value.span.col) == (1, 22)


def test_sequence_not_divisible_by_two_cp(tmp_path):
    # examples/gpt.py's 32 tokens in 2 × cp 3 = 6 load-balanced chunks
    with pytest.raises(ParcError) as e:
        compile_text(_plan("cp=3"), tmp_path / "c")
    assert "sequence length 32 is not divisible by 2 × cp chunks" in e.value.message
    assert "= 6" in e.value.message
    assert (e.value.span.line, e.value.span.col) == (1, 9)  # at the 3 of `cp=3`


def test_compositions_refused_all_at_once(tmp_path):
    text = ("mesh dp=2 tp=2 pp=2 cp=2 ep=2\nbatch global=4 micro=1\nzero stage=1 shard=1 offload=cpu\n"
            "precision fp16\ncontext_parallel ring\npipeline schedule=zb_h1\n"
            'expert_parallel {\n    "blocks.*.moe.experts"\n}\n')
    with pytest.raises(ParcError) as e:
        compile_text(text, tmp_path / "c")
    said = [(d.span.line, d.message) for d in e.value.diagnostics]
    assert any(line == 7 and "expert_parallel with mesh cp 2" in m for line, m in said), said
    assert any(line == 1 and "mesh cp 2 with ep 2: an MoE layer's capacity rule" in m for line, m in said), said
    # HSDP and offload compose with cp (tests/test_cp_compositions.py): neither is refused for cp
    assert [m for _, m in said if "mesh cp" in m] == [m for _, m in said if "capacity rule" in m], said
    # cp × tp with dp, pp, ZeRO and fp16 is proven (tests/test_cp_tp.py): none of them is refused for cp
    assert not any("× tp" in m for _, m in said), said


def test_unknown_method(tmp_path):
    with pytest.raises(ParcError) as e:
        compile_text("mesh cp=2\nbatch global=4 micro=2\ncontext_parallel ulysses\n", tmp_path / "c")
    assert "unknown context_parallel method `ulysses`" in e.value.message
    assert (e.value.span.line, e.value.span.col) == (3, 18)


def test_alltoall_heads_not_divisible_by_cp(tmp_path):
    # examples/gpt.py's 4 heads over cp 8 (its 32 tokens make 16 chunks of 2: the layout itself is fine)
    with pytest.raises(ParcError) as e:
        compile_text("mesh cp=8\nbatch global=4 micro=2\ncontext_parallel alltoall\n", tmp_path / "c")
    d = e.value.diagnostics[0]
    assert "4 heads are not divisible by cp 8" in d.message and "blocks.0.attn" in d.message
    assert d.span.file.endswith("gpt.py") and "scaled_dot_product_attention" in \
        (ROOT / "examples" / "gpt.py").read_text().splitlines()[d.span.line - 1]


def test_gpt_alltoall_matches_serial(tmp_path):
    text = _plan("dp=2 cp=2").replace("context_parallel ring", "context_parallel alltoall")
    art = compile_text(text, tmp_path / "c")
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    assert src.count("torch.ops.parc.ulysses_attention") == 4 and "torch.ops.parc.ring_attention" not in src
    _check(parallel_vs_serial(art.root, steps=3))


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_interleaved_rotary_matches_serial(tmp_path, method):
    """Rotary on interleaved pairs (Meta's Llama, torchtitan: `stack((…), -1).flatten(-2)`), kv heads
    `repeat_interleave`d along the heads, the loss over `flatten(0, 1)`: each keeps the sequence split (each was
    refused as an op cp could not prove local); both attentions train as serial."""
    text = _plan("cp=2").replace("context_parallel ring", f"context_parallel {method}")
    art = compile_text(text, tmp_path / "c", model=MODELS / "cp_interleaved_rotary.py")
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    assert "aten.stack.default" in src and "torch.ops.parc.cp_positions" in src
    assert "aten.repeat_interleave.self_int" in src and "flatten.using_ints(cp_shard" in src
    _check(parallel_vs_serial(art.root, steps=3))


def test_flatten_of_the_sequence_with_inner_dims_refused_at_its_line(tmp_path):
    """A sequence folded with the dims after it has no layout (only outer elements fold in): refused, located."""
    model = tmp_path / "folds.py"
    model.write_text((MODELS / "cp_interleaved_rotary.py").read_text().replace(
        "return self.proj(y.transpose(1, 2).reshape(B, T, C))",
        "return self.proj(y.transpose(1, 2).flatten(1).view(B, T, C))"))
    with pytest.raises(ParcError) as e:
        compile_text(_plan("cp=2"), tmp_path / "c", model=model)
    d = e.value.diagnostics[0]
    assert "folds the sequence dim 1 with the dims after it" in d.message
    assert "flatten(1)" in model.read_text().splitlines()[d.span.line - 1]


def test_context_parallel_without_cp(tmp_path):
    with pytest.raises(ParcError) as e:
        compile_text("mesh dp=2\nbatch global=4 micro=2\ncontext_parallel ring\n", tmp_path / "c")
    assert "context_parallel needs mesh cp > 1" in e.value.message and e.value.span.line == 3


def test_unfused_attention_refused_at_its_line(tmp_path):
    with pytest.raises(ParcError) as e:
        compile_text(_plan("cp=2"), tmp_path / "c", model=UNFUSED)
    d = e.value.diagnostics[0]
    assert "q @ kᵀ" in d.message and "blocks.0.attn" in d.message
    assert d.span.file.endswith("cp_unfused.py")
    line = UNFUSED.read_text().splitlines()[d.span.line - 1]
    assert "q @ k.transpose" in line


def test_unprovable_positions_refused_at_their_line(tmp_path):
    with pytest.raises(ParcError) as e:
        compile_text(_plan("cp=2"), tmp_path / "c", model=POSBIAS)
    d = e.value.diagnostics[0]
    assert "not built from `arange` positions" in d.message
    assert d.span.file.endswith("cp_posbias.py")
    assert "self.pos_bias[:T]" in POSBIAS.read_text().splitlines()[d.span.line - 1]


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_report_prices_cp(tmp_path, method):
    from parc.analysis import report

    dp2 = report.build(compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp_path / "dp").root, preset="h100")
    text = _plan("dp=2 cp=2").replace("context_parallel ring", f"context_parallel {method}")
    rep = report.build(compile_text(text, tmp_path / "c").root, preset="h100")
    mem, mem2 = rep["memory"]["per_pp_rank"][0], dp2["memory"]["per_pp_rank"][0]
    assert mem["activations_bytes"] * 2 == mem2["activations_bytes"]  # the same micro-batch, T / cp tokens a rank
    rows = {(c["axis"], c["collective"]): c for c in rep["communication"]["rows"]}
    assert rows[("dp×cp", "all-reduce")]["group"] == 4  # gradients over dp 2 × cp 2
    # examples/gpt.py, micro 2: 4 attentions of b·h = 2·4 heads, T 32, hs 16; one local K block is
    # 8 · 16 · 16 = 2048 elements
    if method == "ring":  # fwd (cp−1)·2 blocks, bwd (cp−1)·4 blocks, fp32: 6 blocks · 2048 · 4 B · 4 layers
        assert rows[("cp", "send/recv")]["bytes_per_rank"] == 6 * 2048 * 4 * 4
    else:  # 4 + 7 all-to-alls of a block, (cp−1)/cp of it sent, fp32
        assert rows[("cp", "all-to-all")]["bytes_per_rank"] == 11 * 2048 * 4 * 4 // 2
    assert rep["plan"]["cp"] == 2 and any("context parallelism cp 2" in n for n in rep["notes"])


def test_report_prices_cp_per_pp_rank_under_virtual_stages(tmp_path):
    # interleaved, virtual 2: each pp rank runs 2 chunks of one layer each, so it sends what a 1F1B stage of
    # 2 layers sends (parc/analysis/cp_cost.py sums the chunks of a pp rank)
    from parc.analysis import report

    sent = {}
    for name, extra in (("1f1b", "pipeline schedule=1f1b\n"),
                        ("interleaved", "pipeline schedule=interleaved_1f1b virtual=2\n")):
        rep = report.build(compile_text(_plan("pp=2 cp=2", extra), tmp_path / name).root, preset="h100")
        sent[name] = next(c["bytes_per_rank"] for c in rep["communication"]["rows"] if c["axis"] == "cp")
    # test_report_prices_cp's ring arithmetic: 6 blocks of 2048 fp32 elements an attention, for 2 layers a pp
    # rank × 2 micro-batches (global 4 = micro 2 × accumulation 2)
    assert sent["interleaved"] == sent["1f1b"] == 6 * 2048 * 4 * 2 * 2, sent


@pytest.mark.parametrize("model,share,counts", [
    # uneven ignore_index masks (rank 0's chunk 0 holds no target): each rank's loss is its share, the mean's
    # count taken on the whole targets input, no collective in the forward
    ("cp_masked_loss.py", True, {"whole": 1, "summed": 0}),
    # log(1 + mean) over targets the model computes: the mean summed over cp before the log, its count of
    # targets summed over cp (`parc.cp_sum`, all-reduces in the forward)
    ("cp_loss_after.py", False, {"whole": 0, "summed": 1}),
])
def test_loss_forms_match_serial(tmp_path, model, share, counts):
    art = compile_text(_plan("cp=2"), tmp_path / "c", MODELS / model)
    assert art.plan["context_parallel"]["loss_share"] is share
    assert art.plan["context_parallel"]["token_counts"] == counts
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    assert src.count("torch.ops.parc.cp_sum") == (0 if share else 2)
    _check(parallel_vs_serial(art.root, steps=3))
