"""The gradient probe: the traced program's gradients against eager's, on one real sample, at compile.

Start at `probe(user, traced, micro_batch)`. parc trains autograd of the traced graph; parc/trace_guards.py
refuses, located, every hand-made backward it knows torch.export drops. This is the net under that list:
whatever else makes the traced backward differ from eager's (a torch feature no rule names yet) is caught
here, before launch, naming the parameter whose gradient differs most.

How. The model is built on CPU under `torch.manual_seed(seed)`, in train mode, and `get_batch(0, micro_batch)`
is one real micro-batch. Eager: `loss_fn(model, *batch)` and autograd of it. Traced: `traced.gm` on the same
model's state and batch (parc.traced.state_values) and autograd of its loss. Both run the same CPU kernels in
fp32 on the same values.

When it runs (`--grad-probe`, on by default in `parc compile` and `parc check --model`):
- the model has at most MAX_PROBE_PARAMS parameters (its fp32 weights, gradients and one forward fit in a
  few GiB of host memory); a larger one is not probed;
- its random ops are dropouts parc keys: the program's copy goes through passes/dropout.py, as compile's does,
  and eager runs under runtime/dropout.py's `serial_keys`, so both draw the same masks (a pure function of
  seed, step, call site and element, as `--verify`'s serial reference draws them). A random op parc does not
  key (`rand*`, `bernoulli`, feature/alpha dropout) would draw different values in the two runs, and the probe
  must never refuse a correct model: such a model is not probed (rely on `--verify` at run time);
- one step of it runs on CPU (a model written for an accelerator only is not probed).

Tolerance, and why it cannot refuse a correct model for rounding: per parameter, max |g_traced − g_eager|
over the larger of the two gradients' max |g| (floored at 1e-6 of the largest gradient of the model, so an
all-but-zero gradient is not judged on noise), refused above RTOL = 1e-3. The program's ops are eager's ops,
decomposed at most (`linear` as `addmm`, say): fp32 reorderings that move a gradient by ~1e-6 of its scale on
these sizes, three orders of magnitude below RTOL. A dropped backward (a constant where eager had one, a
gradient that flows where eager's does not) moves it by O(1).
"""

from __future__ import annotations

import copy

import torch

from parc.errors import TraceError
from parc.traced import Traced, state_values

MAX_PROBE_PARAMS = 50_000_000  # 200 MB of fp32 weights, as much again of gradients
RTOL = 1e-3


def skip_reason(traced: Traced, program: torch.fx.GraphModule) -> str | None:
    """Why the probe does not run on this model (`program`: its runnable copy, `_runnable`), or None."""
    if traced.param_count > MAX_PROBE_PARAMS:
        return f"{traced.param_count:,} parameters > {MAX_PROBE_PARAMS:,}"
    random = [n for n in program.graph.nodes if _draws(n)]
    if random:
        return f"the program draws random numbers parc does not key (`{random[0].target}` in `{random[0].name}`)"
    return None


def _draws(node) -> bool:
    """Whether the node draws random numbers: a seeded op, except attention or dropout with probability 0
    (or dropout with train=False)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded not in t.tags:
        return False
    p = _arg(node, "dropout_p", _arg(node, "p", True))
    return bool(p) and bool(_arg(node, "train", True))


def _arg(node, name: str, absent):
    """The value of the node's argument `name` (given, or the schema's default); `absent` if it has none."""
    args = node.target._schema.arguments
    for i, a in enumerate(args):
        if a.name == name:
            return node.kwargs.get(name, node.args[i] if i < len(node.args) else a.default_value)
    return absent


def probe(user, traced: Traced, micro_batch: int, seed: int = 0) -> str | None:
    """Raise a TraceError if the traced program's gradients differ from eager's; return why it was skipped,
    or None when it ran and they agree."""
    if traced.param_count > MAX_PROBE_PARAMS:  # (before copying a graph that large)
        return skip_reason(traced, traced.gm)
    program, sites = _runnable(traced, micro_batch)
    why = skip_reason(traced, program)
    if why is not None:
        return why
    try:
        named, eager, program = _gradients(user, traced, program, sites, micro_batch, seed)
    except Exception as e:  # noqa: BLE001 — a model that runs only on an accelerator: not probed, never refused
        return f"one step on CPU failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    top = max([g.abs().max().item() for g in (*eager, *program) if g is not None] + [0.0])
    worst = max(((_rel(a, b, top), name) for (name, _), a, b in zip(named, program, eager)), default=(0.0, ""))
    if worst[0] > RTOL:
        raise TraceError(f"the traced program's gradient of `{worst[1]}` differs from eager PyTorch's by "
                         f"{worst[0]:.2e} of its scale (> {RTOL:g}) on one real micro-batch: some op in the model "
                         f"has a backward torch.export does not keep", None,
                         hint="look for hand-made backward behaviour in the module that owns it (docs/"
                              "model-convention.md, \"Custom backward\"); `--no-grad-probe` skips this check")
    return None


def _gradients(user, traced: Traced, program: torch.fx.GraphModule, sites: list[dict], micro_batch: int, seed: int):
    """(name, parameter) pairs, eager's gradients and the program's, from one build and one batch; every dropout
    in `sites` keyed alike in both."""
    from parc.runtime.dropout import key_scope, serial_keys

    torch.manual_seed(seed)
    model = user.build_model().train()
    batch = tuple(user.get_batch(0, micro_batch))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # step 0, the micro-batch's first sample is sample 0: both runs key every dropout alike
    with key_scope(seed, 0, 0), serial_keys(model, sites, micro_batch, micro_batch):
        eager = torch.autograd.grad(user.loss_fn(model, *batch), [p for _, p in named], allow_unused=True)
    with key_scope(seed, 0, 0):
        (loss,) = program(*state_values(traced, model), *batch)
        return named, eager, torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)


def _runnable(traced: Traced, micro_batch: int) -> tuple[torch.fx.GraphModule, list[dict]]:
    """A copy of the traced graph with the rewrites compile makes before any pass reads values (passes/portable.py:
    HF's MoE takes a branch on meta, `histc` of int ids, that CPU kernels lack) and compile's keyed dropout
    (passes/dropout.py), with the dropout sites it keyed; the traced graph itself is unchanged."""
    from types import SimpleNamespace

    from parc.passes import PassCtx, dropout, portable
    ctx = PassCtx(traced)
    gm = portable.run(copy.deepcopy(traced.gm), None, ctx)
    gm = dropout.run(gm, SimpleNamespace(micro_batch=micro_batch), ctx)
    return gm, ctx.notes["dropout"]["sites"]


def _rel(a: torch.Tensor | None, b: torch.Tensor | None, top: float) -> float:
    """max |a − b| over the larger max |·| of the two (floored at 1e-6 · top); a gradient on one side only is 1."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        other = a if a is not None else b
        return 0.0 if other.abs().max().item() == 0 else 1.0
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-6 * top, 1e-30)
    return (a - b).abs().max().item() / scale
