"""ZeRO-1/2/3 bf16 state memory per rank, measured, beside runtime/parallel/zero.py's formulas.

examples/gpt.py under `precision bf16`, AdamW, on N = 2 and 4 gloo ranks: after one step each rank
counts the storages it holds by kind (`runtime/memory.py held_state`: weights with the fp32 master
ranges, gradient buffers, Adam's moments; Adam's 0-dim step counters left out) and divides by the
model's Ψ parameters. The formulas (bytes per parameter, zero.py's docstring; the issue's targets):

  ZeRO-1  2 + 4/N (bf16 weights, fp32 master range) + 4 (fp32 gradient) + 8/N = 6 + 12/N
  ZeRO-2  2 + 4/N + 4/N + 8/N = 2 + 16/N
  ZeRO-3  16/N (the gathered bf16 working set is transient, not state)
and with `precision bf16 reduce=bf16 accumulate=bf16` (bf16 gradient accumulators; the ZeRO paper's
and DeepSpeed's bf16 layout, the rows marked "1 bf16g" and "2 bf16g"):
  ZeRO-1  2 + 4/N + 2 (bf16 gradient) + 8/N = 2 + 2 + 12/N
  ZeRO-2  2 + 4/N + 2/N + 8/N = 2 + 14/N

They hold exactly on the padded Ψ' (each bucket rounded up to N equal, aligned ranges); per
parameter of the model the padding adds a little, printed as measured/Ψ beside the formula.
Run: python bench/zero1_memory.py
"""

from __future__ import annotations

from common import compile_plan

PLAN = "mesh dp={n}\nbatch global={g} micro=2\nzero stage={stage}\nprecision bf16{acc}\noptimizer adamw lr=1e-3\n"
BF16G = " reduce=bf16 accumulate=bf16"
# row label: (stage, precision keys, bytes per parameter at N)
ROWS = {"1": (1, "", lambda n: 6 + 12 / n), "2": (2, "", lambda n: 2 + 16 / n), "3": (3, "", lambda n: 16 / n),
        "1 bf16g": (1, BF16G, lambda n: 2 + 2 + 12 / n), "2 bf16g": (2, BF16G, lambda n: 2 + 14 / n)}


def _body(ctx, roots: dict[int, str]):
    from parc.runtime.memory import held_state
    from parc.runtime.train import Trainer

    out = {}
    for label, root in roots.items():
        trainer = Trainer.load(root, 0)
        trainer.step(0)  # every gradient and optimizer buffer now exists
        held = held_state(trainer)
        out[label] = {k: held[k] for k in ("params", "grads", "optimizer")}
    return out


def main() -> None:
    from parc import artifact
    from parc.runtime.launch import spawn

    print("ZeRO bf16 state per rank, examples/gpt.py, AdamW: bytes per parameter, measured vs formula")
    print(f"{'N':>2} {'stage':>7} {'params':>8} {'grads':>8} {'optim':>8} {'measured/Ψ′':>12} {'formula':>8} "
          f"{'measured/Ψ':>11} {'Ψ′/Ψ':>7}")
    for n in (2, 4):
        # two micro-batches per rank: the accumulators accumulate
        roots = {label: str(compile_plan(PLAN.format(n=n, g=4 * n, stage=stage, acc=acc)))
                 for label, (stage, acc, _) in ROWS.items()}
        ranks = spawn(n, _body, roots)
        for label, root in roots.items():
            table = artifact.load(root).plan["programs"]["stage0_tp0"]["zero"]
            psi, padded = table["numel"], sum(b["padded"] for b in table["buckets"])
            worst = max(ranks, key=lambda r: sum(r[label].values()))[label]
            total = sum(worst.values())
            print(f"{n:>2} {label:>7} " + " ".join(f"{worst[k] / padded:>8.3f}" for k in ("params", "grads", "optimizer"))
                  + f" {total / padded:>12.3f} {ROWS[label][2](n):>8.3f} {total / psi:>11.3f} {padded / psi:>7.4f}")


if __name__ == "__main__":
    main()
