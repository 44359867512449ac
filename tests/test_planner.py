"""`parc plan` (parc/analysis/planner.py): the search's ranking, its refusals, the written plan, and that the
seed's advice comes out of it rather than being written into it.

One search per model and cluster, module-scoped; the winner for examples/gpt.py on 4 ranks is compiled and
trained against the serial model once.
"""

from __future__ import annotations

import pytest
from helpers import GPT, ROOT, gpt_tp_rules, parallel_vs_serial

from parc import cli
from parc.analysis import planner
from parc.compiler import compile_model
from parc.grammar.parser import load_plan, parse

# GPT-style models by size, on examples/gpt.py's GPT (as bench/gpt3.py builds GPT-3): only ever traced on meta
MODEL = '''import sys
sys.path.insert(0, {examples!r})
from gpt import GPT, GPTConfig, get_batch as _get_batch, loss_fn  # noqa: F401
import torch
CONFIG = GPTConfig(vocab_size={vocab}, block_size={seq}, n_layer={layers}, n_head={heads}, n_embd={width})
def build_model():
    return GPT(CONFIG)
def get_batch(step, batch_size):
    seq = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1))
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
'''


def _model(tmp_path_factory, name: str, **cfg):
    path = tmp_path_factory.mktemp(name) / f"{name}.py"
    path.write_text(MODEL.format(examples=str(ROOT / "examples"), **cfg))
    return path


@pytest.fixture(scope="module")
def tiny():
    """examples/gpt.py on 4 CPU ranks, fp32 (what this machine trains)."""
    return planner.search(GPT, gpus=4, preset="h100", global_batch=8, precision="fp32")


def test_ranking_is_monotone_in_predicted_time(tiny):
    steps = [c.step for c in tiny.ranked]
    assert len(steps) >= 5 and steps == sorted(steps)
    assert all(c.reason is None and c.peak <= tiny.hw.memory for c in tiny.ranked)
    lines = planner.summary(tiny, 5)
    assert "the winner" in lines[-5] and all("step time" in line for line in lines[-4:])


def test_infeasible_candidates_carry_their_reason(tiny):
    reasons = [c.reason for c in tiny.dropped]
    assert reasons and all(reasons)
    # parc refuses ZeRO-3 under a pipeline (parc/analysis/support.py): said, not silently skipped
    assert any(r.startswith("zero stage=3 with pp") for r in reasons)
    assert any(r.startswith("recompute with zero stage=3 is not supported") for r in reasons)
    assert any(r.startswith("bounded out: its step is at least") for r in reasons)


def test_the_search_prices_schedules_of_any_length_parc_compiles():
    """The search once dropped every schedule of more than 4096 slots (pp × virtual × micro-batches) unpriced,
    so it was exact only below that. Now a long schedule is bounded or estimated like any other: with a budget
    nothing can reach, 2 GPUs at global batch 2560 estimate schedules up to pp 2 × 2 virtual × 2560 = 10240
    slots of every kind, each bound below its full estimate, and the default budget keeps the same winner."""
    every = planner.search(GPT, gpus=2, preset="h100", global_batch=2560, precision="fp32", top=10 ** 9)
    assert not any("slots" in (c.reason or "") for c in every.dropped)
    long = [c for c in every.ranked
            if c.plan.mesh.pp > 1 and c.plan.mesh.pp * c.plan.pipeline.virtual * c.plan.accumulation > 4096]
    assert {c.plan.pipeline.schedule for c in long} == {"1f1b", "gpipe", "zb_h1", "interleaved_1f1b"}
    assert max(c.plan.mesh.pp * c.plan.pipeline.virtual * c.plan.accumulation for c in long) == 10240
    for c in long:
        assert c.bound <= c.step * (1 + 1e-9), (c.describe(), c.bound, c.step)
    one = planner.search(GPT, gpus=2, preset="h100", global_batch=2560, precision="fp32", top=1)
    assert one.winner.plan == every.winner.plan and one.winner.step == every.winner.step


def test_tp_rules_derived_from_the_model(tiny):
    derived = {(r.pattern, r.style) for r in tiny.layout.rules if r.style != "replicate"}
    expected = {(r.pattern, r.style) for r in parse("mesh tp=2\n" + gpt_tp_rules()).tensor_parallel.rules}
    assert derived == expected
    assert {r.pattern for r in tiny.layout.rules if r.style == "replicate"} == {"blocks.*.ln_1", "blocks.*.ln_2"}


# what the derived rules must be on HF families written three ways (tests/models): Conv1D projections used as
# `addmm(b, x, w)` (GPT-2); each Megatron pair split over sibling modules, post-LN (BERT); and a norm written out by
# hand between the attention's row layer and the MLP's column layers (Llama's LlamaRMSNorm)
DERIVED = {
    "gpt2_tiny": {"transformer.h.*.attn.c_attn": "column", "transformer.h.*.attn.c_proj": "row",
                  "transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row"},
    "bert_tiny": {"bert.encoder.layer.*.attention.self.query": "column",
                  "bert.encoder.layer.*.attention.self.key": "column",
                  "bert.encoder.layer.*.attention.self.value": "column",
                  "bert.encoder.layer.*.attention.output.dense": "row",
                  "bert.encoder.layer.*.intermediate.dense": "column", "bert.encoder.layer.*.output.dense": "row"},
    "llama_tiny": {"model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
                   "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
                   "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
                   "model.layers.*.mlp.down_proj": "row", "model.embed_tokens": "vocab", "lm_head": "vocab"},
}


@pytest.mark.parametrize("name", DERIVED)
def test_tp_rules_derived_across_conv1d_and_sibling_modules(name):
    from parc.trace import load_user_module, trace

    layout = planner.tp_rules(trace(load_user_module(ROOT / "tests" / "models" / f"{name}.py"), 1))
    assert layout.why_not is None, layout.why_not
    assert {r.pattern: r.style for r in layout.rules if r.style != "replicate"} == DERIVED[name]


def _blocks_model(path, blocks: str):
    """A model file at `path`: `blocks` (Python defining `Block`, a map of (B, 8) to (B, 8)) twice in an
    nn.ModuleList, regressed on random targets."""
    path.write_text("import torch, torch.nn as nn\n" + blocks + '''class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
def build_model():
    return M()
def get_batch(step, batch_size):
    return (torch.randn(batch_size, 8), torch.randn(batch_size, 8))
def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()
''')
    return path


def test_a_siblings_row_output_starts_a_new_pair(tmp_path):
    """A norm module with a low-rank gate inside (fc1 → fc2, as AXK2's gated RMSNorm), read by the attention's
    first linear: fc2 is a row layer, so its output is whole and `attn.q` starts a new pair (column), not the
    second of fc2's."""
    model = _blocks_model(tmp_path / "gated_norm.py", '''class GatedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.fc1, self.fc2 = nn.Linear(8, 4), nn.Linear(4, 8)
    def forward(self, x):
        y = self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y * torch.sigmoid(self.fc2(torch.relu(self.fc1(y))))
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(8, 8), nn.Linear(8, 8)
    def forward(self, x):
        return self.o(torch.tanh(self.q(x)))
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.attn = GatedNorm(), Attn()
    def forward(self, x):
        return x + self.attn(self.norm(x))
''')
    from parc.trace import load_user_module, trace

    layout = planner.tp_rules(trace(load_user_module(model), 1))
    assert {r.pattern: r.style for r in layout.rules} == {
        "blocks.*.norm.fc1": "column", "blocks.*.norm.fc2": "row", "blocks.*.attn.q": "column",
        "blocks.*.attn.o": "row"}


def test_unrecognised_structure_skips_tp_with_reason(tmp_path):
    model = _blocks_model(tmp_path / "one_linear.py", '''class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
    def forward(self, x):
        return x + self.lin(x)
''')
    result = planner.search(model, gpus=2, preset="h100", global_batch=4, precision="fp32")
    assert result.layout.why_not.startswith("no column → row linear pair")
    assert any(c.reason.startswith("tp 2: no column → row") for c in result.dropped)
    assert all(c.plan.mesh.tp == 1 for c in result.ranked)


def test_written_plan_checks_compiles_and_trains_like_serial(tiny, tmp_path, capsys):
    out = tmp_path / "plan.par"
    planner.write(tiny, out, "parc plan examples/gpt.py --gpus 4")
    plan = load_plan(out)
    assert plan == tiny.winner.plan and plan.world_size == 4 and plan.global_batch == 8
    assert cli.main(["check", str(out), "--model", str(GPT), "--world-size", "4"]) == 0
    assert "ok" in capsys.readouterr().out
    compile_model(GPT, plan, tmp_path / "compiled")
    verdict = parallel_vs_serial(tmp_path / "compiled", steps=2)
    assert verdict.ok, verdict.report()
    # never replaced unless told to
    before = out.read_text()
    code = cli.main(["plan", str(GPT), "--gpus", "4", "--global-batch", "8", "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "exists: parc plan does not overwrite" in err and out.read_text() == before


@pytest.mark.parametrize("argv, said", [
    (["--gpus", "12", "--nodes", "5", "--global-batch", "8"],
     "--gpus 12 is not divisible by --nodes 5: 12 = 2 × 5 + 2"),
    (["--gpus", "12", "--global-batch", "8"], "--gpus 12 do not fill whole H100-80GB nodes of 8: 12 = 1 × 8 + 4"),
    (["--gpus", "4", "--global-batch", "0"], "--global-batch 0: need at least 1 sample per step"),
    # 256 GPUs now have a plan at global batch 2 (dp 2 × tp 2 × pp 4 × cp 16); 1024 do not: dp ≤ 2, tp and pp ≤ 4
    # (4 heads, 4 layers), cp ≤ 16 (sequence 32 over 2·cp chunks), so at most 2 × 4 × 4 × 16 = 512 ranks
    (["--gpus", "1024", "--global-batch", "2"], "no plan for 1024 GPUs and global batch 2"),
])
def test_bad_input_is_one_clear_line(argv, said, capsys):
    assert cli.main(["plan", str(GPT), *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


@pytest.fixture(scope="module")
def gpt_1b(tmp_path_factory):
    return _model(tmp_path_factory, "gpt_1b", vocab=50304, seq=2048, layers=24, heads=16, width=2048)


def test_small_model_on_one_node_is_data_parallel(tmp_path_factory):
    """GPT-2 124M on 8 H100s: the model and its optimizer fit on one GPU, so no plan needs tp or pp for
    memory; tp would add an all-reduce of the activations per layer and pp a bubble, while dp's one
    gradient all-reduce of 124M × 4 bytes over NVLink is ~2 ms. The cost model therefore ranks pure dp
    first; the planner is not told so."""
    model = _model(tmp_path_factory, "gpt2", vocab=50304, seq=1024, layers=12, heads=12, width=768)
    result = planner.search(model, gpus=8, preset="h100", global_batch=64)
    m = result.winner.plan.mesh
    assert (m.dp, m.tp, m.pp) == (8, 1, 1), result.winner.describe()


@pytest.mark.parametrize("gpus, per_node", [(8, 4), (16, 8)])
def test_multi_node_winner_keeps_tp_inside_a_node(gpt_1b, gpus, per_node):
    """H100s on 2 nodes: a tp group wider than a node runs its per-layer all-reduces over the node's NICs
    (per_node × 50 GB/s for the group: cost._collective) instead of NVLink's 370 GB/s, and holds them while
    dp needs them, so the best plans keep their tp group (innermost, adjacent ranks) within one node, although
    tp = the GPUs divides every width of the model: those plans are priced, and lose."""
    result = planner.search(gpt_1b, gpus=gpus, nodes=2, preset="h100", global_batch=32)
    assert not any(c.reason.startswith(f"tp {gpus} does not divide") for c in result.dropped)
    assert any(c.plan.mesh.tp == gpus for c in result.ranked)
    for c in result.ranked[:5]:
        m = c.plan.mesh
        assert m.tp <= per_node and per_node % m.tp == 0 and c.plan.mesh.order[0] == "tp", c.describe()


def test_assembled_stats_carry_recompute_all_reduces():
    """The search assembles a candidate's statistics from per-layer ones; the row layers' all-reduces a
    recomputed block runs again (cost.graph_stats' tp_*_recomputed) add up like the other tp counts, so
    the planner prices them as `parc report` does."""
    from parc.grammar.plan import Batch, Plan
    from parc.passes.pipeline_split import _layer_prefix
    from parc.trace import load_user_module, trace

    traced = trace(load_user_module(GPT), 1)
    stats = planner._Stats(traced, Plan(batch=Batch(1, 1), precision="fp32"), planner.tp_rules(traced),
                           _layer_prefix(traced.module_paths, traced.num_layers))
    variant = (True, True, False, False)          # recompute, tp rules, no SP, no bf16 casts
    whole = stats.get(1, variant, 2)["stages"][0]
    split = stats.get(2, variant, 2)["stages"]
    assert whole["tp_ops_recomputed"] == 2 * traced.num_layers     # attn.proj, mlp.proj per block
    assert sum(s["tp_ops_recomputed"] for s in split) == whole["tp_ops_recomputed"]
    assert sum(s["tp_bytes_recomputed"] for s in split) == whole["tp_bytes_recomputed"] > 0
    assert stats.get(1, (False, True, False, False), 2)["stages"][0]["tp_ops_recomputed"] == 0


def test_equal_stages_are_one_dict_so_the_cost_model_prices_them_once(tmp_path_factory):
    """The stage-cost memo of a search is keyed by identity (cost.estimate's `stage_times`): the per-layer stages
    between the embedding's and the head's are equal, so the planner hands out one dict for all of them, and cp's
    local statistics of them stay one dict too. The groups of a split alike: equal groups, one dict."""
    from parc.analysis import cp_cost
    from parc.grammar.plan import Batch, Plan
    from parc.passes.pipeline_split import _layer_prefix
    from parc.trace import load_user_module, trace

    eight = _model(tmp_path_factory, "eight", vocab=128, seq=32, layers=8, heads=4, width=64)
    traced = trace(load_user_module(eight), 1)
    stats = planner._Stats(traced, Plan(batch=Batch(1, 1), precision="fp32"), planner.tp_rules(traced),
                           _layer_prefix(traced.module_paths, traced.num_layers))
    variant = (False, True, False, False)
    per_layer = stats.get(traced.num_layers, variant, 2)["stages"]
    first, *middle, last = per_layer
    assert len(middle) >= 2 and all(s is middle[0] for s in middle)
    assert first != middle[0] and last != middle[0]            # the embedding's and the head's layers differ
    local = cp_cost.local_stats({"stages": per_layer}, 2)["stages"]
    assert all(s is local[1] for s in local[1:-1]) and local[1]["flops_sharded"] == middle[0]["flops_sharded"] / 2
    groups = stats.get(4, variant, 2)["stages"]   # two layers a stage
    assert len(groups) == 4 and groups[2] is groups[1] and groups[0] is not groups[1]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_search_leaves_the_garbage_collector_as_it_found_it(enabled):
    """The collector is paused while a search runs (`_collector_paused`) and left as it was, on an error too."""
    import gc

    @planner._collector_paused()
    def refused():
        assert not gc.isenabled()
        raise planner.ParcError("refused")

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(planner.ParcError):
            refused()
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_compiles_refusals_of_one_tensor_parallel_layout_are_run_once(monkeypatch):
    """A model tensor parallelism cannot shard (bench/llama_sized.py's `fused_ops`: a custom rotary op with no
    sharding rule) refuses every plan with that layout in the whole-graph passes. `pass_errors` keeps those
    refusals by what those passes read (`whole_pass_key`): a plan differing only in dp, pp, ZeRO or recompute
    gets the same refusal without the passes running again, and the planner's loop over its ranked plans pays
    for them once (Nemotron-4 340B on 128 H100s: 613 plans, 171 s before this, 32 s after)."""
    from parc import compiler
    from parc.grammar.plan import Batch, Mesh, Plan, Recompute, TensorParallel, Zero
    from parc.passes.pipeline_split import assign_stages
    from parc.trace import load_user_module, trace

    monkeypatch.setenv("PARC_BENCH_LLAMA", "2,64,4,2,128,100,16,fused_ops")
    traced = trace(load_user_module(ROOT / "bench" / "llama_sized.py"), 1)
    rules = TensorParallel(planner.tp_rules(traced).rules)
    base = Plan(mesh=Mesh(dp=2, tp=2), batch=Batch(4, 2), tensor_parallel=rules)
    other = Plan(mesh=Mesh(dp=1, tp=2), batch=Batch(2, 2), tensor_parallel=base.tensor_parallel, zero=Zero(1),
                 recompute=Recompute(("layers.*",)))
    assert compiler.whole_pass_key(base) == compiler.whole_pass_key(other)
    refusals: dict = {}
    assign_stages(traced, base, 1)
    first = compiler.pass_errors(traced, base, refusals)
    assert first and "fused_rope" in first[0].message and list(refusals.values()) == [first]

    def never(*args, **kwargs):
        raise AssertionError("the passes ran again")

    monkeypatch.setattr(compiler, "compile_program", never)
    assert compiler.pass_errors(traced, other, refusals) is first
    assert planner._pass_refusal(traced, other, refusals) == first[0].message
    # a plan the passes accept is not kept: tp 1 has another key, and runs them
    monkeypatch.undo()
    plain = Plan(mesh=Mesh(dp=4), batch=Batch(4, 1))
    assert compiler.pass_errors(traced, plain, refusals) == [] and len(refusals) == 1


def test_stage_cuts_find_each_layers_first_node_in_one_pass():
    """pipeline_split's auto split finds where each layer starts in one pass over the module paths, as the scan
    per layer did; a layer that runs nothing is one clear error."""
    from parc.errors import ParcError
    from parc.passes.pipeline_split import _layer_starts

    paths = ["emb", "layers.0.attn", "layers.0.mlp", "layers.1", "layers.1.mlp", "layers.10.x", "layers.2.a",
             "layers.2", "norm"]
    layers = 3
    assert _layer_starts(paths, "layers", layers) == [
        next(k for k, p in enumerate(paths) if p == f"layers.{i}" or p.startswith(f"layers.{i}."))
        for i in range(1, layers)] == [3, 6]
    with pytest.raises(ParcError, match="layers.3 runs no operation"):
        _layer_starts(paths, "layers", 4)
