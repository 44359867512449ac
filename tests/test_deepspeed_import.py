"""`parc import-deepspeed`: DeepSpeed JSON → .par → parse gives the same numbers; bad configs are diagnosed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parc.cli import main
from parc.deepspeed import Overrides, translate, write_plan
from parc.errors import ParcError
from parc.grammar.parser import load_plan
from parc.grammar.plan import Zero

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
              "scheduler": {"type": "OneCycle"}}
    imp = translate(config)
    keys = [k for k, _ in imp.untranslated]
    assert keys == ["zero_optimization.overlap_comm", "optimizer.type", "optimizer.params.lr", "steps_per_print", "scheduler.type"]
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


# ---------------------------------------------------------------- "auto" (HF Trainer configs) and schedulers

CORPUS = ROOT / "tests" / "deepspeed_configs"
HF_FLAGS = ["--micro", "4", "--accumulation", "2", "--lr", "2e-5", "--warmup", "10", "--steps", "100",
            "--clip", "1.0", "--precision", "bf16"]


def test_auto_values_without_flags_are_marked_not_refused(tmp_path, capsys):
    """Every "auto" left without a number stays `auto` on its own line, which the check points at; the rest
    (here `zero stage=2`) is translated all the same."""
    out = tmp_path / "hf.par"
    assert main(["import-deepspeed", str(CORPUS / "hf_trainer_zero2.json"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    text = out.read_text().splitlines()
    assert "zero stage=2" in text
    marked = [i + 1 for i, line in enumerate(text) if not line.startswith("#") and "=auto" in line or line ==
              "precision auto"]
    assert marked, text
    for line in marked:  # each marked line is named by a located error and preceded by its `# auto:` comment
        assert f"{out}:{line}:" in err
        assert text[line - 2].startswith("# auto:")
    assert "Traceback" not in err


def test_auto_values_from_flags(tmp_path):
    out = tmp_path / "hf.par"
    assert main(["import-deepspeed", str(CORPUS / "hf_trainer_zero2.json"), "-o", str(out), "--world-size", "8",
                 *HF_FLAGS]) == 0
    plan = load_plan(out)
    opt = plan.optimizer
    assert (plan.mesh.dp, plan.global_batch, plan.micro_batch, plan.batch.accumulation, plan.precision,
            plan.zero.stage) == (8, 64, 4, 2, "bf16", 2)
    # WarmupDecayLR with "auto" warmup_min_lr (the Trainer's 0) and warmup_max_lr (--lr)
    assert (opt.lr, opt.grad_clip, opt.warmup, opt.decay, opt.decay_steps, opt.min_lr) == \
        (2e-5, 1.0, 10, "linear", 100, None)
    assert (opt.betas, opt.eps, opt.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)  # HF Trainer's defaults


def test_derived_batch_size_from_world_and_two_sizes(tmp_path):
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    plan = write_plan(translate(config, world_size=4), tmp_path / "p.par")
    assert (plan.global_batch, plan.micro_batch, plan.batch.accumulation) == (24, 2, 3)
    config = {"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 3}
    plan = write_plan(translate(config, world_size=4), tmp_path / "q.par")
    assert (plan.global_batch, plan.micro_batch, plan.batch.accumulation) == (48, 4, 3)


def _deepspeed_lr(kind: str, s: int, params: dict, lr: float) -> float:
    """DeepSpeed's schedulers at 0-based step s, written from their documented formulas (linear warmup)."""
    w = max(2, params["warmup_num_steps"])
    if kind == "WarmupCosineLR":
        if s < w:
            return lr * s / w
        cmin = params["cos_min_ratio"]
        ratio = (1 + math.cos(math.pi * (s - w + 1) / (params["total_num_steps"] - w))) / 2
        return lr * max(0.0, cmin + (1 - cmin) * ratio)
    low, high = params["warmup_min_lr"], params["warmup_max_lr"]
    if s < w:
        return low + (high - low) * s / w
    if kind == "WarmupLR":
        return high
    return low + (high - low) * max(0.0, (params["total_num_steps"] - s) / max(1.0, params["total_num_steps"] - w))


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 20}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 20, "total_num_steps": 200}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0, "cos_min_ratio": 0.1, "warmup_num_steps": 20, "total_num_steps": 200}),
])
def test_schedulers_follow_deepspeed(tmp_path, kind, params):
    """parc's schedule from each translated scheduler against DeepSpeed's formula, step by step: the warmup is
    one step ahead (parc runs step s at lr·(s+1)/W, DeepSpeed at lr·s/W: the note says so); after it, linear
    decay and constant are equal, and parc's cosine is DeepSpeed's one step later (its phase is s − W + 1)."""
    from parc.runtime.schedule_lr import lr_at

    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
              "scheduler": {"type": kind, "params": dict(params, warmup_type="linear")}}
    imp = translate(config)
    assert not [k for k, _ in imp.untranslated if k.startswith("scheduler")]
    opt = write_plan(imp, tmp_path / "p.par").optimizer
    cfg = {"lr": opt.lr, "warmup": opt.warmup, "decay": opt.decay, "decay_steps": opt.decay_steps,
           "min_lr": opt.min_lr}
    w = params["warmup_num_steps"]
    for s in range(w):  # parc: peak·(s+1)/W; DeepSpeed's (from 0) reaches that one step later
        assert lr_at(cfg, s) == pytest.approx(3e-4 * (s + 1) / w)
        if s + 1 < w and params.get("warmup_min_lr", 0) == 0:
            assert lr_at(cfg, s) == pytest.approx(_deepspeed_lr(kind, s + 1, params, 3e-4))
    shift = 1 if kind == "WarmupCosineLR" else 0  # DeepSpeed's cosine at s is parc's at s + 1
    for s in range(w + shift, params.get("total_num_steps", 259) + 1):  # past T DeepSpeed's cosine turns back up
        assert lr_at(cfg, s) == pytest.approx(_deepspeed_lr(kind, s - shift, params, 3e-4), abs=1e-12), s


CORPUS_FLAGS = {  # the numbers an HF Trainer launch would have filled in for the "auto" ones
    "hf_trainer_zero2.json": HF_FLAGS, "hf_trainer_zero3.json": HF_FLAGS,
}


@pytest.mark.parametrize("name", sorted(p.name for p in CORPUS.glob("*.json")))
def test_corpus_imports_checks_and_compiles(tmp_path, capsys, name):
    """Configs in the shapes found in public repositories (HF Trainer ZeRO-2/3 with "auto", ZeRO-Offload,
    Megatron-DeepSpeed fp16, ZeRO++), written for this test: each is imported at --world-size 8 and compiled
    on examples/gpt.py (fp16 with its loss-scaling keys: runtime/loss_scale.py)."""
    out = tmp_path / "p.par"
    rc = main(["import-deepspeed", str(CORPUS / name), "--world-size", "8", "-o", str(out),
               *CORPUS_FLAGS.get(name, [])])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert rc == 0, captured.err
    assert main(["compile", str(ROOT / "examples" / "gpt.py"), "--plan", str(out), "-o", str(tmp_path / "c")]) == 0


def test_offload_optimizer_cpu_is_zero_offload(tmp_path):
    """`offload_optimizer: {device: cpu}` is `zero … offload=cpu`; "none" is parc's default (translated, nothing
    written); nvme, and pin_memory (parc pins whenever CUDA is present), are listed with their reasons."""
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    for device, want in (("cpu", "cpu"), ("none", None), ("nvme", None)):
        config = dict(base, zero_optimization={"stage": 2, "offload_optimizer": {"device": device, "pin_memory": True}})
        imp = translate(config, world_size=8)
        assert write_plan(imp, tmp_path / f"{device}.par").zero == Zero(2, None, want)
        why = dict(imp.untranslated)
        assert "pins its host buffers" in why["zero_optimization.offload_optimizer.pin_memory"]
        assert ("zero_optimization.offload_optimizer.device" in why) == (device == "nvme")
    stage0 = translate(dict(base, zero_optimization={"offload_optimizer": {"device": "cpu"}}), world_size=8)
    assert "only with zero stage 1–3" in dict(stage0.untranslated)["zero_optimization.offload_optimizer.device"]


def test_mics_shard_size_is_hsdp(tmp_path):
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "mics_shard_size": 4, "mics_hierarchical_params_gather": False}}
    plan = write_plan(translate(config, world_size=8), tmp_path / "p.par")
    assert (plan.zero.stage, plan.zero.shard) == (3, 4)


def test_hpz_partition_size_is_hsdp_with_a_note_or_left_with_why(tmp_path):
    """ZeRO++ hpZ's partition size K is `zero stage=3 shard=K` (gathers inside groups of K), with a note that parc
    also cuts the state over K (more a rank than hpZ); where that plan would not compile or not say the same
    (MiCS set, offload, stage 2, K not dividing dp, "auto") it stays untranslated with the reason."""
    key = "zero_optimization.zero_hpz_partition_size"
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
    imp = translate(dict(base, zero_optimization={"stage": 3, "zero_hpz_partition_size": 4}), world_size=8)
    assert write_plan(imp, tmp_path / "hpz.par").zero == Zero(3, 4, None)
    assert key not in dict(imp.untranslated) and any("12/4 bytes" in n and "12/8" in n for n in imp.notes)
    off = translate(dict(base, zero_optimization={"stage": 3, "zero_hpz_partition_size": 1}), world_size=8)
    assert write_plan(off, tmp_path / "off.par").zero == Zero(3, None, None) and key not in dict(off.untranslated)
    for zero, why in (({"stage": 3, "mics_shard_size": 2}, "MiCS"),
                      ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "offload"),
                      ({"stage": 2}, "stage-3 setting"), ({"stage": 3, "zero_hpz_partition_size": 3}, "divide dp 8"),
                      ({"stage": 3, "zero_hpz_partition_size": "auto"}, "positive integer")):
        zero = {"zero_hpz_partition_size": 4, **zero}
        imp = translate(dict(base, zero_optimization=zero), world_size=8)
        assert why in dict(imp.untranslated)[key], (zero, imp.untranslated)
        assert write_plan(imp, tmp_path / "x.par").zero.shard in (None, 2)  # MiCS's 2, never hpZ's


def test_fp16_loss_scaling_keys_map_onto_the_plan(tmp_path):
    """DeepSpeed's fp16 scaler keys are parc's (runtime/loss_scale.py): the Megatron-DeepSpeed config's become
    the plan's; a value that is not a number, and consecutive_hysteresis true (not parc's rule), stay
    untranslated with a reason."""
    config = json.loads((CORPUS / "megatron_deepspeed_fp16.json").read_text())
    imp = translate(config, world_size=8)
    ls = write_plan(imp, tmp_path / "p.par").loss_scaling
    assert (ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis, ls.min_loss_scale, ls.loss_scale) == \
        (12, 500, 2, 1.0, 0.0)
    assert not [k for k, _ in imp.untranslated if k.startswith("fp16")]
    config["fp16"].update(hysteresis="auto", consecutive_hysteresis=True)
    imp = translate(config, world_size=8)
    why = dict(imp.untranslated)
    assert set(k for k in why if k.startswith("fp16")) == {"fp16.hysteresis", "fp16.consecutive_hysteresis"}
    assert "refilled only when the scale grows" in why["fp16.consecutive_hysteresis"]
    assert write_plan(imp, tmp_path / "q.par").loss_scaling.hysteresis == 2  # DeepSpeed's default, and parc's
