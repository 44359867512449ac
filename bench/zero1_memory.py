"""ZeRO-1/2/3 bf16 state memory per rank, measured, beside runtime/parallel/zero.py's formulas.

examples/gpt.py under `precision bf16`, AdamW, on N = 2 and 4 gloo ranks: after one step each rank
counts the storages it holds by kind (`runtime/memory.py held_state`: weights with the fp32 master
ranges, gradient buffers, Adam's moments; Adam's 0-dim step counters left out) and divides by the
model's Ψ parameters. The formulas (bytes per parameter, zero.py's docstring; the issue's targets):

  ZeRO-1  2 + 4/N (bf16 weights, fp32 master range) + 4 (fp32 gradient) + 8/N = 6 + 12/N
  ZeRO-2  2 + 4/N + 4/N + 8/N = 2 + 16/N
  ZeRO-3  16/N (the gathered bf16 working set is transient, not state)

They hold exactly on the padded Ψ' (each bucket rounded up to N equal, aligned ranges); per
parameter of the model the padding adds a little, printed as measured/Ψ beside the formula.
Run: python bench/zero1_memory.py
"""

from __future__ import annotations

from common import compile_plan

PLAN = "mesh dp={n}\nbatch global={g} micro=2\nzero stage={stage}\nprecision bf16\noptimizer adamw lr=1e-3\n"
FORMULA = {1: lambda n: 6 + 12 / n, 2: lambda n: 2 + 16 / n, 3: lambda n: 16 / n}


def _body(ctx, roots: dict[int, str]):
    from parc.runtime.memory import held_state
    from parc.runtime.train import Trainer

    out = {}
    for stage, root in roots.items():
        trainer = Trainer.load(root, 0)
        trainer.step(0)  # every gradient and optimizer buffer now exists
        held = held_state(trainer)
        out[stage] = {k: held[k] for k in ("params", "grads", "optimizer")}
    return out


def main() -> None:
    from parc import artifact
    from parc.runtime.launch import spawn

    print("ZeRO bf16 state per rank, examples/gpt.py, AdamW: bytes per parameter, measured vs formula")
    print(f"{'N':>2} {'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'measured/Ψ′':>12} {'formula':>8} "
          f"{'measured/Ψ':>11} {'Ψ′/Ψ':>7}")
    for n in (2, 4):
        roots = {stage: str(compile_plan(PLAN.format(n=n, g=2 * n, stage=stage))) for stage in (1, 2, 3)}
        ranks = spawn(n, _body, roots)
        for stage, root in roots.items():
            table = artifact.load(root).plan["programs"]["stage0_tp0"]["zero"]
            psi, padded = table["numel"], sum(b["padded"] for b in table["buckets"])
            worst = max(ranks, key=lambda r: sum(r[stage].values()))[stage]
            total = sum(worst.values())
            print(f"{n:>2} {stage:>5} " + " ".join(f"{worst[k] / padded:>8.3f}" for k in ("params", "grads", "optimizer"))
                  + f" {total / padded:>12.3f} {FORMULA[stage](n):>8.3f} {total / psi:>11.3f} {padded / psi:>7.4f}")


if __name__ == "__main__":
    main()
