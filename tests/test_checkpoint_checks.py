"""Checkpoints check themselves and are never overwritten unasked (issue 10).

One spawned world (2 gloo ranks) writes a real checkpoint directory and resumes it under another plan and
under two other models; everything else reads and damages copies of that directory in this process:
`parc.run`'s checks on --checkpoint-dir, --save-every and --resume run on files before any process group,
and `parc export` runs in one process anyway. Every refusal must be one `error:` line and exit 2.
"""

import shutil
import warnings

import pytest

from helpers import GPT, compile_text
from parc.cli import main as cli_main
from parc.errors import LaunchError
from parc.run import main as run_main, parser as run_parser
from parc.runtime import checkpoint
from parc.runtime.checkpoint.files import check_saving
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer

BASE = "mesh dp=2\nzero stage=1\nbatch global=4 micro=2\noptimizer adamw lr=1e-2\n"
OTHER = "mesh dp=2\nzero stage=2\nbatch global=8 micro=2\noptimizer sgd lr=1e-3 warmup=5 no_decay=bias\n"


def _model(tmp, name: str, config: str):
    """examples/gpt.py with another CONFIG (build_model reads it at call time), beside its data."""
    path = tmp / f"{name}.py"
    path.write_text(GPT.read_text() + f"\nCONFIG = GPTConfig({config})\n")
    if not (tmp / "data").exists():
        (tmp / "data").symlink_to(GPT.parent / "data")
    return path


def _world(ctx, c: dict, root: str, other_root: str):
    out = {}
    trainer = Trainer.load(c["base"], 0)
    for s in range(2):
        trainer.step(s)
        checkpoint.save(trainer, root, s + 1)
    checkpoint.save(trainer, other_root, 2)
    checkpoint.save(trainer, other_root, 1)  # an older step saved later: `latest` must stay at step_2
    try:
        checkpoint.save(trainer, other_root, 2)
    except LaunchError as e:
        out["again"] = e.message
    checkpoint.save(trainer, f"{other_root}-replaced", 2)
    checkpoint.save(trainer, f"{other_root}-replaced", 1, replace=True)  # what --overwrite-checkpoints asks
    out["resumed"] = checkpoint.resume(Trainer.load(c["other"], 0), root)
    for name in ("two_layers", "narrow"):
        try:
            checkpoint.resume(Trainer.load(c[name], 0), root)
        except LaunchError as e:
            out[name] = e.message
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckchecks")
    c = {"base": compile_text(BASE, tmp / "base"), "other": compile_text(OTHER, tmp / "other"),
         "two_layers": compile_text(BASE, tmp / "two", model=_model(tmp, "two", "n_layer=2")),
         "narrow": compile_text(BASE, tmp / "narrow", model=_model(tmp, "narrow", "n_embd=32"))}
    c = {k: str(v.root) for k, v in c.items()}
    out = spawn(2, _world, c, str(tmp / "ckpt"), str(tmp / "other_ckpt"))
    assert out[0] == out[1]  # every rank reached the same verdicts
    return tmp, c, out[0]


# --- self-checking ---------------------------------------------------------------------------------------------

def test_resume_says_what_it_loaded_and_every_difference(world):
    tmp, _, out = world
    step, line = out["resumed"]
    assert step == 2
    assert line.startswith(f"resumed from step 2 of {tmp / 'ckpt' / 'step_2'}, saved under plan test.par (sha256 "), line
    assert "(next batch get_batch(2, 8)): " in line, line
    for diff in ("batch accumulation 1 → 2", "batch global 4 → 8", "optimizer lr 0.01 → 0.001",
                 "optimizer name adamw → sgd", "zero 1 → 2", "optimizer warmup 0 → 5",
                 "optimizer no_decay bias,norm,embedding → bias",
                 "optimizer state (exp_avg, exp_avg_sq, step) not loaded: sgd keeps none"):
        assert diff in line, (diff, line)
    assert "\n" not in line


def test_resume_refuses_another_model_structure(world):
    _, _, out = world
    assert "saved from another model" in out["two_layers"], out["two_layers"]
    assert "it holds 24 parameters this model lacks (blocks.2." in out["two_layers"], out["two_layers"]
    assert "shapes differ (blocks.0.attn.proj.bias: checkpoint (64,) ≠ model (32,))" in out["narrow"], out["narrow"]
    assert "\n" not in out["two_layers"] + out["narrow"]


def test_checkpoint_records_what_it_holds(world):
    import json

    tmp, _, _ = world
    info = json.loads((tmp / "ckpt" / "step_2" / "parc.json").read_text())
    assert info["step"] == 2 and info["data"] == {"next_step": 2, "global_batch": 4, "source": "get_batch",
                                                  "consumed_samples": 8}
    assert info["plan"]["source"] == BASE and info["plan"]["sha256"]
    assert info["model"]["params"]["blocks.0.attn.qkv.weight"] == [192, 64]
    assert info["optimizer"] == {"name": "adamw", "state": ["exp_avg", "exp_avg_sq"], "scalars": ["step"]}


def test_save_never_overwrites_and_latest_never_moves_back(world):
    tmp, _, out = world
    assert "exists already; refusing to overwrite a checkpoint" in out["again"], out["again"]
    assert checkpoint.resolve(tmp / "other_ckpt").name == "step_2"
    replaced = tmp / "other_ckpt-replaced"  # asked to replace: the later step_2 went, `latest` moved back
    assert [p.name for p in replaced.glob("step_*")] == ["step_1"] and checkpoint.resolve(replaced).name == "step_1"


# --- refusals at start ---------------------------------------------------------------------------------------------

@pytest.fixture
def launch(world, monkeypatch, capsys):
    """`parc.run` as rank 0 of 2; the checks under test stop it before any process group starts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    compiled = world[1]["base"]

    def run(*argv: str) -> str:
        code = run_main([compiled, "--steps", "4", *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, (code, err)
        return err.strip()

    return run


def test_fresh_run_refuses_a_directory_with_checkpoints(world, launch, tmp_path):
    tmp = world[0]
    err = launch("--save-every", "1", "--checkpoint-dir", str(tmp / "ckpt"))
    assert "already holds checkpoints (step_1, step_2); a fresh run would overwrite them" in err, err
    assert "--resume" in err and "--overwrite-checkpoints" in err
    (tmp_path / "notes.txt").write_text("mine")
    assert "already holds 1 entries (notes.txt)" in launch("--save-every", "1", "--checkpoint-dir", str(tmp_path))
    assert "--overwrite-checkpoints" in run_parser().format_help()


def test_resumed_run_refuses_to_overwrite_later_checkpoints(world, launch):
    ckpt = world[0] / "ckpt"
    err = launch("--resume", str(ckpt / "step_1"), "--save-every", "1", "--checkpoint-dir", str(ckpt))
    assert "holds step_2, beyond step 1 being resumed: saving would overwrite them and move `latest` back" in err
    check_saving(1, ckpt, 2, False)  # resuming the newest into its own directory is fine


@pytest.mark.parametrize("argv, words", [
    (["--save-every", "-1", "--checkpoint-dir", "X"], "--save-every -1: must be a number of steps ≥ 1"),
    (["--save-every", "0", "--checkpoint-dir", "X"], "--save-every 0: must be a number of steps ≥ 1"),
    (["--save-every", "2"], "--save-every 2 needs --checkpoint-dir DIR"),
    (["--checkpoint-dir", "X"], "without --save-every N would save nothing"),
    (["--save-every", "2", "--checkpoint-dir", "FILE"], "--checkpoint-dir FILE is a file, not a directory"),
])
def test_checkpoint_flags_refused_at_start(launch, tmp_path, argv, words):
    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a in ("X", "FILE") else a for a in argv]
    err = launch(*argv)
    assert words.replace("FILE", str(tmp_path / "FILE")) in err, err


# --- damaged checkpoints ---------------------------------------------------------------------------------------------

def _damage(src, dst, how: str):
    shutil.copytree(src, dst)
    step = dst / "step_2"
    if how == "latest_missing":
        (dst / "latest").write_text("step_9\n")
    elif how == "latest_garbage":
        (dst / "latest").write_bytes(b"\x00\xff\xfe garbage")
    elif how == "no_parc_json":
        (step / "parc.json").unlink()
    elif how == "truncated_shard":
        shard = step / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    elif how == "truncated_metadata":
        meta = step / ".metadata"
        meta.write_bytes(meta.read_bytes()[:100])
    return dst


DAMAGE = {
    "latest_missing": "latest names step_9, which does not exist (deleted or not copied?); complete checkpoints "
                      "here: step_1, step_2",
    "latest_garbage": "not the name of a step_<N> checkpoint; it is damaged",
    "no_parc_json": "no parc.json, so not a complete parc checkpoint",
    "truncated_shard": "shard file __1_0.distcp is truncated: 1000 bytes, the index needs",
    "truncated_metadata": ".metadata is damaged or truncated",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_checkpoint_is_one_line(world, launch, tmp_path, how):
    ckpt = _damage(world[0] / "ckpt", tmp_path / "ckpt", how)
    err = launch("--resume", str(ckpt))
    assert err.startswith(f"error: --resume {ckpt}") and DAMAGE[how] in err, err


# --- parc export ---------------------------------------------------------------------------------------------------

def _export(capsys, *argv: str) -> str:
    code = cli_main(["export", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, (code, err)
    return err.strip()


def test_export_bad_paths_are_one_line(world, tmp_path, capsys):
    ckpt = _damage(world[0] / "ckpt", tmp_path / "ckpt", "latest_missing")
    err = _export(capsys, str(ckpt), "-o", str(tmp_path / "m.safetensors"))
    assert f"parc export: checkpoint {ckpt}: {ckpt / 'latest'} names step_9" in err, err
    err = _export(capsys, str(tmp_path / "nothing"), "-o", str(tmp_path / "m.safetensors"))
    assert f"parc export: checkpoint {tmp_path / 'nothing'}: no such file or directory" in err, err
    assert "--resume" not in err
    (tmp_path / "out").mkdir()
    err = _export(capsys, str(world[0] / "ckpt"), "-o", str(tmp_path / "out"))
    assert f"-o {tmp_path / 'out'} is a directory" in err, err
    assert list((tmp_path / "out").iterdir()) == [] and not list(tmp_path.glob(".*.tmp"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert cli_main(["export", str(world[0] / "ckpt"), "-o", str(tmp_path / "m.safetensors")]) == 0
    assert not [w for w in seen if "torch.distributed is disabled" in str(w.message)]  # single process on purpose
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_shard_damaged_past_the_file_check_is_one_line(world, tmp_path):
    """`resume` leaves the shard stats to parc.run's rank 0; should a shard be damaged anyway, DCP's read
    fails (on every rank alike: DCP gathers failures) and that too is one line."""
    import torch

    from parc.runtime.checkpoint.sharded import _read
    from parc.runtime.checkpoint.files import open_checkpoint

    ckpt = _damage(world[0] / "ckpt", tmp_path / "ckpt", "truncated_shard")
    saved = open_checkpoint(ckpt, shards=False)
    md = saved.meta.state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items() if k.startswith("model.")}
    with pytest.raises(LaunchError) as e:
        _read(saved, sd, "--resume", no_dist=True)
    assert "reading the tensors failed" in e.value.message and "\n" not in e.value.message, e.value.message
