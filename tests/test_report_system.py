"""Another framework's run, priced by `parc report` flags (issue 27, item 3): --attention, --pp-sends,
--no-dp-overlap, --dp-wire and --nics each change the price the way their arithmetic says, are said in the
report's notes, and bench/published.py prices its rows through exactly that CLI path. Analytic reports of
bench/gpt_sized.py at 4 × 1024, sequence 2048 (large enough that kernels and messages are priced by their
work, not their launch latency; tracing on meta only, no ranks): under a second each; the bench row traces a
1.7B GPT on meta (a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import sized_report
from parc import cli
from parc.analysis import compute, cost, report

ROOT = Path(__file__).resolve().parents[1]
SIZED = ROOT / "bench" / "gpt_sized.py"
LLAMA = ROOT / "bench" / "llama_sized.py"
# 2 nodes of 4, dp 4 over both (2 ranks of each dp group on a node), pp 2 inside a node, bf16 on an A100
PLAN = """mesh dp=4 pp=2
topology nodes=2 gpus_per_node=4 preset=a100
batch global=16 micro=2
pipeline schedule=1f1b stages=2
precision bf16
"""


@pytest.fixture(autouse=True)
def _size(monkeypatch):
    monkeypatch.setenv("PARC_BENCH_GPT", "4,1024,16,51200,2048")


def _report(tmp_path, *flags) -> dict:
    plan = tmp_path / "p.par"
    plan.write_text(PLAN)
    return sized_report(plan, *flags)


def test_the_default_is_parcs_runtime_and_says_nothing(tmp_path):
    rep = _report(tmp_path)
    plan = tmp_path / "p.par"
    same = report.build(model=SIZED, plan=plan, system=cost.System())
    assert rep["utilization"]["step_seconds"] == same["utilization"]["step_seconds"]
    assert not any("another system's run" in n for n in rep["notes"])


def test_materialized_attention_costs_more_than_flash_and_dropout_more_again(tmp_path):
    """The scores written out (T × T per head) and read back are memory traffic a fused kernel does not have."""
    flash = _report(tmp_path)["utilization"]["compute_seconds"]
    mat = _report(tmp_path, "--attention", "materialized")
    drop = _report(tmp_path, "--attention", "materialized-dropout")["utilization"]["compute_seconds"]
    assert flash < mat["utilization"]["compute_seconds"] < drop
    assert any("attention materialized" in n for n in mat["notes"])


def test_no_dp_overlap_exposes_the_whole_all_reduce(tmp_path):
    """Overlapped, all but the last 25 MiB bucket hides under the last backward; not overlapped, all of it
    is on the step: the step grows by exactly the difference in exposed dp seconds."""
    on, off = _report(tmp_path), _report(tmp_path, "--no-dp-overlap")
    dp_seconds = sum(r["seconds"] for r in on["communication"]["rows"] if r["axis"] == "dp")
    assert off["communication"]["exposed_parts"]["dp"] == pytest.approx(dp_seconds)
    grow = off["utilization"]["step_seconds"] - on["utilization"]["step_seconds"]
    # overlapped, the hidden part slows the backward it runs under (`cost.beside`); not overlapped, nothing does
    assert off["communication"]["beside_seconds"] == 0 < on["communication"]["beside_seconds"]
    assert grow == pytest.approx(off["communication"]["exposed_parts"]["dp"] - on["communication"]["exposed_parts"]["dp"]
                                 - on["communication"]["beside_seconds"])


def test_dp_wire_dtype_halves_the_bytes(tmp_path):
    """bf16 gradients are fp32 under the plan's layout (4 bytes); --dp-wire bf16 sends 2."""
    dp = [r for r in _report(tmp_path)["communication"]["rows"] if r["axis"] == "dp"][0]
    half = [r for r in _report(tmp_path, "--dp-wire", "bf16")["communication"]["rows"] if r["axis"] == "dp"][0]
    assert half["bytes_per_rank"] == pytest.approx(dp["bytes_per_rank"] / 2, rel=1e-6)


def test_fewer_nics_than_gpus_slow_the_groups_that_cross_nodes(tmp_path):
    """dp groups have 2 ranks on each node of 4: with a NIC per GPU each group runs over 2 links; with 1 NIC a
    node, shared by the node's 2 groups, each gets half a link: 4× the inter-node time."""
    one = [r for r in _report(tmp_path, "--nics", "1")["communication"]["rows"] if r["axis"] == "dp"][0]
    four = [r for r in _report(tmp_path)["communication"]["rows"] if r["axis"] == "dp"][0]
    assert one["seconds"] > 3 * four["seconds"]


def test_a_fused_loss_keeps_the_logits_and_a_log_sum_exp_a_row_instead_of_the_fp32_log_softmax(tmp_path):
    """The last pp rank's loss reads micro 2 × 2048 tokens × 51,200 logits. Eager (parc's) cross-entropy keeps
    their fp32 log-softmax (4 bytes an element) and in the backward holds their fp32 gradient and its bf16 cast
    (6); a fused kernel keeps the bf16 logits (2) and one fp32 log-sum-exp a row, and writes a bf16 gradient (2).
    Its forward reads the logits once (2 bytes an element) where eager moves 12: the step is shorter too."""
    eager, fused = _report(tmp_path), _report(tmp_path, "--loss", "fused")
    el, rows = 2 * 2048 * 51200, 2 * 2048
    e, f = eager["memory"]["per_pp_rank"][1], fused["memory"]["per_pp_rank"][1]
    assert e["transient_bytes"] - f["transient_bytes"] == el * (6 - 2)
    assert (e["activations_kept_bytes"] - f["activations_kept_bytes"]) / e["inflight"] == el * (4 - 2) - rows * 4
    assert eager["memory"]["per_pp_rank"][0] == fused["memory"]["per_pp_rank"][0]   # no loss on the first rank
    assert fused["utilization"]["compute_seconds"] < eager["utilization"]["compute_seconds"]
    assert any("loss fused" in n for n in fused["notes"])


@pytest.mark.parametrize("flag", [["--attention", "paged"], ["--pp-sends", "broadcast"], ["--dp-wire", "fp8"],
                                  ["--loss", "liger"]])
def test_unknown_values_are_refused_by_the_cli(flag, capsys):
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["report", "--model", "m.py", "--plan", "p.par", *flag])
    assert "invalid choice" in capsys.readouterr().err


def _published():
    """bench/published.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("published", ROOT / "bench" / "published.py")
    published = importlib.util.module_from_spec(spec)
    sys.modules["published"] = published
    spec.loader.exec_module(published)
    return published


def test_the_published_bench_prices_a_row_as_parc_report_does(tmp_path, capsys, monkeypatch):
    """bench/published.py's first row (Megatron's 1.7B) and a row whose dp waits for the backward (Megatron's 39.1B,
    its own DDP) against `parc report --json` run by hand with the row's plan and flags: the same step, to the
    last bit."""
    published = _published()
    for row in (published.ROWS[0], next(r for r in published.ROWS if r.name == "GPT 39.1B")):
        predicted, rep = published.predict(row)
        monkeypatch.setenv(*published.model_env(row))
        plan = tmp_path / "row.par"
        plan.write_text(published.plan_text(row))
        capsys.readouterr()
        assert cli.main(["report", "--model", str(published.GPT_MODEL), "--plan", str(plan), "--preset", row.preset,
                         *published.report_flags(row), "--json"]) == 0
        by_hand = json.loads(capsys.readouterr().out)
        assert by_hand["utilization"]["step_seconds"] == rep["utilization"]["step_seconds"]
        assert any("not overlapped" in n for n in by_hand["notes"]) == (not row.dp_overlap)
        assert any("another system's run" in n and "attention materialized-dropout" in n for n in by_hand["notes"])


def test_a_pipeline_sweeps_published_steps_give_its_fill_at_its_micro_batch():
    """`fill_slots` reads a sweep's micro-batch from its published steps alone: rows made by hand from a 1F1B
    pipeline of 8 stages at micro-batch 2 (step = (m + 7) slots of 0.3 s + 0.5 s after, m = 512 / (dp × 2), TFLOP/s
    by Megatron's count over that step) give 7 slots plus the 0.5 s in slots at micro-batch 2 and twice that at 1.
    MT-NLG's rows run the micro-batch whose fill is its pipeline's, pp − 1, within a slot."""
    published = _published()
    shape, tp, pp, slot, after = (8, 1024, 8, 51200, 2048), 8, 8, 0.3, 0.5
    rows = []
    for dp in (2, 4, 8):
        step = (512 / (dp * 2) + pp - 1) * slot + after
        gpus = tp * pp * dp
        tflops = published.megatron_flops(8, 1024, 51200, 2048, 512) / step / gpus / 1e12
        rows.append(published._gpt("t", "hand", shape, tp, pp, gpus, 512, 2, tflops))
    assert published.fill_slots(rows, 2) == pytest.approx(pp - 1 + after / slot)
    assert published.fill_slots(rows, 1) == pytest.approx(2 * (pp - 1 + after / slot))
    mtnlg = [r for r in published.ROWS if r.source == published.MTNLG]
    assert abs(published.fill_slots(mtnlg, mtnlg[0].micro) - (mtnlg[0].pp - 1)) < 1


TINY_LLAMA = "2,64,4,2,128,100,16"   # bench/llama_sized.py's shape fields: layers, dim, heads, kv, ffn, vocab, T


def _load_llama(monkeypatch, spec_env: str):
    """bench/llama_sized.py imported afresh under PARC_BENCH_LLAMA=`spec_env` (it reads the shape at import)."""
    monkeypatch.setenv("PARC_BENCH_LLAMA", spec_env)
    spec = importlib.util.spec_from_file_location("llama_sized", LLAMA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _llama_reports(tmp_path, monkeypatch, *spec_envs: str) -> list[dict]:
    """`parc report` of bench/llama_sized.py at each of `spec_envs`, dp 8 ZeRO-3 bf16 on one H100 node."""
    plan = tmp_path / "p.par"
    plan.write_text("mesh dp=8\ntopology nodes=1 gpus_per_node=8 preset=h100\nbatch global=16 micro=2\n"
                    "zero stage=3\nprecision bf16\n")
    reps = []
    for spec_env in spec_envs:
        monkeypatch.setenv("PARC_BENCH_LLAMA", spec_env)
        reps.append(sized_report(plan, model=LLAMA))
    return reps


def test_the_llama_benchs_fused_norm_computes_the_unfused_one_and_is_priced_as_one_op(tmp_path, monkeypatch):
    """bench/llama_sized.py's `fused` field (torchtitan's fused_rmsnorm): the custom op's output and gradients are
    the unfused module's, and the report prices the model with it faster (one op's bytes, not each fp32 op's) and
    keeping fewer activations (its input, not each op's saved fp32 copy)."""
    import torch

    shape = TINY_LLAMA
    unfused, fused = _load_llama(monkeypatch, shape), _load_llama(monkeypatch, shape + ",fused")
    assert not unfused._FUSED_NORM and fused._FUSED_NORM
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    outs = []
    for mod in (unfused, fused):
        norm = mod.RMSNorm(64)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
        x.grad = None
        y = norm(x)
        (y.float() * torch.arange(64.0)).sum().backward()
        outs.append((y, x.grad.clone(), norm.weight.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)

    u_rep, f_rep = _llama_reports(tmp_path, monkeypatch, shape, shape + ",fused")
    assert f_rep["utilization"]["step_seconds"] < u_rep["utilization"]["step_seconds"]
    kept = [r["memory"]["per_pp_rank"][0]["activations_bytes"] for r in (u_rep, f_rep)]
    assert kept[1] < kept[0]


def test_the_llama_benchs_fused_ops_compute_the_unfused_ones_and_are_priced_as_one_op_each(tmp_path, monkeypatch):
    """bench/llama_sized.py's `fused_ops` field (Transformer Engine's fused RoPE and Megatron-core's fused SwiGLU, as
    NVIDIA's NeMo recipes run them): each custom op's output and gradients are the unfused ops' (fp32: bitwise, the
    turn back is the same products and sums), and the report prices the model faster (one op's bytes each) and
    keeping fewer activations (the SwiGLU keeps its two inputs, not its silu too)."""
    import torch

    shape = TINY_LLAMA
    unfused, fused = _load_llama(monkeypatch, shape), _load_llama(monkeypatch, shape + ",fused_ops")
    assert not unfused._FUSED_OPS and fused._FUSED_OPS and not fused._FUSED_NORM
    with pytest.raises(ValueError, match="unknown fields"):
        _load_llama(monkeypatch, shape + ",fusedops")
    torch.manual_seed(0)
    q = torch.randn(2, 16, 4, 16)
    angles = torch.arange(16.0)[:, None] * torch.rand(8)[None, :]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    h = torch.randn(2, 16, 64)
    outs = []
    for mod in (unfused, fused):
        x, hx = q.clone().requires_grad_(), h.clone().requires_grad_()
        y = mod._rotate(x, cos, sin)
        (y * torch.arange(16.0)).sum().backward()
        torch.manual_seed(1)   # the same weights in both MLPs
        ff = mod.FeedForward()
        z = ff(hx)
        (z * torch.arange(64.0)).sum().backward()
        outs.append((y, x.grad, z, hx.grad, ff.w1.weight.grad, ff.w3.weight.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)

    u_rep, f_rep = _llama_reports(tmp_path, monkeypatch, shape, shape + ",fused_ops")
    assert f_rep["utilization"]["compute_seconds"] < u_rep["utilization"]["compute_seconds"]
    kept = [r["memory"]["per_pp_rank"][0]["activations_bytes"] for r in (u_rep, f_rep)]
    assert kept[1] < kept[0]


def test_torchtitans_every_second_layer_is_recomputed_as_it_ran_and_nothing_else():
    """torchtitan's selective layer AC (`selective_ac_option = "2"`, parallelize_llama.py at 1ea476e9f) wraps a block
    when its 1-based count is even: layers 1, 3, 5, ... by index, whole. The bench's plan recomputes exactly those
    layers (each as one region) and no module of the others. A single glob "layers.*[13579]" did not: `*` also
    matches dots, so it took every layer's feed_forward.w1 and w3 as recomputed modules of their own."""
    from parc.grammar.parser import parse

    published = _published()
    rows = [r for r in published.ROWS if r.recompute == published.EVERY_SECOND]
    assert {r.name for r in rows} == {"Llama 3 8B", "Llama 2 13B"}
    for row in rows:
        layers = row.shape[0]
        plan = parse(published.plan_text(row), file="row.par")
        wrapped = {i for i in range(layers) if (i + 1) % 2 == 0}   # torchtitan's `_count % every_x_layer == 0`
        for i in range(layers):
            region = f"layers.{i}" if i in wrapped else None
            for module in ("", ".attention.wq", ".feed_forward.w1", ".feed_forward.w3", ".ffn_norm"):
                assert plan.recompute.instance(f"layers.{i}{module}") == region, (row.name, i, module)
    old = parse(published.plan_text(rows[0]).replace(
        'recompute "layers.[13579]" "layers.[1-9][13579]"', 'recompute "layers.*[13579]"'), file="row.par")
    assert old.recompute.instance("layers.0.feed_forward.w1") == "layers.0.feed_forward.w1"


def test_mpt_rows_state_their_own_stage_kernel_and_gpu():
    """MosaicML's four tables through one `_mpt`: the large-scale H100 table's SHARD_GRAD_OP rows are `zero stage=2`
    without recompute, its 13b and 30b rows override the source's FlashAttention-2 (llm-foundry's, between
    flash_attn's unpad and pad gathers: flash-unpad) with the Triton kernel (the last `--attention` wins), its
    backward gathers are prefetched (no `--zero-prefetch post`); the A100 40GB rows run on
    the a100_40gb preset with bf16 gradients; both use MPT's fused loss; the 79 rows before them are as they were
    (ZeRO-3, a100 / h100)."""
    from parc.cli import parser

    published = _published()
    by = {s: [r for r in published.ROWS if r.source == s] for s in (published.MPT_H100, published.MPT_A100,
                                                                    published.MPT_H100_LARGE, published.MPT_A100_40)}
    assert [len(v) for v in by.values()] == [43, 36, 18, 45]
    assert {(r.preset, r.zero_stage) for r in by[published.MPT_H100] + by[published.MPT_A100]} == \
        {("h100", 3), ("a100", 3)}
    large = {(r.name, r.gpus): r for r in by[published.MPT_H100_LARGE]}
    one, thirteen = large["MPT 1B s2048", 512], large["MPT 13B s2048", 128]
    text = published.plan_text(one)
    assert "zero stage=2\n" in text and "recompute" not in text and "mesh dp=512 pp=1 tp=1\n" in text
    assert "nodes=64 gpus_per_node=8" in text and "batch global=6144 micro=12\n" in text
    flags = parser().parse_args(["report", *published.report_flags(one)])
    assert (flags.attention, flags.zero_prefetch, flags.dp_wire, flags.loss) == ("flash-unpad", "pre", "fp32", "fused")
    flags = parser().parse_args(["report", *published.report_flags(thirteen)])
    assert (flags.attention, flags.zero_prefetch) == ("flash-triton", "pre")
    kernels = {r.name.split()[1]: parser().parse_args(["report", *published.report_flags(r)]).attention
               for r in by[published.MPT_H100_LARGE]}
    assert kernels == {"70B": "flash-unpad", "30B": "flash-triton", "13B": "flash-triton", "7B": "flash-unpad",
                       "3B": "flash-unpad", "1B": "flash-unpad"}
    assert "zero stage=3\n" in published.plan_text(thirteen) and 'recompute "blocks.*"' in published.plan_text(thirteen)
    for row in by[published.MPT_A100_40]:
        flags = parser().parse_args(["report", *published.report_flags(row)])
        assert (row.preset, row.zero_stage, flags.dp_wire, flags.zero_prefetch, flags.loss) == \
            ("a100_40gb", 3, "bf16", "post", "fused")
    with pytest.raises(ValueError, match=r"8 GPUs × micro 4 × accum 2 != global 60"):
        published._mpt(published.MPT_A100_40, "1b", 2048, 8, 4, 2, 60, 1.0, False)


def test_llama3_405b_rows_are_table_4s_plans_priced_by_palms_count():
    """The Llama 3 405B rows (Dubey et al. 2024, Table 4) as .par: tp 8 × pp 16 with cp and dp from the table, in the
    paper's order [TP, CP, PP, DP]; Megatron tp over bench/llama_sized.py's names with sequence parallelism; the
    interleaved schedule of 8 one-layer chunks a rank, cut after the embedding and after every layer (126 layers and
    the embedding's and the output's chunks: 128 = 16 × 8); ZeRO-1 (one reduce-scatter a step), no recompute. Their
    TFLOP/s is PaLM's model FLOPs (6N + 12·L·H·Q·T a token), checked here against the arithmetic by hand."""
    from parc.grammar.parser import parse

    published = _published()
    rows = [r for r in published.ROWS if r.source == published.LLAMA3]
    assert [(r.gpus, r.cp, r.dp, r.shape[-1], r.batch // r.dp) for r in rows] == [
        (8192, 1, 64, 8192, 32), (16384, 1, 128, 8192, 16), (16384, 16, 8, 131072, 16)]
    for row in rows:
        plan = parse(published.plan_text(row), file="row.par")
        m = plan.mesh
        assert (m.tp, m.cp, m.pp, m.dp) == (8, row.cp, 16, row.dp)
        assert m.order[:1] == ("tp",) and (m.order == ("tp", "cp", "pp", "dp") or row.cp == 1)
        assert plan.tensor_parallel.sequence_parallel
        assert {r.pattern: r.style for r in plan.tensor_parallel.rules} == {
            **{f"layers.*.attention.{w}": "column" for w in ("wq", "wk", "wv")}, "layers.*.attention.wo": "row",
            "layers.*.feed_forward.w1": "column", "layers.*.feed_forward.w3": "column",
            "layers.*.feed_forward.w2": "row", "tok_embeddings": "vocab", "output": "vocab"}
        pipe = plan.pipeline
        assert (pipe.schedule, pipe.virtual, pipe.stages) == ("interleaved_1f1b", 8, 128)
        assert [c.path for c in pipe.cuts] == ["tok_embeddings"] + [f"layers.{i}" for i in range(126)]
        assert all(c.where == "after" for c in pipe.cuts)
        assert plan.zero.stage == 1 and not plan.recompute.patterns
    # 405B by hand: per layer q and o (16384²), k and v (16384 × 8 heads × 128), the SwiGLU's three (16384 × 53248);
    # the embedding and the untied output (128256 × 16384 each)
    n = 126 * (2 * 16384 ** 2 + 2 * 16384 * 1024 + 3 * 16384 * 53248) + 2 * 128256 * 16384
    assert rows[0].params == n == 405_849_243_648
    tokens = 2048 * 8192
    flops = tokens * (6 * n + 12 * 126 * 128 * 128 * 8192)   # L·H·Q = 126 layers × 128 heads × 128 dims
    assert published.palm_flops(rows[0]) == flops
    assert published.published_step(rows[0]) == pytest.approx(flops / (430e12 * 8192))   # 12.56 s


def test_korthikantis_selective_rows_recompute_the_attentions_core_and_nothing_else():
    """Korthikanti et al.'s Table 5 as rows: "Present Work" is Megatron's tp 8 with sequence parallelism and selective
    recomputation (the attention module recomputed with its matmuls' outputs saved), "Full Recompute" every layer
    without sequence parallelism; each row's tokens/s is its iteration time's. The FLOPs run again, by hand for the
    22B (48 layers, b 4, s 2048, h 6144), the attention over the whole square (Megatron's materialised kernel):
    selective, the core's forward alone, QK^T and the product with V at 2·b·s²·h each; full, a whole block's forward."""
    from parc.grammar.parser import parse

    published = _published()
    full, present = [r for r in published.ROWS if r.source == published.KORTHIKANTI and r.name.startswith("GPT 22B")]
    assert published.published_step(full) == pytest.approx(1.42) and published.published_step(present) == \
        pytest.approx(1.10)
    for row, sp, patterns in ((full, False, ("blocks.*",)), (present, True, ("blocks.*.attn",))):
        plan = parse(published.plan_text(row), file="row.par")
        assert (plan.mesh.tp, plan.mesh.pp, plan.mesh.dp, plan.micro_batch) == (8, 1, 1, 4)
        assert plan.tensor_parallel.sequence_parallel == sp and plan.recompute.patterns == patterns
    assert "--recompute-saves" in published.report_flags(present) and \
        "--recompute-saves" not in published.report_flags(full)
    layers, b, s, h = 48, 4, 2048, 6144
    again = {}
    for row in (full, present):
        u = published.predict(row)[1]["utilization"]
        again[row] = u["hardware_flops_per_step"] - u["model_flops_per_step"]
    assert again[present] == layers * 4 * b * s * s * h
    # full: the block's matmuls and attention, and its other ops at one FLOP an output element (node_flops): two
    # layer norms and two residual adds of b·s·h, the GELU of b·s·4h
    assert again[full] == layers * (24 * b * s * h * h + 4 * b * s * s * h + 8 * b * s * h)


def _tiny_llama_cp(tmp_path, monkeypatch):
    """A tiny Llama with 8 query heads on 2 kv heads (repeat 4), T 64, on cp 2 with 2 micro-batches: (its plan file,
    `cp_row(*flags)`: its report's cp row and the report)."""
    monkeypatch.setenv("PARC_BENCH_LLAMA", "2,256,8,2,512,1000,64")   # layers, dim, heads, kv heads, ffn, vocab, T
    plan = tmp_path / "cp.par"
    plan.write_text("mesh dp=1 cp=2\ntopology nodes=1 gpus_per_node=2\nbatch global=2 micro=1\nprecision bf16\n")
    llama = LLAMA

    def cp_row(*flags):
        rep = sized_report(plan, "--preset", "h100", *flags, model=llama)
        (row,) = [r for r in rep["communication"]["rows"] if r["axis"] == "cp"]
        return row, rep

    return plan, cp_row


def test_cp_attention_allgather_moves_the_kv_heads_of_the_whole_sequence(tmp_path, monkeypatch):
    """`--cp-attention allgather` (Llama 3's context parallelism, Dubey et al. 2024 §3.3.2): per attention and
    micro-batch, K and V all-gathered forward, gathered again and dK, dV reduce-scattered backward, each the whole
    sequence of the rank's kv heads, before GQA repeats them to the query heads (compute.kv_repeat), in bf16; parc's
    ring sends the repeated heads' blocks in fp32. A tiny Llama with 8 query heads on 2 kv heads (repeat 4), cp 2,
    2 micro-batches: the gathered sizes by hand, and the ring's by its own rule."""
    plan, cp_row = _tiny_llama_cp(tmp_path, monkeypatch)

    gathered, rep = cp_row("--cp-attention", "allgather")
    kv = 1 * 2 * 64 * 32 * 2              # one sample's K of 2 kv heads × T 64 × head size 32, bf16: 8 KiB
    size = (2 + 2 + 2) * kv * 2 * 2       # K, V forward; K, V again and dK, dV backward; 2 layers; 2 micro-batches
    assert gathered["collective"] == "all-gather"
    assert gathered["bytes_per_rank"] == pytest.approx(size * (2 - 1) / 2)   # each rank receives the other half
    assert any("cp attention allgather" in n for n in rep["notes"])
    ring, _ = cp_row()
    block = 1 * 8 * 32 * 32 * 4           # a ring block: 8 query heads × T/cp 32 × 32, fp32
    assert ring["bytes_per_rank"] == pytest.approx((2 + 4) * (2 - 1) * block * 2 * 2)
    assert ring["bytes_per_rank"] / gathered["bytes_per_rank"] == pytest.approx(4 * 2)   # the repeat, fp32 / bf16
    # no cp: the flag changes nothing, and says so
    plan.write_text("mesh dp=2\ntopology nodes=1 gpus_per_node=2\nbatch global=2 micro=1\nprecision bf16\n")
    rep = sized_report(plan, "--preset", "h100", "--cp-attention", "allgather", model=LLAMA)
    assert any("has no context parallelism" in n for n in rep["notes"])


def test_cp_attention_te_ring_sends_kv_heads_under_the_attention(tmp_path, monkeypatch):
    """`--cp-attention te-ring` (Transformer Engine's ring, cp_comm_type "p2p": Megatron-core's and NeMo's): parc's
    ring's hops and blocks, but of the kv heads before GQA repeats them and in the activations' dtype (bf16), so the
    tiny Llama's ring (repeat 4) sends 1 / (4 × 2) of parc's bytes; and each hop runs under the attention block
    beside it, so the step waits only for what the hops outlast: at T 64 the hops' fixed costs outlast the tiny
    blocks, at T 4096 the blocks (quadratic) hide them whole."""
    from parc.analysis import cp_cost
    from parc.grammar.parser import parse

    plan, cp_row = _tiny_llama_cp(tmp_path, monkeypatch)

    te, rep = cp_row("--cp-attention", "te-ring")
    ring, parcs = cp_row()
    assert te["collective"] == ring["collective"] == "send/recv"
    assert ring["bytes_per_rank"] / te["bytes_per_rank"] == pytest.approx(4 * 2)   # the repeat, fp32 / bf16
    assert any("cp attention te-ring" in n for n in rep["notes"])
    assert parcs["communication"]["exposed_parts"]["cp"] == pytest.approx(ring["seconds"])   # parc's: all waited

    # the exposure rule on hand-made statistics: one causal attention row (b·h 8, T, head size 32, kv repeat 4),
    # 2 micro-batches over cp 2 on one node; the hops' seconds less half the rank's attention (cp − 1 of cp blocks)
    hw = cost.hardware("h100")
    p = parse("mesh dp=1 cp=2\ntopology nodes=1 gpus_per_node=2\nbatch global=2 micro=1\nprecision bf16\n")
    for t, hidden in ((64, False), (4096, True)):
        stats = {"stages": [{"ops": {"attn": [[8, t, 32, True, 0, False, 4, 1]]}}]}
        local = cp_cost.local_stats(stats, 2)
        rows, waited, slowed = cp_cost.comms(p, stats, hw, "ring", [[0, 1]], system="te-ring", local=local)
        f, b = compute.stage_seconds({"attn": local["stages"][0]["ops"]["attn"]}, hw, "bf16", 1)
        assert rows[0].bytes == pytest.approx((2 + 4) * 8 * (t / 2) * 32 * 2 / 4 * 2)   # 6 blocks, bf16, 2 micro
        under = 2 * (f + b) / 2
        # what the blocks hide slows them (`cost.beside`: the preset's overlap_slowdown)
        assert slowed == pytest.approx(min(rows[0].seconds, under) * hw.overlap_slowdown / (1 + hw.overlap_slowdown))
        assert waited == pytest.approx(max(0.0, rows[0].seconds - under))
        assert (waited == 0.0) == hidden


def test_kv_repeat_finds_gqas_heads_before_their_repetition(monkeypatch):
    """The attention rows carry how many query heads share a K head: bench/llama_sized.py repeats its kv heads with
    repeat_interleave (torchtitan's repeat_kv) before SDPA: 8 heads on 2 is 4; examples/gpt.py's K is its own: 1."""
    from parc.analysis import compute
    from parc.grammar.parser import parse

    monkeypatch.setenv("PARC_BENCH_LLAMA", "2,256,8,2,512,1000,64")
    monkeypatch.setenv("PARC_BENCH_GPT", "2,256,8,1000,64")
    plan = parse("mesh dp=1\nbatch global=1 micro=1\n", file="p.par")
    for model, repeat in ((LLAMA, 4), (SIZED, 1)):
        stats = report._trace_stats(model, plan, ())
        rows = [r for s in stats["stages"] for r in compute.attn_rows(s["ops"])]
        assert rows and {r[6] for r in rows} == {repeat}, model


def test_nvidias_nemo_rows_run_cudnns_attention():
    """bench/published.py's NVIDIA DGX Cloud sources (GPT-3 175B, Llama 3.1) state TE's fused attention, as their
    configure.sh sets NVTE_FUSED_ATTN=1: every such row reaches the report as --attention cudnn, on the h100."""
    from parc.cli import parser

    published = _published()
    rows = [r for r in published.ROWS if r.source in (published.NEMO_175B, published.NEMO_LLAMA31)]
    assert len(rows) == 19
    for row in rows:
        flags = parser().parse_args(["report", *published.report_flags(row)])
        assert (flags.attention, row.preset) == ("cudnn", "h100")


def test_nvidias_nemo_rows_split_layers_as_megatron_core_does():
    """Megatron-core gives each model chunk layers // (pp × virtual) decoder layers, the embedding and output layer
    uncounted: the NeMo Llama 3.1 70B's plan cuts after every 4th of its 80 layers into 4 × 5 chunks, the 405B's
    after every 2nd of 126 into 9 × 7, GPT-3 175B's after each of 96 into 8 × 12; an uneven split is refused."""
    published = _published()
    by = {(r.name, r.pp): r for r in published.ROWS if r.source in (published.NEMO_175B, published.NEMO_LLAMA31)}
    seventy, big, gpt = by["Llama 3.1 70B", 4], by["Llama 3.1 405B", 9], by["GPT-3 175B", 8]
    assert seventy.cuts == tuple(f"layers.{i}" for i in range(3, 79, 4))
    assert big.cuts == tuple(f"layers.{i}" for i in range(1, 125, 2))
    assert gpt.cuts == tuple(f"blocks.{i}" for i in range(95))
    text = published.plan_text(seventy)
    assert "pipeline schedule=interleaved_1f1b stages=20 virtual=5 {\n" in text and ' cut after "layers.75"\n' in text
    assert by["Llama 3.1 8B", 1].cuts == ()
    with pytest.raises(ValueError, match="not into 12 chunks"):
        published.megatron_cuts(70, 12, "blocks")


def _llama_tp_report(tmp_path, monkeypatch, spec_env: str, tp: int) -> dict:
    """`parc report` of bench/llama_sized.py at `spec_env`, tp `tp` by the bench's Llama rules, one H100 node."""
    sys.path.insert(0, str(ROOT / "bench"))
    import published

    plan = tmp_path / f"tp{tp}.par"
    plan.write_text(f"mesh tp={tp}\ntopology nodes=1 gpus_per_node={tp} preset=h100\nbatch global=2 micro=2\n" +
                    ("tensor_parallel {\n" + published.LLAMA_TP_RULES + "}\n" if tp > 1 else "") +
                    "precision bf16\n")
    monkeypatch.setenv("PARC_BENCH_LLAMA", spec_env)
    return sized_report(plan, model=LLAMA)


def test_a_vocab_parallel_heads_logits_cast_to_fp32_by_the_loss_stay_each_ranks_slice(tmp_path, monkeypatch):
    """bench/llama_sized.py's loss casts the logits (`logits.reshape(-1, V).float()`) outside the model, where no
    rule names a module. passes/tensor_parallel.py keeps that cast vocab-sharded and runs the loss as
    `parc.vocab_parallel_cross_entropy`, so each rank holds 1/tp of the logits: the loss's transient (their fp32
    gradient and its bf16 cast, 6 bytes an element) is 1/tp of one rank's whole logits. The report counted them
    whole on every rank (tp× the bytes) while the cast stood between head and loss."""
    tokens, vocab = 2 * 16, 100
    one, two = (_llama_tp_report(tmp_path, monkeypatch, TINY_LLAMA, tp) for tp in (1, 2))
    assert one["memory"]["per_pp_rank"][0]["transient_bytes"] == tokens * vocab * 6
    assert two["memory"]["per_pp_rank"][0]["transient_bytes"] == tokens * vocab * 6 / 2


def test_the_llama_benchs_nemotron_fields(monkeypatch):
    """bench/llama_sized.py's Nemotron-4 fields: `layernorm` is Megatron's layernorm1p (LayerNorm scaled by 1 + γ,
    γ zero at init), fused or not the same values and gradients; `relu2` the ungated MLP w2(relu(w1 x)²) (no w3:
    2 of the SwiGLU's 3 matrices); `half_rotary` turns each head's first half and leaves the rest; and the bench
    counts the parameters as the traced model has them."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import published

    fields = ",layernorm,relu2,half_rotary"
    plain = _load_llama(monkeypatch, TINY_LLAMA + fields)
    fused = _load_llama(monkeypatch, TINY_LLAMA + fields + ",fused")
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, requires_grad=True)
    outs = []
    for mod in (plain, fused):
        norm = mod.RMSNorm(64)
        assert torch.equal(norm.weight, torch.zeros(64))
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(-0.5, 0.5, 64))
        x.grad = None
        y = norm(x)
        (y * torch.arange(64.0)).sum().backward()
        outs.append((y, x.grad.clone(), norm.weight.grad.clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    expect = torch.nn.functional.layer_norm(x, (64,)) * (1 + torch.linspace(-0.5, 0.5, 64))
    assert torch.allclose(outs[0][0], expect, atol=1e-6)

    ff = plain.FeedForward()
    assert not hasattr(ff, "w3")
    h = torch.randn(3, 64)
    assert torch.equal(ff(h), ff.w2(torch.relu(ff.w1(h)) ** 2))

    q = torch.randn(1, 16, 4, 16)
    angles = torch.arange(16.0)[:, None] * torch.rand(4)[None, :]   # 4 pairs: the first 8 of 16 dims
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    turned = plain._rotate(q, cos, sin)
    assert torch.equal(turned[..., 8:], q[..., 8:])
    assert torch.equal(turned[..., :8], _load_llama(monkeypatch, TINY_LLAMA)._turn(q[..., :8], cos, sin))

    model = plain.build_model()
    row = replace(published.ROWS[0], arch="llama", shape=tuple(int(v) for v in TINY_LLAMA.split(",")),
                  variant=("layernorm", "relu2", "half_rotary"))
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert row.params == sum(p.numel() for p in model.parameters()) - norms


SHIFTED_LOSS = '''"""A tiny LM whose loss shifts, copies and casts the head's logits outside the model (nanoGPT's way)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, T = 96, 32, 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, 2 * D)
        self.proj = nn.Linear(2 * D, D)
        self.output = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        return self.output(self.proj(torch.relu(self.fc(self.emb(idx)))))


def build_model():
    return LM()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, V, (batch_size, T), generator=g)
    return seq, seq


def loss_fn(model, idx, targets):
    logits = model(idx)
    shifted = logits[:, :-1].contiguous().float()
    return F.cross_entropy(shifted.view(-1, V), targets[:, 1:].reshape(-1))
'''


def test_shifted_and_copied_logits_of_a_vocab_parallel_head_stay_each_ranks_slice(tmp_path):
    """The same for a loss that shifts the logits and copies them (`logits[:, :-1].contiguous().float()`): tp 2
    holds half of the (T − 1) rows' logits each, so the transient is half of tp 1's."""
    model = tmp_path / "shifted.py"
    model.write_text(SHIFTED_LOSS)
    reps = []
    for tp in (1, 2):
        plan = tmp_path / f"tp{tp}.par"
        plan.write_text(f"mesh tp={tp}\ntopology nodes=1 gpus_per_node={tp} preset=h100\nbatch global=2 micro=2\n" +
                        ('tensor_parallel {\n "emb" : vocab\n "output" : vocab\n}\n' if tp > 1 else "") +
                        "precision bf16\n")
        reps.append(sized_report(plan, model=model))
    one, two = (r["memory"]["per_pp_rank"][0]["transient_bytes"] for r in reps)
    assert one == 2 * 15 * 96 * 6
    assert two == one / 2


def test_a_replicated_heads_logits_stay_whole_on_every_rank(tmp_path):
    """The other side of the two tests above: with tp 2 but no rule on the head (`fc` column- and `proj`
    row-parallel, `output` replicated: a plan compile accepts), every rank computes all the logits, and the
    loss's cast, copy and cross-entropy count them whole: the transient is tp 1's, not half of it."""
    model = tmp_path / "shifted.py"
    model.write_text(SHIFTED_LOSS)
    plan = tmp_path / "tp2.par"
    plan.write_text("mesh tp=2\ntopology nodes=1 gpus_per_node=2 preset=h100\nbatch global=2 micro=2\n"
                    'tensor_parallel {\n "fc" : column\n "proj" : row\n}\nprecision bf16\n')
    assert sized_report(plan, model=model)["memory"]["per_pp_rank"][0]["transient_bytes"] == 2 * 15 * 96 * 6
