"""Pretrained weights per shard (runtime/checkpoint/weights.py, parc/pretrained.py): each rank reads only its own
slices of a safetensors checkpoint, and training from them equals the serial model loaded whole from the
same file. Also: `from_pretrained` inside build_model compiles and trains, reading the checkpoint per
shard; a file, a sharded directory with its index and an HF directory all load."""

from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import save_file

from helpers import ROOT, compile_text, llama_tp_rules
from parc import artifact, cli
from parc.errors import LaunchError, ParcError
from parc.export_hf import export_hf
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.checkpoint.state import build_reference, shard
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.runtime.checkpoint.weights import Weights, reference
from parc.trace import load_user_module

MODELS = ROOT / "tests" / "models"
TIED_GPT, LLAMA = MODELS / "gpt_tied.py", MODELS / "llama_tiny.py"
# fp32: the same tolerances and reasons as tests/test_tp_tied.py (tp and dp sum in another order; Adam
# magnifies the rounding of near-zero gradients). A wrong slice read from the file starts the run from
# other weights and is off by 1e-1 or more in the first loss.
LOSS_TOL = 1e-5
PARAM_TOL = 1e-4


def _plan(mesh: str, rules: str = "", tail: str = "") -> str:
    return f"mesh {mesh}\nbatch global=4 micro=2\noptimizer adamw lr=1e-2 clip=1.0\n" + rules + tail


def _body(ctx, compiled: str, steps: int, weights, save_to):
    trainer = Trainer.load(compiled, 0, weights)
    local = [trainer.step(s).loss for s in range(steps)]
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    if save_to:
        checkpoint.save(trainer, save_to, steps)
    src = str(trainer.weights.path) if trainer.weights else None
    return {"losses": losses, "state": state if ctx.rank == 0 else None, "read": trainer.weights.bytes_read,
            "source": src}


def _train(compiled, weights, steps: int = 2, save_to=None):
    """Parallel and serial from the same weights: (verdict, what each rank returned)."""
    runs = spawn(artifact.load(compiled).world_size, _body, str(compiled), steps, weights, save_to and str(save_to))
    user = load_user_module(compiled / "model" / "model.py")
    serial_losses, serial_state = train_serial(user, artifact.load(compiled).plan, 0, steps, weights=weights)
    verdict = compare(runs[0]["losses"], serial_losses, runs[0]["state"], serial_state)
    assert verdict.loss_rel < LOSS_TOL and verdict.param_rel < PARAM_TOL, verdict.render()
    return verdict, runs


@pytest.fixture(scope="module")
def gpt_file(tmp_path_factory):
    """The tied GPT's weights under seed 7 (training runs under seed 0: the weights must come from the file),
    saved as HF does a tied pair: once, here under the name the trace does not keep (`wte.weight`)."""
    user = load_user_module(TIED_GPT)
    model = build_reference(user, 7)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = tmp_path_factory.mktemp("w") / "gpt.safetensors"
    save_file(sd, str(path))
    return path, sum(v.numel() * v.element_size() for v in sd.values())


def test_serial_reference_loads_the_file(gpt_file):
    path, _ = gpt_file
    user = load_user_module(TIED_GPT)
    loaded, own = reference(user, 0, path), build_reference(user, 0)
    assert torch.equal(loaded.lm_head.weight, build_reference(user, 7).wte.weight)  # through the tie
    assert not torch.equal(loaded.blocks[0].attn.qkv.weight, own.blocks[0].attn.qkv.weight)


@pytest.mark.parametrize("spec", [None, {"dim": 0, "parts": 2, "index": 1},               # column / vocab
                                  {"dim": 0, "parts": 2, "index": 0, "blocks": 3},  # a fused qkv's 3 blocks
                                  {"dim": 1, "parts": 2, "index": 1}])              # row
def test_reads_are_the_shards_and_ranges_of_the_whole(gpt_file, spec):
    """Weights.read / read_range give exactly runtime/checkpoint/state.py's `shard` of the whole tensor (and ZeRO-3's
    flat ranges of it), reading only those elements' rows."""
    path, _ = gpt_file
    whole = build_reference(load_user_module(TIED_GPT), 7).blocks[0].attn.qkv.weight.detach()  # (192, 64)
    mine = shard(whole, spec)
    w = Weights.open(path)
    assert torch.equal(w.read("blocks.0.attn.qkv.weight", [192, 64], spec), mine)
    assert w.bytes_read == mine.numel() * 4
    for a, e in [(0, 1), (70, 1000), (mine.numel() - 5, mine.numel())]:
        w.bytes_read = 0
        assert torch.equal(w.read_range("blocks.0.attn.qkv.weight", [192, 64], spec, a, e), mine.reshape(-1)[a:e])
        rows = -(-e // mine.shape[1]) - a // mine.shape[1]
        assert w.bytes_read == rows * mine.shape[1] * 4  # only the rows holding the range


def test_zero3_dp2_reads_only_its_ranges(gpt_file, tmp_path):
    """ZeRO-3 over dp=2: each rank reads its half of every flat bucket, the tied table through its other
    name; training equals the serial model loaded from the file."""
    path, total = gpt_file
    art = compile_text(_plan("dp=2", "", "zero stage=3\n"), tmp_path / "c", TIED_GPT)
    verdict, runs = _train(art.root, path)
    assert verdict.serial_losses[0] != verdict.serial_losses[-1]  # it trained
    for r in runs:
        # half of each bucket, plus the rows a range boundary cuts through (row granularity)
        assert r["read"] < 0.6 * total, (r["read"], total)
    assert sum(r["read"] for r in runs) < 1.1 * total


def test_pp2_stage_reads_only_its_params(gpt_file, tmp_path):
    """Each stage reads its blocks; the tied table is read by both ends (embedding and head)."""
    path, total = gpt_file
    art = compile_text(_plan("pp=2", "", "pipeline schedule=1f1b\n"), tmp_path / "c", TIED_GPT)
    _, runs = _train(art.root, path)
    for r in runs:
        assert r["read"] < 0.75 * total, (r["read"], total)


HF_MODEL = """
    import sys
    sys.path.insert(0, {models!r})
    from transformers import AutoModelForCausalLM
    from llama_tiny import get_batch, loss_fn

    def build_model():
        return AutoModelForCausalLM.from_pretrained({ckpt!r})
"""


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A tiny Llama saved with save_pretrained in shards (its index names the files) under seed 3, a model
    file whose build_model calls from_pretrained on it, compiled for tp=2 and trained 2 steps without
    --weights, then checkpointed."""
    user = load_user_module(LLAMA)
    root = tmp_path_factory.mktemp("hf")
    ckpt = root / "ckpt"
    build_reference(user, 3).save_pretrained(ckpt, max_shard_size="100KB")
    model_file = root / "pretrained.py"
    model_file.write_text(textwrap.dedent(HF_MODEL.format(models=str(MODELS), ckpt=str(ckpt))))
    art = compile_text(_plan("tp=2", llama_tp_rules()), root / "c", model_file)
    verdict, runs = _train(art.root, None, save_to=root / "saved")
    return {"ckpt": ckpt, "compiled": art.root, "saved": root / "saved", "verdict": verdict, "runs": runs}


def test_from_pretrained_in_build_model_compiles_and_reads_per_shard(hf_run):
    ckpt, runs = hf_run["ckpt"], hf_run["runs"]
    assert (ckpt / "model.safetensors.index.json").is_file() and len(list(ckpt.glob("*.safetensors"))) > 1
    total = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert all(r["source"] == str(ckpt) for r in runs)  # no --weights: the directory build_model names
    assert all(r["read"] < 0.6 * total for r in runs)  # half of every sharded tensor; norms whole


LAZY = """
import sys, types
from parc.pretrained import build_skeleton
sys.path.insert(0, {examples!r})
import gpt
plain = types.SimpleNamespace(build_model=gpt.build_model)
build_skeleton(plain)
print("plain imported transformers:", "transformers" in sys.modules)

def build_model():  # transformers imported inside build_model, not by the file
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained({ckpt!r})

model, paths = build_skeleton(types.SimpleNamespace(build_model=build_model))
print("paths:", [str(p) for p in paths], "meta:", all(p.is_meta for p in model.parameters()))
"""


def test_from_pretrained_is_a_config_even_when_build_model_imports_transformers(hf_run, tmp_path):
    """A model that never imports transformers does not pay for importing it (seconds a rank: parc/pretrained.py);
    one whose build_model imports it itself still gets `from_pretrained` as a config (the import hook), so no
    weights are read into the skeleton. A fresh interpreter: this process has imported transformers."""
    import subprocess
    import sys

    script = LAZY.format(examples=str(ROOT / "examples"), ckpt=str(hf_run["ckpt"]))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "plain imported transformers: False" in r.stdout
    assert f"paths: ['{hf_run['ckpt']}'] meta: True" in r.stdout, r.stdout


def test_export_hf_directory_loads_in_transformers(hf_run, tmp_path):
    """parc export --hf: config.json + safetensors shards + index; AutoModelForCausalLM.from_pretrained gives
    the trained parc model's logits."""
    from transformers import AutoModelForCausalLM

    out = export_hf(hf_run["saved"], tmp_path / "hf", hf_run["compiled"], max_shard_size=60_000)
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    user = load_user_module(LLAMA)
    trained = build_reference(user, 0).eval()
    trained.load_state_dict(hf_run["runs"][0]["state"])  # the parallel run's parameters, gathered
    idx = user.get_batch(0, 4)[0]
    with torch.no_grad():
        # the same module code on the same values: equal up to kernel choice (sdpa) and load order
        torch.testing.assert_close(loaded(input_ids=idx).logits, trained(input_ids=idx).logits,
                                   rtol=1e-6, atol=1e-6)
    one = export_hf(hf_run["saved"], tmp_path / "one", hf_run["compiled"])  # under the default limit
    assert sorted(p.name for p in one.iterdir() if p.suffix == ".safetensors") == ["model.safetensors"]


def test_export_hf_refusals(hf_run, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ParcError, match="exists and is not an empty directory; refusing to overwrite"):
        export_hf(hf_run["saved"], out, hf_run["compiled"])
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ParcError, match="returns a GPT, not a transformers PreTrainedModel"):
        export_hf(hf_run["saved"], tmp_path / "x", TIED_GPT)
    assert cli.main(["export", str(hf_run["saved"]), "--hf", str(hf_run["compiled"])]) == 2
    assert "name it with -o" in capsys.readouterr().err
    assert cli.main(["export", str(hf_run["saved"]), "-o", str(tmp_path / "y"), "--hf", str(hf_run["compiled"]),
                     "--max-shard-size", "lots"]) == 2


def test_weights_errors_are_one_line(gpt_file, tmp_path):
    path, _ = gpt_file
    with pytest.raises(LaunchError, match="no such file"):
        Weights.open(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LaunchError, match="neither model.safetensors.index.json nor a .safetensors"):
        Weights.open(tmp_path / "empty")
    w = Weights.open(path)
    with pytest.raises(LaunchError, match=r"`blocks.0.attn.qkv.weight` has shape \(192, 64\) but the model's"):
        w.read("blocks.0.attn.qkv.weight", [64, 64], None)
    with pytest.raises(LaunchError, match="no tensor `lm_head.weight`; it holds"):
        w.read("lm_head.weight", [256, 64], None)  # no tie learned: the alias is unknown


def test_parc_run_weights_flag_verifies(gpt_file, tmp_path):
    """`python -m parc.run DIR --weights F --verify` (a world of one): training starts from F, and the serial
    reference loads F too. (A bad path's one line is Weights.open's LaunchError, tested above.)"""
    import os
    import subprocess
    import sys

    path, _ = gpt_file
    art = compile_text(_plan("dp=1"), tmp_path / "c", TIED_GPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "parc.run", str(art.root), "--steps", "2", "--verify",
                        "--metrics", str(tmp_path / "m.jsonl"), "--weights", str(path)],
                       env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "verify PASS" in r.stdout, r.stdout + r.stderr
    user = load_user_module(TIED_GPT)
    first = user.loss_fn(reference(user, 0, path), *user.get_batch(0, 4)).item()
    assert f"loss {first:.4f}" in r.stdout  # step 0's loss is the file's weights' loss
