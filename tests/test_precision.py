"""`precision bf16` trains in bf16 with fp32 masters; `precision fp16` is refused at compile time.

One spawned dp=2 world trains two artifacts (plain DP and ZeRO-2, both bf16) and,
on the side, records the dtypes the program's matmuls really ran in. Both share
one plan apart from `zero`, so one serial bf16 run (runtime/verify.py, autocast
too) is the reference for both.
"""


import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import GPT, compile_text
from parc import artifact
from parc.compiler import compile_model
from parc.errors import ParcError
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

STEPS = 2
# Tighter than runtime/verify.py's BF16_TOLERANCE (1e-2, sized for lr up to 1e-2): at lr 1e-3 bf16
# rounding noise measures ≤ 5e-4 here (AdamW moves noise-gradient entries by ±lr, so noise ∝ lr),
# while a quarter of the batch lost measures 1.4e-2 on the parameters (1e-3 on the losses).
TOLERANCE = 2e-3
PLAN = """
mesh dp=2
batch global=8 micro=2          # accumulation 2
{zero}
precision bf16
optimizer adamw lr=1e-3 clip=0.5
"""
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


class _MatmulDtypes(TorchDispatchMode):
    """Dtypes of the matmul inputs that reach the kernels (below autocast, which has cast them already)."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in MATMULS:
            self.seen.add(next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2))
        return func(*args, **(kwargs or {}))


def _body(ctx, roots: list[str]):
    out = []
    for root in roots:
        trainer = Trainer.load(root, 0)
        local = [trainer.step(s).loss for s in range(STEPS)]
        params = list(trainer.params.values())
        masters = {p.dtype for p in params}
        with _MatmulDtypes() as rec:
            (loss,) = trainer.forward(*trainer.state, *trainer.local_batches(0)[0])
        out.append({"losses": trainer.global_losses(local), "state": trainer.gathered_state() if ctx.rank == 0 else None,
                    "masters": masters, "matmuls": rec.seen, "loss_dtype": loss.dtype})
    return out


def test_bf16_dp_and_zero2_match_serial_bf16(tmp_path):
    roots = [compile_text(PLAN.format(zero=z), tmp_path / name).root
             for name, z in (("dp", ""), ("zero2", "zero stage=2"))]
    results = spawn(2, _body, [str(r) for r in roots])
    art = artifact.load(roots[0])
    serial_losses, serial_state = train_serial(load_user_module(art.root / "model" / "model.py"), art.plan, 0, STEPS)
    for name, res in zip(("dp", "zero2"), results[0]):
        # compute really is bf16: every matmul the program ran took bf16 inputs (autocast cast them) …
        assert res["matmuls"] == {torch.bfloat16}, (name, res["matmuls"])
        # … while the parameters the optimizer updates stay fp32 masters, and the loss is fp32
        assert res["masters"] == {torch.float32} and res["loss_dtype"] == torch.float32, name
        verdict = compare(res["losses"], serial_losses, res["state"], serial_state, TOLERANCE)
        print(name, verdict.render())
        assert verdict.ok, (name, verdict.render())


def test_fp16_is_refused_at_the_precision_statement(tmp_path):
    text = "mesh dp=2\nbatch global=8 micro=2\nprecision fp16\n"
    plan = parse(text, file=str(tmp_path / "fp16.par"))
    with pytest.raises(ParcError) as err:
        compile_model(GPT, plan, tmp_path / "out")
    assert "loss scaling" in err.value.message and "precision bf16" in err.value.diagnostics[0].hint
    assert (err.value.span.line, err.value.span.col) == (3, 11)  # the `fp16` token
    assert not (tmp_path / "out").exists()  # refused before anything is written
