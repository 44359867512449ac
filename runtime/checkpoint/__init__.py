"""Where a rank's state comes from and where it goes: initial weights, checkpoints, their files.

Reading order:

  state.py        a program's state entries (plan.json `state`) and the tp slice of each: `shard`,
                  `unshard`, `block_sizes`; the fallback that builds the model once per host
  init_shards.py  the model's own init replayed per shard (what a fresh run starts from)
  weights.py      pretrained safetensors weights, each rank reading only its slices
  sharded.py      save and resume: whole-shaped DCP checkpoints any plan can read (`Saver`, `resume`,
                  `load`, `read`)
  record.py       parc.json beside each checkpoint: what it holds, under which plan, checked at resume
  files.py        the directory: `step_<N>/`, `latest`, temporary saves; refusing a damaged one

`Saver`, `save`, `resume`, `load`, `read`, `resolve`, `SaveFailed` and `LATEST` are importable from here
(`from parc.runtime import checkpoint; checkpoint.save(...)`). They are loaded on first use, so
importing `state` at compile time does not import torch.distributed.checkpoint.
"""

_API = ("LATEST", "SaveFailed", "Saver", "load", "read", "resolve", "resume", "save")


def __getattr__(name):
    if name in _API:
        from parc.runtime.checkpoint import sharded

        return getattr(sharded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
