"""DeepSpeed config → .par: `parc import-deepspeed ds_config.json [--world-size N] [--model model.py]`.

Start at `translate(config, world_size=, nodes=, gpus_per_node=, model_paths=)`: it
returns an `Import` — the plan text, the DeepSpeed keys it translated, and the keys
it could not (each with why). `write_plan` writes the text and then checks the
written file with the ordinary front end, so a bad config (the seed's
`train_batch_size 1024` with micro 4 × accumulation 8 on dp 8) is reported as
`plan.par:line:col: error: global batch 1024 ≠ micro 4 × accumulation 8 × dp 8 = 256`.

What maps to what:

| DeepSpeed | .par |
|---|---|
| train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps | batch global= micro= accumulation= |
| tensor_parallel.tp_size / autotp_size, tensor_model_parallel_size (Megatron-DeepSpeed) | mesh tp= |
| pipeline_parallel.pp_size, pipeline.stages (an integer), pipeline_model_parallel_size | mesh pp= |
| zero_optimization.stage | zero stage= |
| zero_optimization.mics_shard_size (MiCS) | zero … shard= (HSDP) |
| zero_optimization.zero_hpz_partition_size (ZeRO++ hpZ, stage 3) | zero stage=3 shard= (HSDP, more state a rank: `_hpz`) |
| zero_optimization.offload_optimizer.device cpu (ZeRO-Offload) | zero … offload=cpu |
| optimizer.type / params (lr, betas, eps, weight_decay) | optimizer adamw/adam/sgd lr= betas= eps= weight_decay= |
| gradient_clipping | optimizer clip= |
| bf16.enabled / fp16.enabled | precision bf16 / fp16 |
| fp16.loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale | precision fp16 with the same keys (`_loss_scaling`) |
| scheduler WarmupLR / WarmupDecayLR / WarmupCosineLR | optimizer warmup= decay= decay_steps= min_lr= (`_scheduler`) |

dp is derived: world / (tp × pp) when the world size is known, else
train_batch_size / (micro × accumulation). DeepSpeed's "Adam" is AdamW unless
`adam_w_mode` is false (its FusedAdam decouples weight decay by default).

`"auto"` (the HF Trainer fills it from its own arguments): the value comes from the
matching `Overrides` field (the command's flags: `--micro`, `--lr`, …) when given;
a batch size that the others and dp determine is derived; betas/eps/weight_decay
take parc's defaults, which are the HF Trainer's. Anything else stays `auto` in the
written plan, on a line of its own under a `# auto:` comment that says where the
number comes from, so `parc check` points at it (file:line:col). The rest of the
config is translated all the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from parc.errors import ParcError
from parc.grammar.plan import LOSS_SCALING_KEYS, LossScaling
from parc.grammar.plan import Optimizer as OptimizerDefaults

# (dotted DeepSpeed key, ...) → our meaning. Several spellings exist in the wild.
TP_KEYS = ("tensor_parallel.tp_size", "tensor_parallel.autotp_size", "tensor_parallel.size",
           "tensor_model_parallel_size", "tensor-model-parallel-size", "tp_size", "model_parallel_size")
PP_KEYS = ("pipeline_parallel.pp_size", "pipeline_parallel.size", "pipeline.stages", "pipeline.pp_size",
           "pipeline_model_parallel_size", "pipeline-model-parallel-size", "pp_size", "pipeline_parallel_size")
OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "fusedadam": "adamw", "torch_adam": "adam", "sgd": "sgd"}
OPT_PARAMS = ("lr", "betas", "eps", "weight_decay")
# sub-keys whose only effect is speed or memory placement in DeepSpeed's own engine
WHY = {
    "zero_optimization": "a DeepSpeed engine tuning knob; parc's ZeRO has no such setting",
    "fp16": "parc's fp16 loss scaler takes loss_scale, initial_scale_power, loss_scale_window, hysteresis and "
            "min_loss_scale only (docs/precision.md)",
    "optimizer": "parc's optimizers take lr, betas, eps, weight_decay only",
    "pipeline": "DeepSpeed pipeline-engine setting; parc places cuts itself (pipeline stages=auto)",
    "tensor_parallel": "DeepSpeed AutoTP setting",
    "activation_checkpointing": "parc recomputes by module glob: write `recompute \"blocks.*\"`",
    "scheduler": "parc's lr schedule is warmup + constant, linear or cosine decay; this scheduler is not one",
}
# more precise reasons for some sub-keys (the longest matching prefix wins over WHY's top-level ones)
WHY_PREFIX = {
    "zero_optimization.offload_optimizer": "a tuning knob of DeepSpeed's offload engine; parc's `zero offload=cpu` "
                                           "has no such setting",
    "zero_optimization.offload_optimizer.device": "parc offloads the optimizer to host memory only "
                                                  "(`offload=cpu`), and only with zero stage 1–3",
    "zero_optimization.offload_optimizer.pin_memory": "parc pins its host buffers whenever CUDA is present "
                                                      "(runtime/parallel/offload.py); no setting",
    "fp16.consecutive_hysteresis": "parc's hysteresis is refilled only when the scale grows (DeepSpeed's default, "
                                   "consecutive_hysteresis false), not after every clean step",
    "zero_optimization.offload_param": "parc has no parameter offload: parameters stay on the device",
}
AUTO = "auto"
# HF Trainer's defaults for these optimizer "auto"s are parc's own defaults (adamw betas 0.9,0.999, eps 1e-8,
# weight_decay 0), so leaving them out of the plan reproduces what the Trainer would have filled in
HF_DEFAULTS_ARE_PARCS = ("optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay")


@dataclass
class Overrides:
    """Numbers for "auto" values, as the HF Trainer would fill them (its argument in the comment)."""
    micro: int | None = None          # per_device_train_batch_size → train_micro_batch_size_per_gpu
    accumulation: int | None = None   # gradient_accumulation_steps
    global_batch: int | None = None   # train_batch_size (= world × micro × accumulation)
    lr: float | None = None           # learning_rate → optimizer.params.lr, scheduler warmup_max_lr
    warmup: int | None = None         # warmup_steps → scheduler warmup_num_steps
    steps: int | None = None          # max_steps → scheduler total_num_steps
    clip: float | None = None         # max_grad_norm → gradient_clipping
    precision: str | None = None      # --bf16 / --fp16 → bf16.enabled / fp16.enabled ("fp32", "bf16", "fp16")


# where each "auto" takes its number from: (Overrides field, the HF Trainer argument it stands for)
AUTO_SOURCES = {
    "train_micro_batch_size_per_gpu": ("micro", "per_device_train_batch_size"),
    "gradient_accumulation_steps": ("accumulation", "gradient_accumulation_steps"),
    "train_batch_size": ("global_batch", "world × per_device_train_batch_size × gradient_accumulation_steps"),
    "optimizer.params.lr": ("lr", "learning_rate"),
    "scheduler.params.warmup_max_lr": ("lr", "learning_rate"),
    "scheduler.params.warmup_num_steps": ("warmup", "warmup_steps"),
    "scheduler.params.total_num_steps": ("steps", "max_steps"),
    "gradient_clipping": ("clip", "max_grad_norm"),
}
FLAGS = {"micro": "--micro", "accumulation": "--accumulation", "global_batch": "--global-batch", "lr": "--lr",
         "warmup": "--warmup", "steps": "--steps", "clip": "--clip", "precision": "--precision"}


def _fill_autos(flat: dict, over: Overrides, notes: list[str]) -> list[str]:
    """Replace each "auto" in the flattened config by its override, in place; return the keys still "auto"."""
    left = []
    for key, value in list(flat.items()):
        if value != AUTO:
            continue
        if key in ("fp16.enabled", "bf16.enabled"):
            if over.precision is not None:
                flat[key] = over.precision == key.split(".")[0]
            else:
                left.append(key)
            continue
        if key == "scheduler.params.warmup_min_lr":
            flat[key] = 0.0  # the HF Trainer's warmup starts from 0
            continue
        field_, _ = AUTO_SOURCES.get(key, (None, None))
        given = getattr(over, field_) if field_ else None
        if given is not None:
            flat[key] = given
            notes.append(f"{key} \"auto\" = {given} ({FLAGS[field_]})")
        else:
            left.append(key)
    return left


def _auto_comment(key: str) -> str:
    field_, hf = AUTO_SOURCES.get(key, (None, None))
    if key in ("fp16.enabled", "bf16.enabled"):
        field_, hf = "precision", "--bf16 / --fp16"
    where = f"the HF Trainer's {hf}" if hf else "the HF Trainer"
    what = "fp32, bf16 or fp16" if field_ == "precision" else "the number"
    flag = f", or pass {FLAGS[field_]}" if field_ in FLAGS else ""
    return f"# auto: {key} is \"auto\" in the DeepSpeed config ({where}): write {what}{flag}"


@dataclass
class Import:
    text: str                                  # the .par, comments included
    translated: list[str] = field(default_factory=list)
    untranslated: list[tuple[str, str]] = field(default_factory=list)  # (dotted key, why)
    notes: list[str] = field(default_factory=list)
    mesh: dict = field(default_factory=dict)   # dp, pp, tp as written


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParcError(f"DeepSpeed {key} must be a positive integer, got {value!r}",
                        hint="\"auto\" values are filled in by the HF Trainer; write the number")
    return value


class _Reader:
    """Takes keys from the flattened config; what is never taken is reported as untranslated."""

    def __init__(self, config: dict):
        self.flat = _flatten(config)
        self.used: list[str] = []
        self.why: dict[str, str] = {}  # a key left untranslated for a reason of this config (else `_why`)

    def take(self, *keys: str):
        found = [(k, self.flat[k]) for k in keys if k in self.flat]
        self.used += [k for k, _ in found]
        return found[0] if found else (None, None)

    def rest(self) -> list[str]:
        return [k for k in self.flat if k not in self.used]


def translate(config: dict, *, world_size: int | None = None, nodes: int | None = None,
              gpus_per_node: int | None = None, model_paths: list[str] | None = None,
              source: str = "ds_config.json", overrides: Overrides | None = None) -> Import:
    """The .par text for `config`; raises ParcError when dp cannot be derived or a number is not one."""
    r = _Reader(config)
    notes: list[str] = []
    autos = _fill_autos(r.flat, overrides or Overrides(), notes)
    tp_key, tp = r.take(*TP_KEYS)
    pp_key, pp = r.take(*PP_KEYS)
    tp = _int(tp_key, tp) if tp_key else 1
    if pp == "auto":  # DeepSpeed's PipelineModule decides; parc needs the number: report it untranslated
        r.used.remove(pp_key)
        pp_key = None
    pp = _int(pp_key, pp) if pp_key else 1
    if world_size is None and nodes and gpus_per_node:
        world_size = nodes * gpus_per_node
    gkey, global_size = r.take("train_batch_size")
    mkey, micro = r.take("train_micro_batch_size_per_gpu")
    akey, acc = r.take("gradient_accumulation_steps")
    global_size = _int(gkey, global_size) if gkey and global_size != AUTO else None
    micro = _int(mkey, micro) if mkey and micro != AUTO else None
    acc = _int(akey, acc) if akey and acc != AUTO else None
    auto_batch = [k for k in (gkey, mkey, akey) if k in autos]

    if world_size is None and auto_batch and None in (global_size, micro, acc):
        dp = None  # "auto" sizes: dp is the launch's, which only --world-size gives
    elif world_size is not None:
        if world_size % (tp * pp):
            raise ParcError(f"world size {world_size} is not a multiple of tp {tp} × pp {pp} = {tp * pp}",
                            hint="dp = world / (tp × pp) must be a whole number")
        dp = world_size // (tp * pp)
        notes.append(f"dp {dp} = world {world_size} / (tp {tp} × pp {pp})")
    elif None not in (global_size, micro, acc):
        if global_size % (micro * acc):
            raise ParcError(f"train_batch_size {global_size} is not a multiple of micro {micro} × accumulation "
                            f"{acc} = {micro * acc}, so dp cannot be derived",
                            hint="pass --world-size N: dp = N / (tp × pp)")
        dp = global_size // (micro * acc)
        notes.append(f"dp {dp} = train_batch_size {global_size} / (micro {micro} × accumulation {acc}); "
                     f"world {dp * tp * pp}. Pass --world-size to check against the launch")
    elif global_size is None and micro is None and acc is None:
        dp = 1
        notes.append("no batch sizes in the config: dp 1; pass --world-size N for dp = N / (tp × pp)")
    else:
        have = ", ".join(k for k, v in (("train_batch_size", global_size), ("train_micro_batch_size_per_gpu",
                                        micro), ("gradient_accumulation_steps", acc)) if v is not None)
        raise ParcError(f"dp cannot be derived from {have} alone",
                        hint="pass --world-size N (dp = N / (tp × pp)), or give all three batch sizes")

    lines = []
    if dp is None:
        lines.append("# auto: dp is the launch's: write it (world / (tp × pp)), or pass --world-size")
    lines.append(f"mesh dp={AUTO if dp is None else dp} pp={pp} tp={tp}")
    if nodes and gpus_per_node:
        lines.append(f"topology nodes={nodes} gpus_per_node={gpus_per_node}")
    lines += _auto_batch(global_size, micro, acc, dp, auto_batch, notes) if auto_batch else \
        _batch(global_size, micro, acc, dp)
    if tp > 1:
        lines += _tp_rules(model_paths, notes)
    if pp > 1:
        lines.append("pipeline schedule=1f1b stages=auto   # DeepSpeed's pipeline engine runs 1F1B")
    skey, stage = r.take("zero_optimization.stage")
    if skey and stage:
        if stage not in (1, 2, 3):
            raise ParcError(f"DeepSpeed zero_optimization.stage must be 0..3, got {stage!r}")
        mkey, mics = r.take("zero_optimization.mics_shard_size")
        offload = _offload(r)
        hpz = _hpz(r, stage, dp, offload, mics_set=bool(mkey and mics not in (None, -1)), notes=notes)
        if mkey and mics not in (None, -1):  # MiCS: the state sharded in groups of K, replicated across them
            lines.append(f"zero stage={stage} shard={_int(mkey, mics)}{offload}   # MiCS mics_shard_size: HSDP")
        elif hpz:
            lines.append(f"zero stage=3 shard={hpz}   # ZeRO++ zero_hpz_partition_size {hpz}: HSDP (see the note)")
        else:
            lines.append(f"zero stage={stage}{offload}" + ("   # ZeRO-Offload: offload_optimizer.device cpu"
                                                          if offload else ""))
    lines += _precision(r, autos)
    lines += _optimizer(r, notes, autos)

    fp16_on = bool(r.flat.get("fp16.enabled")) and r.flat.get("fp16.enabled") != AUTO
    untranslated = [(k, "fp16 is not enabled: its loss-scaling settings have no effect" if k.startswith("fp16.")
                     and not fp16_on else r.why.get(k) or _why(k)) for k in r.rest()]
    head = [f"# translated from {source} by `parc import-deepspeed`"]
    head += [f"# note: {n}" for n in notes]
    if untranslated:
        head.append("# not translated:")
        head += [f"#   {k}: {why}" for k, why in untranslated]
    return Import("\n".join(head + lines) + "\n", r.used, untranslated, notes, {"dp": dp, "pp": pp, "tp": tp})


def _hpz(r: _Reader, stage: int, dp: int | None, offload: str, mics_set: bool, notes: list[str]) -> int | None:
    """ZeRO++ hpZ (`zero_hpz_partition_size` K > 1, stage 3) → `zero stage=3 shard=K`, parc's HSDP, where it is
    the nearest parc plan and compiles: its weight gathers stay inside groups of K ranks as hpZ's secondary copy
    does, but parc also shards the optimizer state and fp32 masters over those K ranks, not over all dp, so a
    rank holds more (said in a note). Left untranslated, with why (`WHY_PREFIX`), under MiCS (which already
    sets `shard=`), with offload (parc refuses `shard=` below dp with `offload=`), or where K does not divide a
    known dp. K = 1 is hpZ off: translated, nothing written."""
    key = "zero_optimization.zero_hpz_partition_size"
    if key not in r.flat:
        return None
    k = r.flat[key]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        r.why[key] = f"ZeRO++ hpZ partition size must be a positive integer to map onto `zero shard=`, got {k!r}"
        return None
    if k == 1:
        r.take(key)
        return None
    why = ("MiCS's mics_shard_size already sets `zero shard=`" if mics_set else
           "hpZ is a stage-3 setting" if stage != 3 else
           "parc refuses `zero shard=` below dp together with `offload=cpu`" if offload else
           f"{k} does not divide dp {dp}" if dp is not None and dp % k else
           "dp is not known (auto), so `shard=` cannot be checked against it" if dp is None else None)
    if why is not None:
        r.why[key] = f"ZeRO++ hpZ (partition size {k}) is not mapped onto `zero shard=`: {why}"
        return None
    r.take(key)
    notes.append(f"zero_hpz_partition_size {k} → `zero stage=3 shard={k}` (HSDP): the weight all-gathers stay "
                 f"inside groups of {k} ranks, as hpZ's secondary copy makes them, but parc shards the fp32 masters "
                 f"and optimizer state over those {k} ranks rather than over all {dp}, so a rank holds 12/{k} bytes "
                 f"a parameter of state where hpZ holds 12/{dp}: check it fits with `parc report`")
    return k


def _offload(r: _Reader) -> str:
    """`offload_optimizer.device` cpu → ` offload=cpu` (ZeRO-Offload: runtime/parallel/offload.py); "none" is
    parc's default and is taken as translated; nvme is left untranslated (WHY_PREFIX says why)."""
    device = r.flat.get("zero_optimization.offload_optimizer.device")
    if device in ("cpu", "none", None):
        r.take("zero_optimization.offload_optimizer.device")
    return " offload=cpu" if device == "cpu" else ""


def _batch(global_size, micro, acc, dp) -> list[str]:
    if global_size is None and micro is None:
        return []
    if micro is None:  # DeepSpeed derives micro = global / (accumulation × dp)
        a = acc or 1
        if global_size % (a * dp):
            raise ParcError(f"train_batch_size {global_size} is not a multiple of accumulation {a} × dp {dp} "
                            f"= {a * dp}, so the micro-batch cannot be derived")
        micro = global_size // (a * dp)
    if global_size is None:
        global_size = micro * (acc or 1) * dp
    stated = f" accumulation={acc}" if acc is not None else ""
    return [f"batch global={global_size} micro={micro}{stated}"]


def _auto_batch(global_size, micro, acc, dp, auto_keys: list[str], notes: list[str]) -> list[str]:
    """The batch line when some of its sizes are "auto": derive what the others and dp give, mark the rest."""
    sizes = {"global": global_size, "micro": micro, "accumulation": acc}
    if dp is not None and sum(v is None for v in sizes.values()) == 1:
        if global_size is None:
            sizes["global"] = micro * acc * dp
        elif global_size % ((micro or acc) * dp) == 0:
            sizes["micro" if micro is None else "accumulation"] = global_size // ((micro or acc) * dp)
        derived = [k for k, v in sizes.items() if v is not None and {"global": global_size, "micro": micro,
                                                                      "accumulation": acc}[k] is None]
        for k in derived:
            notes.append(f"batch {k}={sizes[k]}: derived from the other sizes and dp {dp} (it was \"auto\")")
    comments = [_auto_comment(k) for k, name in (("train_batch_size", "global"),
                ("train_micro_batch_size_per_gpu", "micro"), ("gradient_accumulation_steps", "accumulation"))
                if k in auto_keys and sizes[name] is None]
    fields = " ".join(f"{k}={AUTO if v is None else v}" for k, v in sizes.items())
    return comments + [f"batch {fields}"]


def _precision(r: _Reader, autos: list[str]) -> list[str]:
    bkey, bf16 = r.take("bf16.enabled")
    fkey, fp16 = r.take("fp16.enabled")
    auto = [k for k in (bkey, fkey) if k in autos]
    if auto:
        return [_auto_comment(auto[0]), f"precision {AUTO}"]
    if bf16 and fp16:
        raise ParcError("DeepSpeed config enables both bf16 and fp16", hint="enable one of them")
    return ["precision bf16"] if bf16 else [f"precision fp16{_loss_scaling(r)}"] if fp16 else []


def _loss_scaling(r: _Reader) -> str:
    """fp16's scaler keys, which parc names as DeepSpeed does (runtime/loss_scale.py), where they differ from the
    defaults (DeepSpeed's too). A value that is not a number ("auto") is left untranslated; one out of range is
    written as it is, and the plan's own check points at it."""
    out, base = [], LossScaling()
    key, consecutive = r.take("fp16.consecutive_hysteresis")
    if consecutive is not False and key is not None:  # false (the default) is parc's rule; true is not
        r.used.remove(key)
    for k in LOSS_SCALING_KEYS:
        key, v = r.take(f"fp16.{k}")
        if key is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            r.used.remove(key)
            continue
        if v != getattr(base, k):
            out.append(f" {k}={v}" if isinstance(v, int) else f" {k}={v:g}")
    return "".join(out)


def _optimizer(r: _Reader, notes: list[str], autos: list[str]) -> list[str]:
    tkey, kind = r.take("optimizer.type")
    ckey, clip = r.take("gradient_clipping")
    comments: list[str] = []
    parts = []
    if tkey is not None:
        name = str(kind).lower()
        _, w_mode = r.take("optimizer.params.adam_w_mode")
        if name == "adam" and w_mode is False:
            name = "torch_adam"
        if name not in OPTIMIZERS:
            r.used.remove(tkey)  # reported as untranslated; parc's default optimizer stays
            notes.append(f"optimizer {kind!r} has no parc equivalent: the plan keeps parc's default adamw")
        else:
            parts.append(OPTIMIZERS[name])
            if name == "adam":
                notes.append("DeepSpeed Adam with adam_w_mode (its default) decouples weight decay: adamw")
            for p in OPT_PARAMS:
                key, value = r.take(f"optimizer.params.{p}")
                if key is None:
                    continue
                if key in autos and key in HF_DEFAULTS_ARE_PARCS:
                    notes.append(f"{key} \"auto\": parc's default, which is the HF Trainer's")
                    continue
                if key in autos:
                    comments.append(_auto_comment(key))
                    parts.append(f"{p}={AUTO}")
                    continue
                parts.append(f"{p}=" + (",".join(repr(float(b)) for b in value) if p == "betas"
                                        else repr(float(value))))
    written_lr = next((x[3:] for x in parts if x.startswith("lr=")), None)
    opt_lr = AUTO if written_lr == AUTO else float(written_lr) if written_lr else OptimizerDefaults.lr
    schedule, lr = _scheduler(r, notes, autos, comments, opt_lr)
    if lr is not None:  # the scheduler's peak lr replaces the optimizer's, as in DeepSpeed
        parts = [x for x in parts if not x.startswith("lr=")] or ["adamw"]
        parts.insert(1, f"lr={lr}")
    if ckey in autos:
        comments.append(_auto_comment(ckey))
        parts = parts or ["adamw"]
        parts.append(f"clip={AUTO}")
    elif clip:  # 0 means no clipping in DeepSpeed
        parts = parts or ["adamw"]
        parts.append(f"clip={float(clip)!r}")
    if schedule:
        parts = (parts or ["adamw"]) + schedule
    return comments + ["optimizer " + " ".join(parts)] if parts else []


def _scheduler(r: _Reader, notes: list[str], autos: list[str], comments: list[str],
               opt_lr: float | str) -> tuple[list[str], str | None]:
    """DeepSpeed's scheduler as parc's `warmup= decay= decay_steps= min_lr=`, and the peak lr it sets (or None).

    DeepSpeed (deepspeed/runtime/lr_schedules.py) at 0-based step s, W = max(2, warmup_num_steps):
      WarmupLR        lr(s) = min + (max − min)·γ(s) for s < W, then max
      WarmupDecayLR   as WarmupLR for s < W, then min + (max − min)·(T − s)/(T − W)  (linear to min at T)
      WarmupCosineLR  lr(s) = lr·ρ(s): warmup ρ = wmin + (1 − wmin)·γ(s); then
                      cos_min + (1 − cos_min)·½(1 + cos(π(s − W + 1)/(T − W)))
    with γ(s) = s/W (`warmup_type` linear) or log(s + 1)/log W (log, DeepSpeed's default). parc's warmup is
    linear from lr/W at s = 0 and its decays start at s = W (runtime/schedule_lr.py). So linear decay matches
    exactly; the warmup is one step ahead of DeepSpeed's linear one; a log warmup, a warmup that starts above 0
    and the cosine's one-step shift are approximations, each said in a note.
    """
    tkey, kind = r.take("scheduler.type")
    if tkey is None:
        return [], None
    kind = str(kind)
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        r.used.remove(tkey)
        return [], None

    def param(name, default):
        key, value = r.take(f"scheduler.params.{name}")
        if key in autos:
            comments.append(_auto_comment(key))
            return AUTO
        return default if key is None else value

    warmup = param("warmup_num_steps", 1000)
    wtype = param("warmup_type", "log")
    parts = [f"warmup={warmup if warmup == AUTO else max(2, int(warmup))}"] if warmup == AUTO or warmup else []
    if wtype != "linear":
        notes.append(f"DeepSpeed's warmup here is {wtype}-shaped (warmup_type, default log); parc's is linear")
    notes.append("parc's linear warmup runs step s at lr·(s+1)/warmup, DeepSpeed's at lr·s/warmup: one step ahead")
    peak = None
    if kind in ("WarmupLR", "WarmupDecayLR"):
        low, high = param("warmup_min_lr", 0.0), param("warmup_max_lr", 0.001)
        peak = high if high == AUTO else repr(float(high))
        if low not in (AUTO, 0, 0.0):
            notes.append(f"warmup_min_lr {low}: parc's warmup starts near 0, not at warmup_min_lr")
        if kind == "WarmupDecayLR":
            total = param("total_num_steps", None)
            if total is None:
                raise ParcError("DeepSpeed WarmupDecayLR needs scheduler.params.total_num_steps")
            parts += ["decay=linear", f"decay_steps={total}"]
            if low not in (AUTO, 0, 0.0):
                parts.append(f"min_lr={float(low)!r}")
    else:
        total = param("total_num_steps", None)
        if total is None:
            raise ParcError("DeepSpeed WarmupCosineLR needs scheduler.params.total_num_steps")
        wmin, cmin = param("warmup_min_ratio", 0.0), param("cos_min_ratio", 0.0001)
        if wmin not in (AUTO, 0, 0.0):
            notes.append(f"warmup_min_ratio {wmin}: parc's warmup starts near 0, not at that ratio of lr")
        notes.append("DeepSpeed's cosine runs one step ahead of parc's (its phase is s − W + 1, parc's s − W)")
        parts += ["decay=cosine", f"decay_steps={total}"]
        if cmin == AUTO or opt_lr == AUTO:
            comments.append("# auto: min_lr is cos_min_ratio × lr: write it once both are known")
            parts.append(f"min_lr={AUTO}")
        elif cmin:
            parts.append(f"min_lr={float(cmin) * opt_lr!r}")  # cos_min_ratio of the optimizer's lr
    return parts, peak


# Megatron's layout for the module names common models use: the first linear of a
# pair splits its output dim (column), the second its input dim (row), so each pair
# needs one all-reduce.
_COLUMN = ("qkv", "c_attn", "q_proj", "k_proj", "v_proj", "fc", "c_fc", "up_proj", "gate_proj", "w1", "w3")
_ROW = ("proj", "c_proj", "o_proj", "out_proj", "down_proj", "w2")


def _tp_rules(paths: list[str] | None, notes: list[str]) -> list[str]:
    if paths is None:
        notes.append("tp > 1 but no tensor_parallel rules: DeepSpeed shards inside the model code; "
                     "pass --model model.py to propose Megatron rules, or write them")
        return []
    rules: dict[str, str] = {}
    for path in paths:
        leaf = path.rsplit(".", 1)[-1]
        style = "column" if leaf in _COLUMN else "row" if leaf in _ROW else None
        if style:
            rules.setdefault(re.sub(r"\.\d+\.", ".*.", path), style)
    if not rules:
        notes.append("tp > 1 but no module name looked like a Megatron column/row pair: write tensor_parallel rules")
        return []
    notes.append("tensor_parallel rules proposed from module names (Megatron column/row pairs): review them")
    quoted = {f'"{p}"': s for p, s in rules.items()}
    width = max(len(q) for q in quoted)
    return ["tensor_parallel {", *[f"    {q:<{width}} : {s}" for q, s in quoted.items()], "}"]


def _why(key: str) -> str:
    for prefix in sorted(WHY_PREFIX, key=len, reverse=True):
        if key == prefix or key.startswith(prefix + "."):
            return WHY_PREFIX[prefix]
    top = key.split(".", 1)[0]
    return WHY.get(top, "no parc equivalent")


def load_config(path: Path) -> dict:
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ParcError(f"cannot read DeepSpeed config {path}: {e}") from None
    if not isinstance(config, dict):
        raise ParcError(f"DeepSpeed config {path} must be a JSON object, got {type(config).__name__}")
    return config


def write_plan(imp: Import, out: Path):
    """Write the plan, then check the written file: a PlanError points at its file:line:col.

    An inconsistent config still gets its .par (with the diagnostics as comments at the
    top) so the user can fix one number in it; the caller exits 2.
    """
    from parc.grammar.parser import load_plan, parse

    out = Path(out)
    text = imp.text
    try:
        parse(text, str(out))
    except ParcError as e:  # PlanSyntaxError (a value that is not a number: "auto") or PlanError
        errors = [d.message for d in e.diagnostics if d.severity == "error"]
        marks = "".join(f"# error: {m}\n" for m in errors)
        text = text.replace("\n", "\n" + marks, 1)  # after the first comment line
    out.write_text(text, encoding="utf-8")
    return load_plan(out)  # raises with the written file's spans
