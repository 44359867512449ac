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
| optimizer.type / params (lr, betas, eps, weight_decay) | optimizer adamw/adam/sgd lr= betas= eps= weight_decay= |
| gradient_clipping | optimizer clip= |
| bf16.enabled / fp16.enabled | precision bf16 / fp16 |

dp is derived: world / (tp × pp) when the world size is known, else
train_batch_size / (micro × accumulation). DeepSpeed's "Adam" is AdamW unless
`adam_w_mode` is false (its FusedAdam decouples weight decay by default).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from parc.errors import ParcError, PlanError

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
    "fp16": "loss scaling is not modelled by parc",
    "optimizer": "parc's optimizers take lr, betas, eps, weight_decay only",
    "pipeline": "DeepSpeed pipeline-engine setting; parc places cuts itself (pipeline stages=auto)",
    "tensor_parallel": "DeepSpeed AutoTP setting",
    "activation_checkpointing": "parc recomputes by module glob: write `recompute \"blocks.*\"`",
    "scheduler": "parc has no learning-rate schedule",
}


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

    def take(self, *keys: str):
        found = [(k, self.flat[k]) for k in keys if k in self.flat]
        self.used += [k for k, _ in found]
        return found[0] if found else (None, None)

    def rest(self) -> list[str]:
        return [k for k in self.flat if k not in self.used]


def translate(config: dict, *, world_size: int | None = None, nodes: int | None = None,
              gpus_per_node: int | None = None, model_paths: list[str] | None = None,
              source: str = "ds_config.json") -> Import:
    """The .par text for `config`; raises ParcError when dp cannot be derived or a number is not one."""
    r = _Reader(config)
    notes: list[str] = []
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
    global_size = _int(gkey, global_size) if gkey else None
    micro = _int(mkey, micro) if mkey else None
    acc = _int(akey, acc) if akey else None

    if world_size is not None:
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

    lines = [f"mesh dp={dp} pp={pp} tp={tp}"]
    if nodes and gpus_per_node:
        lines.append(f"topology nodes={nodes} gpus_per_node={gpus_per_node}")
    lines += _batch(global_size, micro, acc, dp)
    if tp > 1:
        lines += _tp_rules(model_paths, notes)
    if pp > 1:
        lines.append("pipeline schedule=1f1b stages=auto   # DeepSpeed's pipeline engine runs 1F1B")
    skey, stage = r.take("zero_optimization.stage")
    if skey and stage:
        if stage not in (1, 2, 3):
            raise ParcError(f"DeepSpeed zero_optimization.stage must be 0..3, got {stage!r}")
        lines.append(f"zero stage={stage}")
    lines += _precision(r)
    lines += _optimizer(r, notes)

    untranslated = [(k, _why(k)) for k in r.rest()]
    head = [f"# translated from {source} by `parc import-deepspeed`"]
    head += [f"# note: {n}" for n in notes]
    if untranslated:
        head.append("# not translated:")
        head += [f"#   {k}: {why}" for k, why in untranslated]
    return Import("\n".join(head + lines) + "\n", r.used, untranslated, notes, {"dp": dp, "pp": pp, "tp": tp})


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


def _precision(r: _Reader) -> list[str]:
    _, bf16 = r.take("bf16.enabled")
    _, fp16 = r.take("fp16.enabled")
    if bf16 and fp16:
        raise ParcError("DeepSpeed config enables both bf16 and fp16", hint="enable one of them")
    return ["precision bf16"] if bf16 else ["precision fp16"] if fp16 else []


def _optimizer(r: _Reader, notes: list[str]) -> list[str]:
    tkey, kind = r.take("optimizer.type")
    _, clip = r.take("gradient_clipping")
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
                if isinstance(value, str):  # "auto"
                    r.used.remove(key)
                    continue
                parts.append(f"{p}=" + (",".join(repr(float(b)) for b in value) if p == "betas"
                                        else repr(float(value))))
    if clip:  # 0 means no clipping in DeepSpeed
        parts = parts or ["adamw"]
        parts.append(f"clip={float(clip)!r}")
    return ["optimizer " + " ".join(parts)] if parts else []


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
    except PlanError as e:
        errors = [d.message for d in e.diagnostics if d.severity == "error"]
        marks = "".join(f"# error: {m}\n" for m in errors)
        text = text.replace("\n", "\n" + marks, 1)  # after the first comment line
    out.write_text(text, encoding="utf-8")
    return load_plan(out)  # raises with the written file's spans
