"""The model's own initialization, per shard: each rank keeps only its slices, with the full build's values.

Start here: `init_shards(user, seed, keep)`. Without pretrained weights, the weights a run starts
from are those of `build_model()` under `torch.manual_seed(seed)` on CPU (what `--verify`'s serial
model starts from). Building that whole model on every rank, or once per host, costs one full model
of memory. Instead every rank runs `build_model()` again under the seed with every parameter on
meta (parc/pretrained.py `params_on_meta`) and a dispatch mode that executes each in-place
initialization op on a parameter for real, on a transient CPU tensor of that one parameter, keeping
only the elements `keep` asks for (a tp shard, a stage's parameters; nothing for the others). The
CPU generator sees the same ops on the same shapes, dtypes and strides in the same order as in the
full build, so it draws the same numbers: the kept values are exactly the full build's
(tests/test_init_shards.py). Peak memory: this rank's shards plus the largest parameter.

What it can replay: initial values a parameter is created with (`nn.Parameter(torch.randn(...))`),
any `torch.nn.init.<fill>_` called through the module (trunc_normal_ and orthogonal_ included), random fills (`uniform_`, `normal_`, … any in-place op torch tags nondeterministic_seeded), `fill_`
and `zero_`, in-place pointwise ops (`mul_`, `clamp_`, `erfinv_`: trunc_normal_) and `copy_` from
a tensor that is not a parameter, on a parameter or any view of it. Anything else that reads a
parameter during the build (one parameter copied into another, a buffer computed from a weight,
a trunc_normal_ imported by name before parc could wrap it) raises `Unsupported`, and the caller builds the whole model on CPU instead
(runtime/checkpoint/state.py), as before.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parc.pretrained import params_on_meta, pretrained_as_config

_DEVICE, _IS_META = torch._C.TensorBase.device, torch._C.TensorBase.is_meta  # the real ones (see looking_real)
_CPU = torch.device("cpu")
_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
_COPY = {torch.ops.aten.copy_.default, torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor,
         torch.ops.aten.zero_.default}


class Unsupported(Exception):
    """The build reads a parameter's values: it cannot be replayed one shard at a time."""


class _Param:
    """One parameter being built: its meta tensor, and the elements this rank keeps (flat indices)."""

    def __init__(self, meta: torch.Tensor, index: torch.Tensor | None):
        self.meta, self.index = meta, None if index is None else index.reshape(-1)
        self.shape = None if index is None else index.shape  # the kept shard's shape
        self.values = None if index is None else torch.zeros(index.numel(), dtype=meta.dtype)

    def set_from(self, full: torch.Tensor) -> None:
        if self.index is not None:
            self.values = full.reshape(-1)[self.index].clone()


class _Replay(TorchDispatchMode):
    def __init__(self, by_storage: dict[int, _Param]):
        super().__init__()
        self.by_storage = by_storage

    def _param(self, t) -> _Param | None:
        if isinstance(t, torch.Tensor) and _IS_META.__get__(t):
            return self.by_storage.get(t.untyped_storage()._cdata)
        return None

    @contextlib.contextmanager
    def looking_real(self):
        """Within: a parameter being replayed says it is on CPU, as in the full build. torch.nn.init's
        trunc_normal_, orthogonal_, … return at once on a meta tensor, without drawing: the generator would
        then run ahead of the full build's, silently. Seen as CPU, they run (or read, and are refused)."""
        def device(t):
            return _CPU if self._param(t) is not None else _DEVICE.__get__(t)

        def is_meta(t):
            return False if self._param(t) is not None else _IS_META.__get__(t)

        torch.Tensor.device, torch.Tensor.is_meta = property(device), property(is_meta)
        try:
            yield
        finally:
            del torch.Tensor.device, torch.Tensor.is_meta

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        params = [p for p in map(self._param, flat) if p is not None]
        if not params:
            return func(*args, **kwargs)
        if func.is_view:  # an alias of the parameter, on meta: ops on it are replayed on the parameter
            return func(*args, **kwargs)
        target = self._param(args[0]) if args else None
        tags = set(func.tags)
        inplace = torch.Tag.inplace in tags or func in _COPY
        if target is None or len(params) != 1 or not inplace or \
                not ({torch.Tag.nondeterministic_seeded, torch.Tag.pointwise} & tags or func in _COPY):
            raise Unsupported(f"{func} reads a parameter of shape {tuple(params[0].meta.shape)}")
        if any(isinstance(t, torch.Tensor) and _IS_META.__get__(t) and self._param(t) is None for t in flat):
            raise Unsupported(f"{func} mixes a parameter with another meta tensor")
        if args[0].dtype != target.meta.dtype:
            raise Unsupported(f"{func} writes a parameter through a view of another dtype")
        self.on_full(target, args[0], lambda real: func(real, *args[1:], **kwargs))
        return args[0]

    @staticmethod
    def on_full(target: _Param, view: torch.Tensor, fn) -> None:
        """`fn` on the whole parameter, for real: a CPU tensor with the full build's layout, so a random
        fill draws the same numbers into the same elements; elements this rank does not keep are zeros
        (every op replayed writes its elements without reading others)."""
        full = torch.zeros(target.meta.numel(), dtype=target.meta.dtype)
        if target.index is not None:
            full[target.index] = target.values
        fn(full.as_strided(view.shape, view.stride(), view.storage_offset() - target.meta.storage_offset()))
        target.set_from(full)

    @contextlib.contextmanager
    def whole_inits(self):
        """Within: `torch.nn.init.<fill>_(parameter, ...)` runs whole on a CPU copy (`on_full`). Each writes
        every element from the generator alone (trunc_normal_ rejects and redraws, orthogonal_ takes a QR
        of what it drew), never from the tensor's values, so replaying it on zeros is exact."""
        saved = {}
        for name in _INITS:
            original = saved[name] = getattr(torch.nn.init, name)

            def replay(tensor, *args, _original=original, **kwargs):
                target = self._param(tensor)
                if target is None:
                    return _original(tensor, *args, **kwargs)
                self.on_full(target, tensor, lambda real: _original(real, *args, **kwargs))
                return tensor

            setattr(torch.nn.init, name, replay)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


def init_shards(user, seed: int, keep: dict[str, dict | None]) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """({fqn: this rank's value} for every FQN in `keep` (value: `keep[fqn]`'s shard spec, as
    runtime/checkpoint/state.py `shard`, or None for whole), the model with parameters on meta and real buffers)."""
    from parc.runtime.checkpoint.state import shard

    order: list[torch.Tensor] = []
    skeleton = _attempt(lambda: _build(user, seed, order))
    names: dict[int, list[str]] = {}
    for n, p in skeleton.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    plan = []  # per created parameter, in creation order: (fqn kept, its spec) or None
    for p in order:
        kept = [n for n in names.get(id(p), []) if n in keep]
        plan.append((kept[0], keep[kept[0]]) if kept else None)

    created: list[_Param] = []
    by_storage: dict[int, _Param] = {}

    def on_create(cpu_value: torch.Tensor, meta: torch.Tensor) -> None:
        i = len(created)
        if i >= len(plan):
            raise Unsupported("the build created more parameters the second time")
        index = None
        if plan[i] is not None:
            numel = meta.numel()
            index = shard(torch.arange(numel).view(meta.shape), plan[i][1])
        p = _Param(meta, index)
        p.set_from(cpu_value.detach())
        created.append(p)
        by_storage[meta.untyped_storage()._cdata] = p

    model = _attempt(lambda: _build(user, seed, None, on_create, _Replay(by_storage)))
    if len(created) != len(plan):
        raise Unsupported("the build created fewer parameters the second time")
    # `param.data = tensor` swaps a parameter's storage without an op the mode sees: its record is stale
    if any(not _IS_META.__get__(p.meta) or p.meta.untyped_storage()._cdata not in by_storage for p in created):
        raise Unsupported("a parameter's data was replaced during the build")
    bad = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if bad:
        raise Unsupported(f"buffer {bad[0]} was made from a parameter")
    out = {}
    for p, kept in zip(created, plan):
        if kept is not None:
            out[kept[0]] = p.values.view(p.shape)
    return out, model


def _attempt(build):
    """A build that fails with parameters on meta (`param.data = cpu_tensor` is refused there) may still
    succeed on CPU: Unsupported sends the caller to the full build, which raises a real error itself."""
    try:
        return build()
    except Unsupported:
        raise
    except Exception as e:  # noqa: BLE001
        raise Unsupported(f"the build fails with parameters on meta: {type(e).__name__}: {e}") from e


def _build(user, seed: int, order: list | None, on_create=None, mode=None) -> torch.nn.Module:
    torch.manual_seed(seed)
    with params_on_meta(order, on_create), pretrained_as_config([]):
        if mode is None:
            model = user.build_model()
        else:
            with mode, mode.looking_real(), mode.whole_inits():
                model = user.build_model()
    model.train()
    return model


def own_init(entries: list[dict], user, seed: int, device: torch.device) -> list[torch.Tensor] | None:
    """This rank's state for plan.json `entries` from the model's own init (`init_shards`), or None when the
    build cannot be replayed on some rank: then every rank takes runtime/checkpoint/state.py's `load_state` (collective
    over all ranks: they agree on the path)."""
    import torch.distributed as dist

    from parc.runtime.checkpoint.state import shard
    from parc.traced import get

    keep = {e["fqn"]: e["shard"] for e in entries if "value" not in e and e["kind"] == "param"}
    try:
        values, skeleton = init_shards(user, seed, keep)
    except Unsupported:
        values = skeleton = None
    ok = torch.tensor(float(values is not None), device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return None
    out = []
    for e in entries:
        if "value" in e:
            t = torch.tensor(e["value"], dtype=getattr(torch, e["dtype"]))
        elif e["fqn"] in values:
            t = values[e["fqn"]]
        else:  # buffers and constants: real in the skeleton, and built under the seed
            t = shard(get(skeleton, e["fqn"]).detach(), e["shard"])
        if tuple(t.shape) != tuple(e["shape"]):
            raise RuntimeError(f"{e['fqn']}: model gives shape {tuple(t.shape)} but the program was compiled for "
                               f"{tuple(e['shape'])}; the model file changed since `parc compile`?")
        out.append(t.to(device).clone().requires_grad_(e["kind"] == "param" and e["requires_grad"]))
    return out
