"""Building the user's model without its weights: parameters on meta, `from_pretrained` as a config.

Start here: `build_skeleton(user)` runs the model file's `build_model()` so that every
parameter lands on the meta device (no memory) while buffers stay real CPU tensors (RoPE's
`inv_freq`, a causal mask: values computed in `__init__` that no weights file holds), and
returns the model with the checkpoint directories any `from_pretrained` call named.
`pretrained_as_config()` is the part the tracer (parc/trace.py) also uses: inside it,
`transformers.PreTrainedModel.from_pretrained(path, ...)` builds the model from
`path`'s config.json (`_from_config`) and reads no weights, so it works on meta. The
runtime then reads each rank's own slices from `path` (runtime/checkpoint/weights.py).

Assumes: a parameter is created by assigning an `nn.Parameter` to a module (which calls
`register_parameter`), as torch's and transformers' modules do. Guarantees: the skeleton's
parameters are meta tensors of the real shapes, dtypes and `requires_grad`, tied parameters
stay one object, and nothing of the weights is read.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from pathlib import Path

import torch

# from_pretrained's keywords that shape the model built from its config; the rest (device_map,
# local_files_only, revision, …) concern reading weights, which the runtime does itself
_CONFIG_KWARGS = ("attn_implementation", "dtype", "torch_dtype")


@contextlib.contextmanager
def pretrained_as_config(paths: list[Path]):
    """Within: `PreTrainedModel.from_pretrained(p, ...)` returns `cls._from_config(AutoConfig(p))` in train
    mode and appends `p` to `paths`. Without transformers installed, nothing changes.

    transformers is patched only where the model uses it: at once if it is imported already (a model file
    that imports it at its top), else the moment something inside imports it (`_AfterImport`). A model
    that never imports it cannot call `from_pretrained`, and importing it costs every rank of every run
    seconds at start-up (2.6 s measured here, most of `Trainer.load` for examples/gpt.py)."""
    undo: list = []

    def patch(transformers) -> None:
        base = transformers.PreTrainedModel
        original = base.__dict__["from_pretrained"]

        def from_config(cls, path, *args, config=None, **kwargs):
            if config is None or isinstance(config, (str, Path)):
                config = transformers.AutoConfig.from_pretrained(config or path)
            given = {k: kwargs[k] for k in _CONFIG_KWARGS if k in kwargs and kwargs[k] != "auto"}
            if "dtype" not in given and "torch_dtype" not in given and getattr(config, "dtype", None) is not None:
                given["dtype"] = config.dtype  # from_pretrained's default "auto": the dtype the config was saved in
            paths.append(Path(path))
            return cls._from_config(config, **given)

        base.from_pretrained = classmethod(from_config)
        undo.append(lambda: setattr(base, "from_pretrained", original))

    hook = None
    if "transformers" in sys.modules:
        patch(sys.modules["transformers"])
    else:
        hook = _AfterImport("transformers", patch)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        for step in undo:
            step()


class _AfterImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: when `name` is first imported, `then(module)` runs once the module has executed
    (with what the module left in sys.modules: transformers replaces itself by a lazy module)."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            self.then(sys.modules.get(fullname, module))

        spec.loader.exec_module = exec_module
        return spec


@contextlib.contextmanager
def params_on_meta(order: list | None = None, on_create=None):
    """Within: every parameter a module registers moves to meta at once (its CPU value, at most one
    parameter at a time, is dropped); buffers stay where they were made. `accelerate`'s
    `init_empty_weights(include_buffers=False)` does the same. Each meta parameter made is appended to
    `order`, and `on_create(cpu_value, meta)` sees it (runtime/checkpoint/init_shards.py)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        # TensorBase's own is_meta: during a replay (runtime/checkpoint/init_shards.py) torch.Tensor's says False
        if param is not None and not torch._C.TensorBase.is_meta.__get__(param):
            kind = type(param)
            meta = module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)
            if order is not None:
                order.append(meta)
            if on_create is not None:
                on_create(param, meta)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_skeleton(user, seed: int = 0) -> tuple[torch.nn.Module, list[Path]]:
    """The user's model with parameters on meta and real buffers, in train mode, and the directories
    its `from_pretrained` calls named (empty when it builds from scratch)."""
    paths: list[Path] = []
    torch.manual_seed(seed)  # a buffer drawn from the RNG gets the full build's value only if nothing
    with params_on_meta(), pretrained_as_config(paths):  # drew before it: see docs/weights.md
        model = user.build_model()
    model.train()
    return model, paths


def is_hf_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers `PreTrainedModel` (it has a config that `from_pretrained` reads). A model
    built while transformers was never imported is none, and the seconds of importing it are not spent."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)
