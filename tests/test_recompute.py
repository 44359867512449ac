"""Activation recompute (passes/recompute.py): the rewrite, its numerics, that it
really recomputes and saves less, its refusals, and parallel = serial.

The one-process tests run the compiled program text itself (codegen.load_program)
on state materialized from the same reference model, with and without `recompute`.
The distributed cases are all 2-rank worlds, so they train in ONE spawned world
(`_train_many`, as in tests/test_pipeline.py); spawning costs far more than
training these tiny models.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import GPT, ROOT, compile_text, gpt_tp_rules
from parc import artifact
from parc.analysis import support
from parc.codegen import load_program
from parc.errors import PlanError, TraceError
from parc.grammar.parser import parse
from parc.passes import PassCtx, recompute
from parc.runtime.launch import spawn
from parc.grammar.plan import Recompute
from parc.runtime.checkpoint.state import build_reference, materialize
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module, trace

BASE = "mesh dp=1\nbatch global=2 micro=2\n"
RECOMPUTE = 'recompute "blocks.*"\n'
BLOCKS, LINEARS_PER_BLOCK = 4, 4  # examples/gpt.py: 4 blocks of qkv, attn.proj, mlp.fc, mlp.proj
# fp32, as tests/test_pipeline.py: micro-batch means summed in a different order than the serial
# step's one mean, and (dp) averaged across ranks: ~1e-7 relative on losses, ~1e-5 model-wide on
# parameters after three AdamW steps (Adam magnifies rounding, see tests/test_data_parallel.py).
# A region that dropped a gradient or recomputed different values moves parameters by 1e-2 or more.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


# ---------------------------------------------------------------- one process: the rewrite

@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """The same one-rank plan compiled without and with `recompute "blocks.*"`."""
    tmp = tmp_path_factory.mktemp("recompute")
    plain = compile_text(BASE, tmp / "plain" / "c")
    rec = compile_text(BASE + RECOMPUTE, tmp / "rec" / "c")
    return plain, rec


def _ops(source: str) -> Counter:
    return Counter(re.findall(r"torch\.ops\.aten\.(\w+\.\w+)\(", source))


def test_rewrite_is_visible_in_the_program(programs):
    plain, rec = programs
    src = rec.programs["stage0_tp0"]
    assert "import torch.utils.checkpoint" in src
    assert "torch.utils.checkpoint.checkpoint(" in src and "use_reentrant=False" in src
    forward = src[src.index("def forward("):]
    for i in range(BLOCKS):
        assert src.count(f"def recompute_blocks_{i}(*args)") == 1
        assert src.count(f"def _recompute_blocks_{i}(") == 1
        assert len(re.findall(rf"= recompute_blocks_{i}\(", forward)) == 1  # one call per block
    # forward keeps the embeddings, ln_f, lm_head and the loss, and nothing of a block
    assert "blocks_0_attn_qkv_weight" not in "".join(
        line for line in forward.splitlines() if "aten." in line)
    # the rewrite moves code, it does not change it: the same aten ops, as many times each
    assert _ops(src) == _ops(plain.programs["stage0_tp0"])


def test_pass_records_its_regions():
    traced = trace(load_user_module(GPT), 2)
    ctx = PassCtx(traced=traced)
    gm = recompute.run(copy.deepcopy(traced.gm), parse(BASE + RECOMPUTE), ctx)
    names = [f"blocks_{i}" for i in range(BLOCKS)]
    assert ctx.notes["recompute"] == [f"blocks.{i}" for i in range(BLOCKS)]
    assert sorted(gm.meta[recompute.REGIONS]) == names
    assert all(inst == f"blocks.{i}" for i, (inst, _) in enumerate(gm.meta[recompute.REGIONS].values()))
    calls = [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) in names]
    assert len(calls) == BLOCKS
    assert "recompute_blocks_3(" in gm.code  # as FX prints the call


def test_no_recompute_line_is_a_noop(programs):
    plain, _ = programs
    src = plain.programs["stage0_tp0"]
    assert "checkpoint" not in src and "recompute_" not in src
    # the pass itself: the very graph back, its code unchanged, no regions noted
    traced = trace(load_user_module(GPT), 2)
    gm = copy.deepcopy(traced.gm)
    before = gm.code
    ctx = PassCtx(traced=traced)
    assert recompute.run(gm, parse(BASE), ctx) is gm
    assert gm.code == before and "recompute" not in ctx.notes and recompute.REGIONS not in gm.meta


def test_instance_is_the_outermost_matching_module():
    def instance(path, patterns):
        return Recompute(tuple(patterns)).instance(path)
    assert instance("blocks.3.attn.qkv", ["blocks.*"]) == "blocks.3"
    assert instance("blocks.3.attn.qkv", ["blocks.*.attn", "blocks.*"]) == "blocks.3"
    assert instance("blocks.3.attn.qkv", ["blocks.*.attn"]) == "blocks.3.attn"
    assert instance("lm_head", ["blocks.*"]) is None
    assert instance("", ["blocks.*"]) is None


def _run(art, counting=None, saving=None):
    """Forward + backward of the compiled program on micro-batch 0; returns loss and parameter grads."""
    entries = art.plan["programs"]["stage0_tp0"]["state"]
    user = load_user_module(art.root / "model" / "model.py")
    state = materialize(entries, build_reference(user, 0), torch.device("cpu"))
    forward = load_program(art.programs["stage0_tp0"], torch.device("cpu"))
    batch = user.get_batch(0, 2)
    if saving is not None:
        saving.state = {t.untyped_storage().data_ptr() for t in state}
    with counting or nullcontext(), saving or nullcontext():
        loss = forward(*state, *batch)[0]
    with counting or nullcontext():
        loss.backward()
    grads = {e["fqn"]: t.grad for e, t in zip(entries, state) if t.requires_grad}
    return loss.detach(), grads


def test_loss_and_every_gradient_equal(programs):
    plain, rec = programs
    loss_a, grads_a = _run(plain)
    loss_b, grads_b = _run(rec)
    # same aten ops on the same values in the same order, on CPU, and the recomputed forward
    # reproduces the first one bit for bit: exact equality, not a tolerance
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 2 + 12 * BLOCKS + 3  # wte wpe, blocks, ln_f lm_head
    for name in grads_a:
        assert grads_a[name] is not None and torch.equal(grads_a[name], grads_b[name]), name


class _CountMatmuls(TorchDispatchMode):
    """Counts the matmul kernels a linear becomes below autograd (aten.linear itself is composite)."""

    OPS = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.OPS
        return func(*args, **(kwargs or {}))


def test_backward_runs_each_block_forward_again(programs):
    plain, rec = programs
    fwd = _CountMatmuls()
    _run(plain, counting=fwd)
    forward_only = _CountMatmuls()
    entries = plain.plan["programs"]["stage0_tp0"]["state"]
    user = load_user_module(plain.root / "model" / "model.py")
    state = materialize(entries, build_reference(user, 0), torch.device("cpu"))
    with forward_only:
        load_program(plain.programs["stage0_tp0"], torch.device("cpu"))(*state, *user.get_batch(0, 2))
    # one matmul kernel per linear: 4 per block, and lm_head (wte/wpe are embeddings, attention is sdpa)
    assert forward_only.count == BLOCKS * LINEARS_PER_BLOCK + 1
    # torch stops a region's recompute at the last op whose output backward needs (checkpoint
    # "early stop", on by default): a block's mlp.proj output is not needed (its backward wants
    # its input and weight), so by default 3 of its 4 linears run again
    with_rec = _CountMatmuls()
    _run(rec, counting=with_rec)
    assert with_rec.count - fwd.count == BLOCKS * (LINEARS_PER_BLOCK - 1)
    # without early stop, backward re-runs the whole forward of every recomputed block, and only that
    whole = _CountMatmuls()
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _run(rec, counting=whole)
    assert whole.count - fwd.count == BLOCKS * LINEARS_PER_BLOCK


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of activations autograd packs for backward during forward.

    Tensors that share storage with the program's state (weights, or their transposed
    views saved by a linear) cost no memory of their own and are not counted; a
    checkpointed region packs its inputs only, weights included.
    """

    def __init__(self):
        self.bytes, self.state = 0, set()

        def pack(t):
            if t.untyped_storage().data_ptr() not in self.state:
                self.bytes += t.numel() * t.element_size()
            return t
        super().__init__(pack, lambda t: t)


def test_forward_saves_less(programs):
    plain, rec = programs
    a, b = _SavedBytes(), _SavedBytes()
    _run(plain, saving=a)
    _run(rec, saving=b)
    # without recompute every block saves its activations (layer norm statistics, the qkv output,
    # q/k/v and the attention output, the 4x-wide MLP hidden...); with it a block saves only its
    # input (B, T, C) = 2*32*64 fp32; the rest is the embeddings', ln_f's, lm_head's and the loss's
    block_input = 2 * 32 * 64 * 4
    assert a.bytes - b.bytes > BLOCKS * 8 * block_input, (a.bytes, b.bytes)
    assert 0 < b.bytes < a.bytes / 3, (a.bytes, b.bytes)


# ---------------------------------------------------------------- refusals and errors

ZERO3 = "mesh dp=2\nbatch global=8 micro=2\nzero stage=3\n" + RECOMPUTE


def test_zero3_with_recompute_is_refused(tmp_path):
    with pytest.raises(PlanError) as e:
        support.check(parse(ZERO3, file="t.par"))
    assert "recompute with zero stage=3 is not supported" in e.value.render()
    with pytest.raises(PlanError, match="recompute with zero stage=3"):
        compile_text(ZERO3, tmp_path / "c")  # refused before tracing
    support.check(parse(ZERO3.replace("stage=3", "stage=2"), file="t.par"))  # stage 2 is fine


TWICE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """One block applied twice with an op of the root between: `blocks.0` runs, the root doubles
    its output, and `blocks.0` runs again on that. Its nodes are not one contiguous region."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.blocks[0](x)
        return self.head(self.blocks[0](h * 2.0))


def build_model():
    return Net()


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)
'''


def test_non_convex_region_is_a_trace_error(tmp_path):
    model = tmp_path / "twice.py"
    model.write_text(TWICE)
    with pytest.raises(TraceError) as e:
        compile_text(BASE + RECOMPUTE, tmp_path / "c", model)
    msg = e.value.render() if hasattr(e.value, "render") else str(e.value)
    assert "cannot recompute blocks.0" in msg and "`mul" in msg, msg
    # the same model without recompute compiles
    compile_text(BASE, tmp_path / "ok", model)


# ---------------------------------------------------------------- parallel = serial, one 2-rank world

OPT = "optimizer adamw lr=1e-2 clip=1.0\n"
TP_SP = "mesh tp=2\nbatch global=4 micro=2\n" + OPT + gpt_tp_rules(True)
CASES = {
    "dp2": "mesh dp=2\nbatch global=8 micro=2\n" + OPT + RECOMPUTE,
    "tp2_sp": TP_SP + RECOMPUTE,
    "pp2_1f1b": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=1f1b\n" + OPT + RECOMPUTE,
    "pp2_zb_h1": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=zb_h1\n" + OPT + RECOMPUTE,
    "dp2_zero2": "mesh dp=2\nbatch global=8 micro=2\nzero stage=2\n" + OPT + RECOMPUTE,
    "pp2_interleaved": "mesh pp=2\nbatch global=8 micro=2\npipeline schedule=interleaved_1f1b virtual=2\n"
                       + OPT + RECOMPUTE,  # 4 stages of one block: each program recomputes its block
    # autocast in the rerun; lr 1e-3 as tests/test_bf16_layout.py: at 1e-2 plain bf16 dp=2 already differs from
    # serial bf16 by 7.5e-3 (the same with and without recompute), which would hide a real mistake
    "dp2_bf16": "mesh dp=2\nbatch global=8 micro=2\nprecision bf16\noptimizer adamw lr=1e-3 clip=1.0\n" + RECOMPUTE,
}
# bf16: the serial reference runs under the same autocast; tests/test_bf16_layout.py's bound
BF16_TOL = 2e-3
# dropout 0.1 under tp: the recomputed forward must draw the masks the first forward drew (keyed
# dropout, runtime/dropout.py: a pure function of the key the runtime sets around forward and
# backward). Checked bit for bit against the same plan without `recompute`; tests/test_dropout.py
# checks keyed dropout against the serial model.
DROPOUT_GPT = ROOT / "tests" / "models" / "gpt_dropout.py"
DROPOUT_CASES = {"tp2_drop_plain": TP_SP, "tp2_drop": TP_SP + RECOMPUTE}


def _train_many(ctx, cases: list[tuple[str, str]], steps: int):
    """Train every compiled case in turn, each with its own process groups; rank 0 returns the results."""
    out = {}
    for key, compiled in cases:
        trainer = Trainer.load(compiled, 0)
        local = [trainer.step(s).loss for s in range(steps)]
        losses = trainer.global_losses(local)
        state = trainer.gathered_state()
        if ctx.rank == 0:
            out[key] = {"losses": losses, "state": state}
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recompute_dist")
    paths = {key: str(compile_text(text, tmp / key / "c").root) for key, text in CASES.items()}
    paths.update({key: str(compile_text(text, tmp / key / "c", DROPOUT_GPT).root)
                  for key, text in DROPOUT_CASES.items()})
    results = spawn(2, _train_many, list(paths.items()), 3, timeout=600)[0]
    return results, paths


_SERIAL: dict[str, tuple] = {}


def _serial(compiled: str, steps: int = 3):
    """The serial reference depends only on the batch, optimizer and precision: train it once per kind."""
    art = artifact.load(Path(compiled))
    summary = art.plan["plan"]
    key = json.dumps([summary["batch"]["global"], summary["optimizer"], summary.get("precision")], sort_keys=True)
    if key not in _SERIAL:
        _SERIAL[key] = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, steps)
    return _SERIAL[key]


@pytest.mark.parametrize("key", list(CASES))
def test_recompute_matches_serial(runs, key):
    results, paths = runs
    programs = artifact.load(Path(paths[key])).programs.values()
    assert all("torch.utils.checkpoint.checkpoint(" in p for p in programs)  # every rank really recomputes
    serial_losses, serial_state = _serial(paths[key])
    verdict = compare(results[key]["losses"], serial_losses, results[key]["state"], serial_state)
    bf16 = artifact.load(Path(paths[key])).plan["plan"]["precision"] == "bf16"
    assert verdict.loss_rel < (BF16_TOL if bf16 else LOSS_TOL), verdict.render()
    assert verdict.param_rel < (BF16_TOL if bf16 else PARAM_TOL), verdict.render()
    assert serial_losses[0] != serial_losses[-1]  # it trained


def test_tp_collectives_run_inside_regions(runs):
    """A tensor-parallel block's collectives are part of its region: backward runs them again."""
    src = artifact.load(Path(runs[1]["tp2_sp"])).programs["stage0_tp0"]
    body = src[src.index("def _recompute_blocks_0("):src.index("def recompute_blocks_1(")]
    # sequence parallel: all-gather before qkv and fc, reduce-scatter after attn.proj and mlp.proj
    assert body.count("torch.ops.parc.") == 4, body


def test_dropout_masks_are_recomputed_exactly(runs):
    results, paths = runs
    src = artifact.load(Path(paths["tp2_drop"])).programs["stage0_tp0"]
    for i in range(BLOCKS):  # each block's attention and residual dropouts are re-run inside its region
        body = src[src.index(f"def _recompute_blocks_{i}("):]
        body = body[:body.index("\ndef ")]
        assert "keyed_attention.default(" in body and body.count("keyed_dropout.default(") == 2, body
    plain, rec = results["tp2_drop_plain"], results["tp2_drop"]
    # same ops, same masks, same order: the recomputed run is the plain run, bit for bit
    assert rec["losses"] == plain["losses"]
    assert rec["state"].keys() == plain["state"].keys()
    for name, value in plain["state"].items():
        assert torch.equal(rec["state"][name], value), name
