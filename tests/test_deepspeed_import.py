"""`parc import-deepspeed`: DeepSpeed JSON → .par → parse gives the same numbers; bad configs are diagnosed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parc.cli import main
from parc.deepspeed import translate, write_plan
from parc.errors import ParcError
from parc.grammar.parser import load_plan

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = [
    # (config, world size, expected (dp, pp, tp, global, micro, accumulation, zero, precision))
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
      "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}, None, (8, 1, 1, 64, 2, 4, 1, "bf16")),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
      "tensor_parallel": {"tp_size": 2}, "pipeline_parallel": {"pp_size": 2}, "fp16": {"enabled": True}},
     16, (4, 2, 2, 32, 4, 2, 0, "fp16")),
    ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
      "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4}, 1024, (32, 4, 8, 256, 1, None, 3, "fp32")),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2, "pipeline": {"stages": 2}}, 8,
     (4, 2, 1, 32, 4, 2, 0, "fp32")),
]


@pytest.mark.parametrize("config,world,want", CONFIGS)
def test_round_trip(tmp_path, config, world, want):
    plan = write_plan(translate(config, world_size=world), tmp_path / "p.par")
    m = plan.mesh
    got = (m.dp, m.pp, m.tp, plan.global_batch, plan.micro_batch, plan.batch.accumulation, plan.zero.stage,
           plan.precision)
    assert got == want


def test_optimizer_and_clipping(tmp_path):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                        "weight_decay": 0.1}}}
    opt = write_plan(translate(config), tmp_path / "p.par").optimizer
    assert (opt.name, opt.lr, opt.betas, opt.eps, opt.weight_decay, opt.grad_clip) == \
        ("adamw", 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0)


def test_deepspeed_adam_is_adamw_unless_told(tmp_path):
    base = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    adam = dict(base, optimizer={"type": "Adam", "params": {"lr": 0.01}})
    torch_adam = dict(base, optimizer={"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}})
    assert write_plan(translate(adam), tmp_path / "a.par").optimizer.name == "adamw"
    assert write_plan(translate(torch_adam), tmp_path / "b.par").optimizer.name == "adam"


def test_unknown_fields_listed(tmp_path):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu"}},
              "optimizer": {"type": "Lamb", "params": {"lr": 0.1}}, "steps_per_print": 10,
              "scheduler": {"type": "WarmupLR"}}
    imp = translate(config)
    keys = [k for k, _ in imp.untranslated]
    assert keys == ["zero_optimization.overlap_comm", "zero_optimization.offload_optimizer.device",
                    "optimizer.type", "optimizer.params.lr", "steps_per_print", "scheduler.type"]
    text = imp.text
    assert "#   zero_optimization.overlap_comm:" in text and "#   steps_per_print:" in text
    write_plan(imp, tmp_path / "p.par")  # still a valid plan


def test_seed_config_diagnostic(tmp_path, capsys):
    out = tmp_path / "seed.par"
    rc = main(["import-deepspeed", str(ROOT / "examples" / "seed_deepspeed.json"), "--world-size", "64",
               "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    text = out.read_text()
    line = text.splitlines().index("batch global=1024 micro=4 accumulation=8") + 1
    assert f"{out}:{line}:14: error: global batch 1024 ≠ micro 4 × accumulation 8 × dp 8 = 256" in err
    assert "# error: global batch 1024 ≠ micro 4 × accumulation 8 × dp 8 = 256" in text
    assert "zero_optimization.allgather_partitions" in text and "mesh dp=8 pp=4 tp=2" in text


def test_dp_derivation_errors():
    with pytest.raises(ParcError, match=r"world size 12 is not a multiple of tp 2 × pp 4 = 8"):
        translate({"tensor_parallel": {"tp_size": 2}, "pipeline_parallel": {"pp_size": 4}}, world_size=12)
    with pytest.raises(ParcError, match=r"train_batch_size 100 is not a multiple of micro 3 × accumulation 2 = 6"):
        translate({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})
    with pytest.raises(ParcError, match="dp cannot be derived from train_batch_size, train_micro"):
        translate({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4})


def test_model_proposes_megatron_rules(tmp_path):
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "tensor_parallel": {"tp_size": 2}}
    out = tmp_path / "c.json"
    out.write_text(json.dumps(config))
    rc = main(["import-deepspeed", str(out), "--world-size", "4", "--model", str(ROOT / "examples" / "gpt.py"),
               "-o", str(tmp_path / "c.par")])
    assert rc == 0
    rules = {r.pattern: r.style for r in load_plan(tmp_path / "c.par").tensor_parallel.rules}
    assert rules == {"blocks.*.attn.qkv": "column", "blocks.*.attn.proj": "row",
                     "blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"}


def test_default_output_in_working_directory_never_overwritten(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "configs" / "ds.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["import-deepspeed", str(cfg), "--world-size", "4"]) == 0
    assert (work / "ds.par").is_file() and not (cfg.parent / "ds.par").exists()
    (work / "ds.par").write_text("# mine\n")
    assert main(["import-deepspeed", str(cfg), "--world-size", "4"]) == 2
    assert "ds.par exists" in capsys.readouterr().err
    assert (work / "ds.par").read_text() == "# mine\n"
