"""Real training runs (issue 16): per-rank data, the lr schedule, weight-decay groups, eval, resume.

One compiled plan (tests/models/gpt_samples.py: get_samples, a held-out split; dp 2, ZeRO-3 — the
flat ranges that mix decayed and undecayed parameters; AdamW with weight decay, warmup and cosine
decay) is trained once on 2 gloo ranks: 4 steps with a checkpoint after 2, then a second trainer
resumes from it. That one run is checked against the serial model on the same samples (losses,
final parameters, eval loss), against itself (resume is exact), and for what each rank read.
The units (schedule, classes, ranges, sampler, token file, plan errors) run in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import ROOT, compile_text
from parc.errors import ParcError
from parc.grammar.parser import parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate
from parc.runtime import param_groups
from parc.runtime.data import Sampler, TokenFile
from parc.runtime.launch import spawn
from parc.runtime.schedule_lr import lr_at

MODEL = ROOT / "tests" / "models" / "gpt_samples.py"
OPT = "optimizer adamw lr=3e-3 weight_decay=0.5 warmup=2 decay=cosine decay_steps=5 min_lr=1e-4"
PLAN = f"mesh dp=2\nbatch global=8 micro=2\nzero stage=3\n{OPT}\n"
STEPS, EVAL_BATCHES = 4, 2


# --- units --------------------------------------------------------------------------------------------

def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = {"lr": 1.0, "warmup": 4, "decay": "cosine", "decay_steps": 8, "min_lr": 0.1}
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 6) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr_at(cfg, 8) == lr_at(cfg, 100) == 0.1
    assert lr_at({**cfg, "decay": "linear"}, 7) == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr_at({"lr": 0.3}, 50) == 0.3  # plan.json of an older compile: constant


def test_weight_decay_classes_of_gpt():
    from parc.trace import load_user_module

    classes = param_groups.classify(load_user_module(ROOT / "examples" / "gpt.py").build_model())
    assert classes["wte.weight"] == classes["wpe.weight"] == "embedding"
    assert classes["blocks.0.attn.qkv.bias"] == "bias" and classes["blocks.0.ln_1.weight"] == "norm"
    assert classes["blocks.0.attn.qkv.weight"] is None and classes["lm_head.weight"] is None
    assert param_groups.decays(classes, {"weight_decay": 0.1, "no_decay": ["none"]}) == {f: True for f in classes}
    assert param_groups.decays(classes, {"weight_decay": 0.0}) == {f: True for f in classes}  # nothing to split
    only_bias = param_groups.decays(classes, {"weight_decay": 0.1, "no_decay": ["bias"]})
    assert not only_bias["blocks.0.attn.qkv.bias"] and only_bias["wte.weight"] and only_bias["blocks.0.ln_1.weight"]


def test_a_tied_embedding_is_an_embedding_under_both_names():
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 3)
    model.head = torch.nn.Linear(3, 5, bias=False)
    model.head.weight = model.emb.weight
    assert param_groups.classify(model) == {"emb.weight": "embedding", "head.weight": "embedding"}


def test_zero_range_runs_split_by_decay_and_state_round_trips():
    # bucket: a (6 elements, decayed), b (3, not), c (5, decayed), padded to 16; dp 2 → ranges of 8
    bucket = {"shard": 8, "params": [{"name": "a", "offset": 0, "numel": 6}, {"name": "b", "offset": 6, "numel": 3},
                                     {"name": "c", "offset": 9, "numel": 5}]}
    decay = {"a": True, "b": False, "c": True}
    r0 = param_groups.RangeGroups([torch.arange(8.0)], [bucket], 0, decay)
    r1 = param_groups.RangeGroups([torch.arange(8.0, 16.0)], [bucket], 1, decay)
    assert r0.runs == [[(0, 6, True), (6, 8, False)]]
    assert r1.runs == [[(0, 1, False), (1, 8, True)]]  # b's last element, then c and the padding
    groups = r1.groups()
    assert [g.get("weight_decay") for g in groups] == [None, 0.0] and groups[1]["params"][0].tolist() == [8.0]
    opt = torch.optim.AdamW(groups, lr=0.1, weight_decay=0.5)
    r1.master[0].grad = torch.ones(8)
    r1.bind_grads()
    opt.step()
    state = r1.state(opt, 0)
    assert state["exp_avg"].shape == (8,) and state["step"].item() == 1
    fresh = torch.optim.AdamW(param_groups.RangeGroups([torch.zeros(8)], [bucket], 1, decay).groups(), lr=0.1)
    r2 = param_groups.RangeGroups([torch.zeros(8)], [bucket], 1, decay)
    r2.set_state(fresh, 0, state)
    assert torch.equal(r2.state(fresh, 0)["exp_avg_sq"], state["exp_avg_sq"])


def test_sampler_is_a_pure_function_of_seed_and_position():
    s = Sampler(10, seed=3)
    first = s.indices(torch.arange(0, 10))
    assert sorted(first.tolist()) == list(range(10))  # an epoch is a permutation
    assert not torch.equal(first, s.indices(torch.arange(10, 20)))  # the next epoch another one
    assert torch.equal(Sampler(10, seed=3).indices(torch.arange(7, 13)), torch.cat([first[7:], s.indices(torch.arange(10, 13))]))
    assert Sampler(None, seed=3).indices(torch.arange(5, 8)).tolist() == [5, 6, 7]


def test_token_file_samples_are_shifted_windows(tmp_path):
    tokens = np.arange(50, dtype=np.uint16)
    tokens.tofile(tmp_path / "t.bin")
    f = TokenFile(tmp_path / "t.bin", "uint16", 8)
    assert f.n == (50 - 1) // 8
    x, y = f(torch.tensor([2, 0]))
    assert x.dtype == torch.int64 and x[0].tolist() == list(range(16, 24)) and y[0].tolist() == list(range(17, 25))
    assert x[1].tolist() == list(range(8))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ParcError, match="3 bytes is not a whole number of uint16 tokens"):
        TokenFile(tmp_path / "odd.bin", "uint16", 8)


@pytest.mark.parametrize("text, message, at", [  # `at`: the key whose value the error points at
    ("optimizer adamw warmup=-1", "optimizer warmup must be a number of steps ≥ 0, got -1", "warmup="),
    ("optimizer adamw decay=cosin decay_steps=9", "unknown lr decay `cosin`", "decay="),
    ("optimizer adamw decay=cosine", "decay=cosine needs decay_steps=N", "decay="),
    ("optimizer adamw warmup=10 decay=linear decay_steps=10", "decay_steps 10 must be > warmup 10", "decay_steps="),
    ("optimizer adamw lr=1e-3 decay=cosine decay_steps=9 min_lr=0.1", "min_lr must lie in [0, lr 0.001]", "min_lr="),
    ("optimizer adamw min_lr=0.0001", "min_lr needs decay=linear or decay=cosine", "min_lr="),
    ("optimizer adamw no_decay=bias,norms", "unknown no_decay class `norms`", "no_decay="),
])
def test_schedule_mistakes_are_located(text, message, at):
    with pytest.raises(ParcError) as info:
        validate(parse("mesh dp=1\n" + text + "\n", file="s.par"))
    diags = info.value.diagnostics
    assert len(diags) == 1 and message in diags[0].message, [d.message for d in diags]
    assert (diags[0].span.line, diags[0].span.col) == (2, text.index(at) + len(at) + 1)


def test_schedule_round_trips_through_the_printer():
    plan = parse("mesh dp=1\n" + OPT + " no_decay=bias,norm\n", file="s.par")
    assert plan.optimizer.no_decay == ("bias", "norm") and plan.optimizer.decay_steps == 5
    assert parse(format_plan(plan), file="s.par").optimizer == plan.optimizer


def test_tensorboard_missing_is_one_line(monkeypatch, tmp_path):
    from parc.runtime.metrics import tensorboard_writer

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were absent
    with pytest.raises(ParcError, match="the `tensorboard` package is not installed; pip install tensorboard"):
        tensorboard_writer(tmp_path / "tb")


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from parc.runtime.metrics import Metrics

    m = Metrics(3, tmp_path / "m.jsonl", enabled=True, tensorboard=tmp_path / "tb")
    m.log(0, 2.5, 100.0, 0.1, advance=1, lr=1e-3, grad_norm=0.5)
    m.log_eval(0, 2.25, 4)
    m.close()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[0]["lr"] == 1e-3 and records[0]["grad_norm"] == 0.5 and records[1] == {"step": 0, "val_loss": 2.25}
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "val_loss"} <= set(events.Tags()["scalars"])
    assert events.Scalars("val_loss")[0].value == 2.25


# --- one distributed run, checked several ways ----------------------------------------------------------

def _run_body(ctx, compiled: str, ckpt: str):
    from parc.runtime import checkpoint
    from parc.runtime.data import source_for
    from parc.runtime.evaluate import eval_loss
    from parc.runtime.train import Trainer

    t = Trainer.load(compiled, 0)
    requests = t.user.module.REQUESTS
    requests.clear()
    local, lrs = [], []
    for s in range(STEPS):
        r = t.step(s, want_norm=True)
        local.append(r.loss)
        lrs.append(r.lr)
        if s + 1 == 2:
            checkpoint.save(t, ckpt, 2)
    mine = [list(q) for q in requests]
    val = source_for(t.user, t.entry["inputs"], t.global_batch, 0, None, val=True)
    out = {"losses": t.global_losses(local), "lrs": lrs, "requests": mine, "eval": eval_loss(t, val, EVAL_BATCHES),
           "norm": float(r.grad_norm), "state": t.gathered_state()}
    again = Trainer.load(compiled, 0)
    step, line = checkpoint.resume(again, f"{ckpt}/step_2")
    out["resumed"] = (step, line, again.global_losses([again.step(s).loss for s in range(step, STEPS)]),
                      again.gathered_state())
    return out if ctx.rank == 0 else {"requests": mine}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    art = compile_text(PLAN, tmp / "c", model=MODEL)
    out = spawn(2, _run_body, str(art.root), str(tmp / "ckpt"))
    return art, out


def test_per_rank_samples_zero3_decay_groups_and_schedule_match_serial(run):
    from parc.runtime.data import source_for
    from parc.runtime.evaluate import serial_eval_loss
    from parc.runtime.verify import compare, train_serial
    from parc.trace import load_user_module

    art, out = run
    user = load_user_module(art.root / "model" / "model.py")
    data = source_for(user, art.plan["programs"][art.plan["ranks"][0]["program"]]["inputs"], 8, 0, None)
    losses, state = train_serial(user, art.plan, 0, STEPS, data.whole)
    verdict = compare(out[0]["losses"], losses, out[0]["state"], state)
    assert verdict.ok, verdict.render()  # DEFAULT_TOLERANCE 1e-4: summation order only (runtime/verify.py)
    assert out[0]["lrs"] == [lr_at(art.plan["plan"]["optimizer"], s) for s in range(STEPS)]
    assert out[0]["lrs"][:2] == [1.5e-3, 3e-3]
    # each rank asked only for its own 4 rows per step (micro 2 × accumulation 2), never the global 8
    for rank, got in enumerate(r["requests"] for r in out):
        want = [data.sampler.indices(torch.arange(8 * s + 4 * rank, 8 * s + 4 * rank + 4)).tolist() for s in range(STEPS)]
        assert got == want, (rank, got)
    val = source_for(user, [], 8, 0, None, val=True)
    serial_eval = serial_eval_loss(user, _model_with(user, state), val.whole, EVAL_BATCHES)
    # the eval runs on the parallel weights, the serial eval on the serial ones (1e-4 apart, above)
    assert abs(out[0]["eval"] - serial_eval) / serial_eval < 1e-4, (out[0]["eval"], serial_eval)
    assert out[0]["norm"] > 0


def _model_with(user, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The user's model holding `state` (train_serial's trained parameters, by every FQN)."""
    from parc.runtime.checkpoint.state import build_reference

    model = build_reference(user, 0)
    model.load_state_dict(state, strict=False)
    return model


def test_resume_continues_the_sample_stream_exactly(run):
    _, out = run
    step, line, losses, state = out[0]["resumed"]
    assert step == 2 and line.startswith("resumed from step 2 of "), line
    assert "saved under plan test.par (sha256 " in line and "(next sample 16 of get_samples)" in line, line
    assert losses == out[0]["losses"][2:]  # exact: the same samples, optimizer state and schedule
    assert all(torch.equal(state[k], out[0]["state"][k]) for k in state)


def test_parc_run_trains_on_a_token_file_with_eval_and_verify(run, tmp_path):
    art, _ = run
    rng = np.random.default_rng(0)
    rng.integers(0, 256, 4000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 256, 800, dtype=np.uint16).tofile(tmp_path / "val.bin")
    metrics = tmp_path / "m.jsonl"
    cmd = [str(ROOT / ".venv" / "bin" / "torchrun") if (ROOT / ".venv" / "bin" / "torchrun").exists() else "torchrun",
           "--nproc-per-node", "2", "-m", "parc.run", str(art.root), "--steps", "3", "--data",
           str(tmp_path / "train.bin"), "--val-data", str(tmp_path / "val.bin"), "--eval-every", "2",
           "--eval-batches", "1", "--verify", "--metrics", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verify PASS" in done.stdout and "train.bin (uint16 tokens, 124 samples" in done.stdout, done.stdout
    assert "eval after 2 steps: val loss" in done.stdout and "eval after 3 steps: val loss" in done.stdout
    assert "step      0  loss " in done.stdout and "  lr 0.0015  grad norm " in done.stdout, done.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["lr"] for r in steps] == [lr_at(art.plan["plan"]["optimizer"], s) for s in range(3)]
    assert all(r["grad_norm"] > 0 for r in steps) and sum("val_loss" in r for r in records) == 2


# --- pipeline: eval forward-only, decay groups on stages ------------------------------------------------

def _pp_body(ctx, compiled: str):
    from parc.runtime.data import source_for
    from parc.runtime.evaluate import eval_loss
    from parc.runtime.train import Trainer

    t = Trainer.load(compiled, 0)
    val = source_for(t.user, t.entry["inputs"], t.global_batch, 0, None, val=True)
    local = [t.step(s, want_norm=True).loss for s in range(2)]
    out = {"losses": t.global_losses(local), "eval": eval_loss(t, val, EVAL_BATCHES), "state": t.gathered_state()}
    return out if ctx.rank == 0 else None


def test_pipeline_eval_and_decay_groups_match_serial(tmp_path):
    from parc.runtime.data import source_for
    from parc.runtime.evaluate import serial_eval_loss
    from parc.runtime.verify import compare, train_serial
    from parc.trace import load_user_module

    art = compile_text(f"mesh pp=2\nbatch global=4 micro=2\n{OPT}\n", tmp_path / "pp", model=MODEL)
    out = spawn(2, _pp_body, str(art.root))[0]
    user = load_user_module(art.root / "model" / "model.py")
    data = source_for(user, [], 4, 0, None)
    losses, state = train_serial(user, art.plan, 0, 2, data.whole)
    verdict = compare(out["losses"], losses, out["state"], state)
    assert verdict.ok, verdict.render()  # DEFAULT_TOLERANCE 1e-4: summation order only (runtime/verify.py)
    serial_eval = serial_eval_loss(user, _model_with(user, state), source_for(user, [], 4, 0, None, val=True).whole, EVAL_BATCHES)
    # forward only through both stages; 1e-4 as above (the weights are the two runs' own)
    assert abs(out["eval"] - serial_eval) / serial_eval < 1e-4, (out["eval"], serial_eval)


@pytest.mark.parametrize("args, message", [
    (["--val-data", "v.bin"], "error: --val-data v.bin is read only by evals: add --eval-every N"),
    (["--eval-every", "0"], "error: --eval-every 0 --eval-batches 4: both must be ≥ 1"),
])
def test_eval_flags_refused_in_one_line(run, monkeypatch, capsys, args, message):
    from parc.run import main as run_main

    art, _ = run
    monkeypatch.setenv("RANK", "0")  # as torchrun would: refused before any process group
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_main([str(art.root), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
