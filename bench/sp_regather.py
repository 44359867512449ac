"""Sequence parallelism's re-gather against keeping the gathered copies, 2 gloo ranks, same run.

examples/tp.par (tp 2, sequence parallelism) at micro-batch 8, fp32 and bf16. parc's runtime keeps each column
layer's input slice and all-gathers it again in the backward (runtime/parallel/sequence_regather.py, Megatron-LM's
way); its peer is the same program keeping the gathered copies for the backward, as parc's runtime did before
(`trainer.regather = None`). Both train the same bits (tests/test_sp_regather.py); the figures are the step time
and the forward's kept activations (runtime/memory.py's probe), as ratios re-gather / keep.
Run: python bench/sp_regather.py [--rounds 5] [--steps 4]
No target: the re-gather buys memory with one all-gather more per gathered input and micro-batch.
"""

from __future__ import annotations

import statistics

from common import ROOT, compile_plan, interleave, pair_args

PLAN = (ROOT / "examples" / "tp.par").read_text().replace("batch global=8 micro=4 accumulation=2",
                                                          "batch global=16 micro=8 accumulation=2")


def _body(ctx, roots: dict[str, str], rounds: int, steps: int):
    from parc.runtime.memory import ActivationProbe
    from parc.runtime.train import Trainer

    out = {}
    for precision, root in roots.items():
        trainers = {"regather": Trainer.load(root, 0), "keep": Trainer.load(root, 0)}
        trainers["keep"].regather = None
        counter = dict.fromkeys(trainers, 0)

        def stepper(name):
            def step():
                trainers[name].step(counter[name])
                counter[name] += 1
            return step

        times = interleave({name: stepper(name) for name in trainers}, rounds, steps)
        kept = {}
        for name, trainer in trainers.items():
            trainer.probe = ActivationProbe(trainer.state)
            stepper(name)()
            kept[name] = trainer.probe.peak
        out[precision] = times, kept
    return out


def main() -> None:
    args = pair_args(__doc__)
    from parc.runtime.launch import spawn

    roots = {"fp32": str(compile_plan(PLAN)), "bf16": str(compile_plan(PLAN + "precision bf16\n"))}
    for precision, (times, kept) in spawn(2, _body, roots, args.rounds, args.steps)[0].items():
        med = {name: statistics.median(t) for name, t in times.items()}
        print(f"SP re-gather, examples/tp.par {precision}, 2 gloo ranks, micro 8")
        for name in times:
            print(f"  {name:<9} median {med[name] * 1e3:8.2f} ms/step over {len(times[name])} steps, "
                  f"kept activations {kept[name]} B")
        print(f"  ratio regather/keep: step {med['regather'] / med['keep']:.3f}, "
              f"kept activations {kept['regather'] / kept['keep']:.3f}")


if __name__ == "__main__":
    main()
