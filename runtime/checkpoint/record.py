"""What a checkpoint holds, written beside it, and checked against the run that resumes from it.

Start here: `record(...)` is parc.json (format 2); `compare(saved, plan_json, ...)` is what `--resume`
does with it before reading a tensor:

- model structure: the parameters the checkpoint holds (DCP's index: `model.<fqn>` and its whole shape)
  must be exactly the run's (every trainable parameter of every program in plan.json, whole shape =
  the program's shard × tp parts). A missing or extra FQN, or another shape, is refused in one line:
  loading a 4-layer checkpoint into a 2-layer model would silently drop two layers, a narrower one
  would fail deep inside a copy.
- everything else is reported, not refused (resharding onto another plan is a feature): one line with
  what was loaded, from where, saved under which plan, and every difference in the plan's settings
  (mesh, ZeRO, batch, optimizer, precision, …), the model file, the optimizer state, and the world size
  (each rank's RNG state is restored only when it is unchanged).

Optimizer state is loaded only when the checkpoint holds exactly the state the run's optimizer keeps
(`optimizer_keys`): Adam's moments are meaningless to SGD, and half a state is worse than none.
"""

from __future__ import annotations

import math

from parc.errors import LaunchError

FORMAT = 2
_NOT_SETTINGS = ("source", "sha256", "file")  # the plan's identity, shown apart from its settings


def optimizer_keys(cfg: dict) -> tuple[list[str], list[str]]:
    """(per-parameter state tensors, scalar state) the plan's optimizer keeps (runtime/train.py
    `make_optimizer`: torch's Adam/AdamW keep moments and a step count; SGD without momentum keeps none)."""
    if cfg["name"] in ("adam", "adamw"):
        return ["exp_avg", "exp_avg_sq"], ["step"]
    return [], []


def model_params(plan_json: dict) -> dict[str, list[int]]:
    """Every trainable parameter of the compiled model, by FQN, with its whole (unsharded) shape."""
    out: dict[str, list[int]] = {}
    for prog in plan_json["programs"].values():
        for e in prog["state"]:
            if e["kind"] != "param" or not e["requires_grad"]:
                continue
            shape = list(e["shape"])
            if e["shard"] is not None:
                shape[e["shard"]["dim"]] *= e["shard"]["parts"]
            # an expert slot (expert parallelism): a program names ep rank 0's expert, `ep_fqns` every ep rank's
            for fqn in e.get("ep_fqns") or [e["fqn"]]:
                out[fqn] = shape
    return dict(sorted(out.items()))


def record(plan_json: dict, step: int, world_size: int, program: str, state_keys: list[str],
           scalar_keys: list[str], data: dict | None = None) -> dict:
    """parc.json: what the checkpoint after `step` steps holds and under which plan it was saved. `data`:
    the run's data source and the samples it used (runtime/data.py `describe`, `consumed_samples`)."""
    plan = plan_json["plan"]
    return {
        "format": FORMAT,
        "step": step,
        # get_batch is a function of the step: the next batch is get_batch(step, global batch)
        # a source of samples (runtime/data.py) continues its stream at sample `consumed_samples`
        "data": {"next_step": step, "global_batch": plan["batch"]["global"], **(data or {})},
        "world_size": world_size, "mesh": {a: plan_json["mesh"][a] for a in ("dp", "pp", "tp")},
        "zero": plan["zero"], "program": program,
        "plan": plan,
        "model": {"file": plan_json["model"].get("name"), "sha256": plan_json["model"].get("sha256"),
                  "params": model_params(plan_json)},
        "optimizer": {"name": plan["optimizer"]["name"], "state": sorted(state_keys), "scalars": sorted(scalar_keys)},
    }


def held(meta) -> tuple[dict[str, list[int]], list[str], list[str]]:
    """From DCP's index: (parameters by FQN with shapes, per-parameter optimizer keys, scalar optimizer keys)."""
    md = meta.state_dict_metadata
    params = {k[len("model."):]: list(m.size) for k, m in md.items() if k.startswith("model.")}
    state, scalars = set(), set()
    for k, m in md.items():
        if k.startswith("optim."):
            rest = k[len("optim."):]
            if len(getattr(m, "size", ())) == 0 and "." not in rest:
                scalars.add(rest)
            else:
                state.add(rest.rpartition(".")[2])
    return params, sorted(state), sorted(scalars)


def _few(names: list[str]) -> str:
    more = f", … {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more


def check_model(where, ckpt: dict[str, list[int]], run: dict[str, list[int]]) -> None:
    """Refuse, in one line, a checkpoint of another model structure."""
    missing = sorted(set(run) - set(ckpt))
    extra = sorted(set(ckpt) - set(run))
    shapes = [f for f in sorted(set(run) & set(ckpt)) if list(ckpt[f]) != list(run[f])]
    if not (missing or extra or shapes):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of this model's parameters are not in it ({_few(missing)})")
    if extra:
        parts.append(f"it holds {len(extra)} parameters this model lacks ({_few(extra)})")
    if shapes:
        f = shapes[0]
        parts.append(f"{len(shapes)} shapes differ ({f}: checkpoint {tuple(ckpt[f])} ≠ model {tuple(run[f])})")
    raise LaunchError(f"--resume {where}: saved from another model ({len(ckpt)} parameters, this one has "
                      f"{len(run)}): " + "; ".join(parts) + "; resume with the model it was saved from")


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k} "))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(v) -> str:
    if v is None:  # a setting the plan leaves out: the plan language's word for it
        return "none"
    if isinstance(v, float):
        return f"{v:g}" if math.isfinite(v) else str(v)
    if isinstance(v, list):
        return ",".join(_show(x) for x in v) or "[]"
    return str(v)


def differences(info: dict, plan_json: dict, world_size: int, optim_loaded: bool, ckpt_state: list[str],
                ckpt_scalars: list[str], data: dict | None = None) -> list[str]:
    """Every difference between the run and the checkpoint's record, as short phrases (`data`: the run's
    data source, runtime/data.py `describe`)."""
    out = []
    saved_data = info.get("data", {})
    for k in ("source", "file", "dtype", "samples", "seed") if data is not None else ():
        if k in saved_data and saved_data.get(k) != data.get(k):
            out.append(f"data {k} {_show(saved_data.get(k, '-'))} → {_show(data.get(k, '-'))}")
    saved = info.get("plan")
    now = plan_json["plan"]
    if saved is None:  # format 1: only the mesh and the ZeRO stage were recorded
        saved = {"mesh": info.get("mesh", {}), "zero": info.get("zero")}
        now = {"mesh": {a: now["mesh"][a] for a in ("dp", "pp", "tp")}, "zero": now["zero"]}
    a = {k: v for k, v in _flat(saved).items() if k not in _NOT_SETTINGS}
    b = {k: v for k, v in _flat(now).items() if k not in _NOT_SETTINGS}
    if "mesh ep" in a or "mesh ep" in b:  # recorded only for mesh ep > 1 (parc/compiler.py): absent is ep 1
        a.setdefault("mesh ep", 1)
        b.setdefault("mesh ep", 1)
    if "zero_shard" in a or "zero_shard" in b:  # recorded only under HSDP (parc/compiler.py): absent is all of dp
        a.setdefault("zero_shard", a.get("mesh dp"))
        b.setdefault("zero_shard", b.get("mesh dp"))
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k} {_show(a.get(k, '-'))} → {_show(b.get(k, '-'))}")
    model = info.get("model", {})
    if model.get("sha256") and model["sha256"] != plan_json["model"].get("sha256"):
        out.append(f"model file {model.get('file')} sha256 {model['sha256'][:12]} → "
                   f"{plan_json['model'].get('sha256', '?')[:12]} (same parameters)")
    held_keys = ckpt_state + ckpt_scalars
    if not optim_loaded and held_keys:
        name = plan_json["plan"]["optimizer"]["name"]
        keeps = optimizer_keys(plan_json["plan"]["optimizer"])
        out.append(f"optimizer state ({', '.join(held_keys)}) not loaded: {name} keeps "
                   f"{', '.join(keeps[0] + keeps[1]) or 'none'}")
    elif not optim_loaded and any(optimizer_keys(plan_json["plan"]["optimizer"])):
        out.append("the checkpoint holds no optimizer state: the optimizer starts fresh")
    if info.get("world_size") not in (None, world_size):
        out.append(f"world size {info['world_size']} → {world_size}: each rank's RNG state not restored "
                   f"(dropout masks differ from an uninterrupted run)")
    return out


def summary(where, info: dict, diffs: list[str], global_batch: int) -> str:
    """The one line `--resume` prints."""
    plan = info.get("plan") or {}
    under = (f"plan {plan.get('file', '?')} (sha256 {str(plan.get('sha256', '?'))[:12]})" if plan
             else "an unrecorded plan (parc.json format 1)")
    data = info.get("data", {})
    if data.get("source", "get_batch") == "get_batch":
        nxt = f"next batch get_batch({info['step']}, {global_batch})"
    else:
        nxt = f"next sample {data.get('consumed_samples', '?')} of {data['source']}"
    return (f"resumed from step {info['step']} of {where}, saved under {under} ({nxt}): "
            + ("; ".join(diffs) if diffs else "same plan, batch and optimizer settings"))
