"""The plans the zoo tries on every family: `PLANS[name]` is a Plan spec, `text(spec, tp_block)` its .par text.

The optimizer is plain SGD, not AdamW: Adam divides each gradient by its own magnitude, so a parameter whose
gradient is rounding noise (an attention key bias) moves by ±lr in both runs, differently; with SGD a final
parameter's difference from serial stays lr × the gradients' difference (run.py also compares step 0's
gradients directly, as `--verify` does).
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZER = "optimizer sgd lr=0.5"


@dataclass(frozen=True)
class Spec:
    mesh: str                  # "dp=2 pp=2 tp=2"
    batch: str                 # "global=4 micro=2"
    tp: bool = False           # needs tensor_parallel rules
    sequence_parallel: bool = False
    extra: str = ""            # pipeline, zero, precision statements

    @property
    def world_size(self) -> int:
        out = 1
        for kv in self.mesh.split():
            out *= int(kv.split("=")[1])
        return out


PLANS = {
    "tp2": Spec("tp=2", "global=4 micro=2", tp=True),
    "tp2_sp": Spec("tp=2", "global=4 micro=2", tp=True, sequence_parallel=True),
    # the tiny configs' 4 q heads and 2 kv heads at tp 4: fewer kv heads than tp, each rank computing the kv
    # head its q head uses (Megatron's kv-subset form, passes/tp_subset.py) or, where that form cannot
    # follow the family's ops, k and v kept whole (passes/tp_gqa.py)
    "tp4": Spec("tp=4", "global=4 micro=2", tp=True),
    "pp2": Spec("pp=2", "global=4 micro=1", extra="pipeline schedule=1f1b stages=auto\n"),
    "dp2_zero3": Spec("dp=2", "global=4 micro=1", extra="zero stage=3\n"),
    "tp2_bf16": Spec("tp=2", "global=4 micro=2", tp=True, extra="precision bf16\n"),
    # 8 ranks: dp × pp × tp with SP and ZeRO-1 (ZeRO-3 with pp > 1 is refused by design)
    "3d": Spec("dp=2 pp=2 tp=2", "global=8 micro=1", tp=True, sequence_parallel=True,
               extra="pipeline schedule=1f1b stages=auto\nzero stage=1\n"),
}


def text(spec: Spec, tp_block: str | None) -> str:
    return (f"mesh {spec.mesh}\nbatch {spec.batch}\n{OPTIMIZER}\n{spec.extra}" + (tp_block or ""))
