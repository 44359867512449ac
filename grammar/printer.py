"""The canonical printer: `Plan` → plan text, such that parse(format_plan(p)) == p.

Start at `format_plan`. The canonical form is what `parc` writes into compiled/
and what the golden tests compare against:

Assumes a `Plan` (parsed or built in code). Guarantees: the output parses back to
an equal `Plan`, and equal plans print byte-identically (compiled/ hashes it).

- statements in the order of the language reference: mesh, topology, batch,
  tensor_parallel, pipeline, zero, recompute, precision, optimizer, compile;
- `mesh` always, with all three degrees (and `order=` only when not the default);
  every other statement and key only when it differs from its default;
- numbers as Python's shortest round-tripping repr, bandwidths in the largest
  decimal unit that keeps the value exact (900e9 → 900GB/s);
- tensor_parallel rules one per line, colons aligned; expert_parallel globs one per line
  after them; `ep=` on the mesh line only when not 1. Comments are not kept.
"""

from __future__ import annotations

from parc.grammar.plan import (AXES, CP_DEFAULT_ORDER, DEFAULT_ORDER, LOSS_SCALING_KEYS, ContextParallel, LossScaling,
                               Optimizer, Plan, Topology)

_UNITS = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3))


def format_plan(plan: Plan) -> str:
    lines = [_mesh(plan)]
    if plan.topology != Topology():
        lines.append(_topology(plan.topology))
    if plan.batch is not None:
        b = plan.batch
        acc = f" accumulation={b.accumulation}" if b.accumulation is not None else ""
        lines.append(f"batch global={b.global_size} micro={b.micro}{acc}")
    tp = plan.tensor_parallel
    if tp.rules or tp.sequence_parallel:
        width = max((len(r.pattern) + 2 + r.optional for r in tp.rules), default=0)
        body = [f'    {_quote(r.pattern) + "?" * r.optional:<{width}} : {r.style}' for r in tp.rules]
        body += ["    sequence_parallel"] if tp.sequence_parallel else []
        lines += ["tensor_parallel {", *body, "}"]
    if plan.expert_parallel.patterns:
        lines += ["expert_parallel {", *(f"    {_quote(p)}" for p in plan.expert_parallel.patterns), "}"]
    if plan.pipeline is not None:
        lines.append(_pipeline(plan.pipeline))
    if plan.zero.stage != 0:
        shard = f" shard={plan.zero.shard}" if plan.zero.shard is not None else ""
        offload = f" offload={plan.zero.offload}" if plan.zero.offload is not None else ""
        lines.append(f"zero stage={plan.zero.stage}{shard}{offload}")
    if plan.recompute.patterns:
        rc = plan.recompute
        lines.append("recompute " + " ".join(_quote(p) + "?" * (p in rc.optional) for p in rc.patterns))
    if plan.precision != "fp32" or plan.grad_reduce != "fp32" or plan.grad_accumulate != "fp32":
        reduce = f" reduce={plan.grad_reduce}" if plan.grad_reduce != "fp32" else ""
        reduce += f" accumulate={plan.grad_accumulate}" if plan.grad_accumulate != "fp32" else ""
        lines.append(f"precision {plan.precision}{reduce}{_loss_scaling(plan.loss_scaling)}")
    if plan.optimizer != Optimizer():
        lines.append(_optimizer(plan.optimizer))
    if plan.compile != "none":
        lines.append(f"compile {plan.compile}")
    if plan.context_parallel != ContextParallel():
        lines.append(f"context_parallel {plan.context_parallel.method}")
    return "\n".join(lines) + "\n"


def _loss_scaling(ls: LossScaling) -> str:
    """fp16's scaler keys that differ from DeepSpeed's defaults."""
    base = LossScaling()
    return "".join(f" {k}={getattr(ls, k):g}" if isinstance(getattr(ls, k), float) else f" {k}={getattr(ls, k)}"
                   for k in LOSS_SCALING_KEYS if getattr(ls, k) != getattr(base, k))


def _quote(pattern: str) -> str:
    return f'"{pattern}"'


def _mesh(plan: Plan) -> str:
    mesh = plan.mesh
    text = "mesh " + " ".join(f"{a}={mesh.degree(a)}" for a in AXES)
    if mesh.ep != 1:
        text += f" ep={mesh.ep}"
    if mesh.cp != 1:
        text += f" cp={mesh.cp}"
    if tuple(mesh.order) != (CP_DEFAULT_ORDER if mesh.cp != 1 else DEFAULT_ORDER):
        text += " order=" + ",".join(mesh.order)
    return text


def _bandwidth(bps: float) -> str:
    """The largest unit giving a whole number (300GB/s, not 0.3TB/s), else the largest that
    reads back exactly; the parser computes number × unit, so that is the test."""
    exact = [(_number(bps / scale), unit, scale) for unit, scale in _UNITS]
    exact = [(n, u) for n, u, s in exact if float(n) * s == bps]
    whole = [(n, u) for n, u in exact if "." not in n and "e" not in n]
    if whole or exact:
        number, unit = (whole or exact)[0]
        return number + unit
    return _number(bps) + "B/s"


def _number(x: float) -> str:
    """Shortest text that reads back as x; integral floats without the trailing .0."""
    return str(int(x)) if x == int(x) and abs(x) < 1e16 else repr(x)


def _topology(t: Topology) -> str:
    base = Topology()
    parts = []
    if t.preset is not None:
        parts.append(f"preset={t.preset}")
    if t.nodes != base.nodes:
        parts.append(f"nodes={t.nodes}")
    if t.gpus_per_node != base.gpus_per_node:
        parts.append(f"gpus_per_node={t.gpus_per_node}")
    if t.intra_bw is not None:
        parts.append(f"intra={_bandwidth(t.intra_bw)}")
    if t.inter_bw is not None:
        parts.append(f"inter={_bandwidth(t.inter_bw)}")
    return " ".join(["topology", *parts])


def _pipeline(p) -> str:
    text = f"pipeline schedule={p.schedule} stages={'auto' if p.stages is None else p.stages}"
    if p.virtual != 1:
        text += f" virtual={p.virtual}"
    if p.cuts is not None:
        cuts = [f"    cut {c.where} {_quote(c.path)}" for c in p.cuts]
        text += " {\n" + "".join(c + "\n" for c in cuts) + "}"
    return text


def _optimizer(o: Optimizer) -> str:
    base = Optimizer()
    parts = [f"optimizer {o.name}"]
    if o.lr != base.lr:
        parts.append(f"lr={repr(float(o.lr))}")
    if tuple(o.betas) != base.betas:
        parts.append("betas=" + ",".join(repr(float(b)) for b in o.betas))
    if o.eps != base.eps:
        parts.append(f"eps={repr(float(o.eps))}")
    if o.weight_decay != base.weight_decay:
        parts.append(f"weight_decay={repr(float(o.weight_decay))}")
    if o.grad_clip is not None:
        parts.append(f"clip={repr(float(o.grad_clip))}")
    if o.warmup != base.warmup:
        parts.append(f"warmup={o.warmup}")
    if o.decay != base.decay:
        parts.append(f"decay={o.decay}")
    if o.decay_steps is not None:
        parts.append(f"decay_steps={o.decay_steps}")
    if o.min_lr is not None:
        parts.append(f"min_lr={repr(float(o.min_lr))}")
    if tuple(o.no_decay) != base.no_decay:
        parts.append("no_decay=" + ",".join(o.no_decay))
    return " ".join(parts)
