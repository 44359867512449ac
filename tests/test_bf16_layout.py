"""`precision bf16` as Megatron and FSDP2 keep it (runtime/precision.py), against the serial bf16 model.

One spawned 2-rank world trains every plan below for 2 steps; they share the batch, the
optimizer and the precision, so one serial run (runtime/verify.py: bf16 copies of fp32
masters, fp32 gradients, autocast) is the reference for all. Besides the numbers it checks
the layout itself: the masters and their gradients are fp32, every matmul runs in bf16, the
activations autograd saves at a recompute boundary (the residual stream) are bf16, and
`reduce=bf16` halves the bytes the dp reduction moves, as the report predicts.
(`precision fp16`'s refusal is tests/test_precision.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import compile_text, gpt_tp_rules
from parc import artifact
from parc.analysis import report
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

STEPS = 2
COMMON = "batch global=8 micro=2\n{extra}precision bf16{reduce}\noptimizer adamw lr=1e-3 clip=0.5\n"
PLANS = {
    "dp": ("mesh dp=2\n", 'recompute "blocks.*"\n', ""),      # recompute: the residual stream is saved
    "dp_reduce_bf16": ("mesh dp=2\n", "", " reduce=bf16"),
    "zero1": ("mesh dp=2\n", "zero stage=1\n", ""),      # fp32 master ranges beside a bf16 flat buffer
    "zero2": ("mesh dp=2\n", "zero stage=2\n", ""),
    "zero3_reduce_bf16": ("mesh dp=2\n", "zero stage=3\n", " reduce=bf16"),
    "tp_sp": ("mesh tp=2\n", gpt_tp_rules(sequence_parallel=True), ""),
    "pp_1f1b": ("mesh pp=2\n", "pipeline schedule=1f1b\n", ""),
}
# bf16 rounds each matmul's inputs to 8 mantissa bits (~4e-3 relative). The serial run rounds the same
# fp32 masters the same way; what differs is summation order (micro-batches, dp/tp reductions, a bf16
# reduction with reduce=bf16) pushed through bf16 activations, then AdamW, which moves an entry whose
# gradient is mostly rounding noise by ±lr either way, so the difference grows with lr. At lr 1e-3 it
# measures ≤ 5.6e-4 on the parameters here, losses ≤ 2e-5; a quarter of the batch lost measures 1.4e-2.
TOLERANCE = 2e-3
# Tensor parallelism rounds twice where serial rounds once: each rank's row-layer partial product is
# rounded to bf16 and the partials are summed in bf16 over tp (Megatron does the same), where the serial
# matmul accumulates in fp32 and rounds its output once. Measured: parameters 1.6e-3, losses 1.2e-4.
TOLERANCES = {"tp_sp": 4e-3}


def _bytes_of(fn, sent: list, which):
    def call(*args, **kwargs):
        t = which(args)
        sent.append(t.numel() * t.element_size())
        return fn(*args, **kwargs)
    return call


def _body(ctx, roots: dict[str, str]):
    out = {}
    for name, root in roots.items():
        trainer = Trainer.load(root, 0)
        sent: list[int] = []
        originals = dist.all_reduce, dist.reduce_scatter_tensor
        dist.all_reduce = _bytes_of(originals[0], sent, lambda a: a[0])
        dist.reduce_scatter_tensor = _bytes_of(originals[1], sent, lambda a: a[1])  # the whole flat input
        try:
            local = [trainer.step(s).loss for s in range(STEPS)]
        finally:
            dist.all_reduce, dist.reduce_scatter_tensor = originals
        res = {"losses": trainer.global_losses(local), "state": trainer.gathered_state(),
               "sent": sum(sent) // STEPS, "masters": {p.dtype for g in (trainer.zero or trainer).optimizer.param_groups for p in g["params"]}}
        if name == "dp":  # one more forward, recording what autograd saves and what the matmuls take
            saved, matmuls = [], set()

            def pack(t):
                saved.append((t.dtype, tuple(t.shape)))
                return t
            trainer.casts.refresh()
            # the program's layout as written: under PARC_TEST_COMPILE its compiled form runs eagerly here, since
            # dynamo cannot trace under a dispatch mode (the training above ran compiled)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Matmuls(matmuls), \
                    torch.compiler.set_stance("force_eager"):
                (loss,) = trainer.forward(*trainer.state, *trainer.local_batches(0)[0])
            loss.backward()
            res.update(saved=saved, matmuls=matmuls, loss_dtype=loss.dtype,
                       grads={p.grad.dtype for p in trainer.params.values() if p.grad is not None})
        out[name] = res if ctx.rank == 0 else None
    return out


class _Matmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Dtypes of the matmul inputs that reach the kernels."""

    def __init__(self, seen: set):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "baddbmm"):
            self.seen.add(next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16_layout")
    roots = {name: compile_text(mesh + COMMON.format(extra=extra, reduce=reduce), tmp / name).root
             for name, (mesh, extra, reduce) in PLANS.items()}
    results = spawn(2, _body, {n: str(r) for n, r in roots.items()})[0]
    art = artifact.load(roots["dp"])
    serial = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    return roots, results, serial


@pytest.mark.parametrize("name", PLANS)
def test_matches_serial_bf16(runs, name):
    _, results, (serial_losses, serial_state) = runs
    res = results[name]
    verdict = compare(res["losses"], serial_losses, res["state"], serial_state, TOLERANCES.get(name, TOLERANCE))
    print(name, verdict.render())
    assert verdict.ok, (name, verdict.render())
    assert res["masters"] == {torch.float32}, name  # what the optimizer updates (ZeRO: the rank's ranges) is fp32


def test_the_layout(runs):
    res = runs[1]["dp"]
    assert res["matmuls"] == {torch.bfloat16} and res["grads"] == {torch.float32}
    assert res["loss_dtype"] == torch.float32
    C = 64  # examples/gpt.py's n_embd: (B, T, C) values are the residual stream and what reads it
    stream = {dtype for dtype, shape in res["saved"] if len(shape) == 3 and shape[-1] == C}
    assert stream == {torch.bfloat16}, res["saved"]


def test_reduce_bf16_halves_the_dp_bytes(runs):
    roots, results, _ = runs
    # dp-only plans: every all-reduce of the step is the dp gradient reduction
    assert results["dp_reduce_bf16"]["sent"] * 2 == results["dp"]["sent"] > 0
    rows = {n: {c["collective"]: c["bytes_per_rank"] for c in report.build(roots[n])["communication"]["rows"]
                if c["axis"] == "dp"}
            for n in ("dp", "dp_reduce_bf16")}
    assert rows["dp_reduce_bf16"]["all-reduce"] * 2 == rows["dp"]["all-reduce"] > 0
