"""Checkpoints of expert-parallel plans: resume is exact, the layout is the serial model's, and it reshards.

tests/test_moe.py's tiny MoE GPT (4 experts in blocks 1 and 3; block 1 top-1 dropping tokens, block 3
top-2 keeping them) trains STEPS = 4 steps under each plan, saving after steps 2 and 4 (the uninterrupted
run); a second world of fresh processes resumes each plan from that run's step_2 (all a SIGKILL after it
leaves on disk: tests/test_checkpoint.py) and trains steps 2 and 3. Exact resume means: the losses of
steps 2 and 3 are equal (==) and the two step_4 checkpoints hold bitwise the same tensors, every
parameter, Adam's exp_avg / exp_avg_sq / step of every expert and dense parameter, each rank's RNG,
and the same parc.json. Plans (every one global batch 8, micro 2: the same micro-batches under each):

- `ep`: mesh dp=2 ep=2, AdamW without ZeRO (each expert written whole by its one holder);
- `ep_zero2`: mesh dp=4 ep=2 zero stage=2 (experts' ranges cut over edp groups of 2, gathered over edp
  before writing; each expert's rows written by its 2 holders);
- `ep_pp`: mesh dp=2 ep=2 pp=2, 1F1B (each stage writes its own MoE layer's experts);
- `ep_tp`: mesh dp=2 ep=2 tp=2 (experts tp-sharded: gathered over tp, rows written by the 2 tp ranks).

The layout is plan-independent: every expert is stored under its serial-model FQN (all 4 of each layer,
not the slots' names), its tensor equal to the trained model's (`gathered_state`), and `parc export`
gives the whole model. Three resumes under another plan read that layout, each from the uninterrupted
run's step_2: `ep` → dp=2 without ep (ep=2 → ep=1), `ep` → dp=2 ep=2 zero stage=2 (no ZeRO → ZeRO over
edp), `ep_zero2` (4 ranks) → `ep` (dp=4 ep=2 ZeRO-2 → dp=2 ep=2, no ZeRO). Loaded parameters are
bitwise those saved; the two steps after agree with the uninterrupted run's losses and final
parameters within runtime/verify.py's DEFAULT_TOLERANCE (1e-4): the plans differ only in the order of
fp32 sums (dp vs edp reductions, reduce-scatter vs all-reduce, the batched expert), the argument
tests/test_moe.py makes for ep against the serial model; a lost Adam moment or a wrong expert moves
parameters by 1e-2 or more.
"""

from __future__ import annotations

import shutil

import torch

from helpers import ROOT, checkpoint_differences, compile_text
from parc.export import export
from parc.runtime import checkpoint
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import DEFAULT_TOLERANCE, compare
from test_moe import MODEL
from test_moe_tp import PLAN as TP_PLAN

STEPS, EVERY = 4, 2
EXPERTS = 'expert_parallel {\n    "blocks.*.moe.experts"\n}\n'
COMMON = "batch global=8 micro=2\noptimizer adamw lr=1e-2\n"
TP_RULES = TP_PLAN[TP_PLAN.index("tensor_parallel"):TP_PLAN.index("expert_parallel")]
# name → (ranks, plan); the first four train and resume, the last two are only resumed into
PLANS = {
    "ep": (2, "mesh dp=2 ep=2\n" + EXPERTS),
    "ep_zero2": (4, "mesh dp=4 ep=2\nzero stage=2\n" + EXPERTS),
    "ep_pp": (4, "mesh dp=2 ep=2 pp=2\npipeline schedule=1f1b\n" + EXPERTS),
    "ep_tp": (4, "mesh dp=2 ep=2 tp=2\n" + TP_RULES + EXPERTS),
    "dense": (2, "mesh dp=2\n"),
    "ep_zero2_dp2": (2, "mesh dp=2 ep=2\nzero stage=2\n" + EXPERTS),
}
TRAINED = ("ep", "ep_zero2", "ep_pp", "ep_tp")
# (checkpoint of the uninterrupted run of, resumed under): ep 2 → 1, no ZeRO → ZeRO, dp 4 ZeRO-2 → dp 2
CROSS = (("ep", "dense"), ("ep", "ep_zero2_dp2"), ("ep_zero2", "ep"))


def _run(ctx, compiled: dict[str, str], root: str, first: int) -> dict:
    """Each plan of this world: train (from scratch, or resumed from `root`/<name>'s step_<first>) to STEPS,
    saving every EVERY steps; return the losses and, at each save, the model by serial FQN (rank 0)."""
    out = {}
    for name, path in compiled.items():
        trainer = Trainer.load(path, 0)
        if first:
            assert checkpoint.load(trainer, f"{root}/{name}") == first
        local, states = [], {}
        for step in range(first, STEPS):
            local.append(trainer.step(step).loss)
            if (step + 1) % EVERY == 0:
                checkpoint.save(trainer, f"{root}/{name}", step + 1)
                states[step + 1] = {k: v.clone() for k, v in trainer.gathered_state().items()}
        # one step's loss per all-reduce: gloo chunks a reduction by its length, so a 4-step and a 2-step
        # reduction of the same values may add them in another order
        losses = [trainer.global_losses([loss])[0] for loss in local]
        out[name] = {"losses": losses, "states": states if ctx.rank == 0 else None}
    return out


def _cross(ctx, compiled: dict[str, str], whole: str) -> dict:
    """Each CROSS pair: load the uninterrupted run's step_2 of one plan under another, train to STEPS."""
    out = {}
    for src, dst in CROSS:
        trainer = Trainer.load(compiled[dst], 0)
        first, line = checkpoint.resume(trainer, f"{whole}/{src}/step_{EVERY}")
        assert first == EVERY
        loaded = {k: v.clone() for k, v in trainer.gathered_state().items()}
        local = [trainer.step(s).loss for s in range(EVERY, STEPS)]
        out[(src, dst)] = {"line": line, "loaded": loaded, "losses": trainer.global_losses(local),
                           "final": trainer.gathered_state()}
        if ctx.rank:
            out[(src, dst)] = None
    return out


def test_ep_checkpoints_resume_exactly_and_reshard(tmp_path):
    model = tmp_path / "moe_tiny.py"
    model.write_text(MODEL.format(k1=1, cf1=0.5, k3=2, cf3=2.0, examples=str(ROOT / "examples")))
    compiled = {n: str(compile_text(text + COMMON, tmp_path / "c" / n, model).root)
                for n, (_, text) in PLANS.items()}
    by_world = {w: {n: compiled[n] for n in TRAINED if PLANS[n][0] == w} for w in (2, 4)}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    got = {}
    for w, plans in by_world.items():
        got.update(spawn(w, _run, plans, str(whole), 0)[0])
    for name in TRAINED:  # the interrupted run: killed after its step_2
        shutil.copytree(whole / name / f"step_{EVERY}", cut / name / f"step_{EVERY}")
        (cut / name / checkpoint.LATEST).write_text(f"step_{EVERY}\n")
    resumed = spawn(4, _run, by_world[4], str(cut), EVERY)[0]
    resumed.update(spawn(2, _run, by_world[2], str(cut), EVERY)[0])

    for name in TRAINED:
        assert resumed[name]["losses"] == got[name]["losses"][EVERY:], (name, resumed[name], got[name]["losses"])
        assert not checkpoint_differences(whole / name / f"step_{STEPS}", cut / name / f"step_{STEPS}"), name
        # the serial model's layout: every expert of both layers under its own FQN, whole, with its moments
        held = checkpoint.read(whole / name / f"step_{EVERY}")
        state = got[name]["states"][EVERY]
        assert "blocks.3.moe.experts.3.proj.weight" in state
        assert {k.removeprefix("model.") for k in held if k.startswith("model.")} == set(state), name
        assert [k for k in state if not torch.equal(held[f"model.{k}"], state[k])] == [], name
        for k in state:
            assert held[f"optim.{k}.exp_avg"].shape == held[f"optim.{k}.exp_avg_sq"].shape == state[k].shape
        assert int(held["optim.step"]) == EVERY
    flat = export(whole / "ep_zero2", tmp_path / "ep_zero2.safetensors")  # `parc export` of an ep checkpoint
    from safetensors.torch import load_file

    final = got["ep_zero2"]["states"][STEPS]
    exported = load_file(str(flat))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)

    crossed = spawn(2, _cross, compiled, str(whole))[0]
    said = {pair: crossed[pair]["line"] for pair in CROSS}  # --resume's line names what changed
    print(*said.values(), sep="\n")
    assert said[("ep", "dense")].endswith(": expert_parallel blocks.*.moe.experts → -; mesh ep 2 → 1"), said
    assert said[("ep", "ep_zero2_dp2")].endswith(": zero 0 → 2"), said
    assert "mesh dp 4 → 2" in said[("ep_zero2", "ep")] and "zero 2 → 0" in said[("ep_zero2", "ep")], said
    for src, dst in CROSS:
        r, ref = crossed[(src, dst)], got[src]
        saved = ref["states"][EVERY]
        assert r["loaded"].keys() == saved.keys(), (src, dst)
        assert [k for k in saved if not torch.equal(r["loaded"][k], saved[k])] == [], (src, dst)
        verdict = compare(r["losses"], ref["losses"][EVERY:], r["final"], ref["states"][STEPS], DEFAULT_TOLERANCE)
        print(f"{src} → {dst}: {verdict.render()}")  # the measured figures, with -s
        assert verdict.ok, f"{src} → {dst}: {verdict.render()}"


def test_parc_run_saves_and_resumes_an_ep_plan(tmp_path):
    """The command line: `parc.run --save-every` of `mesh dp=2 ep=2` (refused at launch before issue 15),
    killed after its step_2 (the copy below), `--resume`d to step 4: bitwise the uninterrupted run's."""
    import os
    import subprocess
    import sys

    from parc.export import load_model_state
    from parc.runtime.launch import free_port

    model = tmp_path / "moe_tiny.py"
    model.write_text(MODEL.format(k1=1, cf1=0.5, k3=2, cf3=2.0, examples=str(ROOT / "examples")))
    compiled = compile_text(PLANS["ep"][1] + COMMON, tmp_path / "c", model).root

    def run(*extra: str) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), "-m", "parc.run", str(compiled), "--steps", str(STEPS),
               "--log-every", str(STEPS), "--save-every", str(EVERY), *extra]
        out = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run("--checkpoint-dir", str(whole))
    shutil.copytree(whole / f"step_{EVERY}", cut / f"step_{EVERY}")
    (cut / checkpoint.LATEST).write_text(f"step_{EVERY}\n")
    said = run("--resume", str(cut), "--checkpoint-dir", str(cut))
    assert f"resumed from step {EVERY} of {cut / f'step_{EVERY}'}" in said, said
    want, got = load_model_state(whole), load_model_state(cut)
    assert checkpoint.resolve(cut).name == f"step_{STEPS}" and want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert not checkpoint_differences(whole / f"step_{STEPS}", cut / f"step_{STEPS}")
