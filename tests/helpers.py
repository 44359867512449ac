"""Shared pieces of the distributed tests: compile a model under a plan, train it on
spawned gloo ranks, and train the serial reference on the same batches."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from parc import artifact
from parc.compiler import compile_model
from parc.runtime import checkpoint
from parc.grammar.parser import parse
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from parc.runtime.verify import compare, train_serial
from parc.trace import load_user_module

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
SIZED_GPT = ROOT / "bench" / "gpt_sized.py"   # sized by PARC_BENCH_GPT


def sized_report(plan: Path, *flags: str, model: Path = SIZED_GPT) -> dict:
    """`parc report --model MODEL --plan PLAN [flags]` through the CLI's own parser: analytic, traced on meta."""
    from parc import cli
    from parc.analysis import report

    return report.build_from_args(cli.parser().parse_args(["report", "--model", str(model), "--plan", str(plan),
                                                           *flags]))


def gpt_tp_rules(sequence_parallel: bool = False) -> str:
    """Megatron's layout for examples/gpt.py: qkv and fc column, the projections row, embedding and head vocab."""
    return """tensor_parallel {
    "blocks.*.attn.qkv"  : column
    "blocks.*.attn.proj" : row
    "blocks.*.mlp.fc"    : column
    "blocks.*.mlp.proj"  : row
    "wte"                : vocab
    "lm_head"            : vocab
""" + ("    sequence_parallel\n" if sequence_parallel else "") + "}\n"


def llama_tp_rules(sequence_parallel: bool = False) -> str:
    """Megatron's layout for HF Llama: q/k/v and gate/up column, o and down row, embedding and head vocab."""
    return """tensor_parallel {
    "model.layers.*.self_attn.q_proj" : column
    "model.layers.*.self_attn.k_proj" : column
    "model.layers.*.self_attn.v_proj" : column
    "model.layers.*.self_attn.o_proj" : row
    "model.layers.*.mlp.gate_proj"    : column
    "model.layers.*.mlp.up_proj"      : column
    "model.layers.*.mlp.down_proj"    : row
    "model.embed_tokens"              : vocab
    "lm_head"                         : vocab
""" + ("    sequence_parallel\n" if sequence_parallel else "") + "}\n"


def compile_text(plan_text: str, out: Path, model: Path = GPT):
    """Compile `plan_text` for `model` into `out`. With PARC_TEST_COMPILE=<mode> set, the plan gets
    `compile <mode>` unless it says `compile` itself (docs/compile.md: the equivalence tests rerun
    compiled). No plan is refused for its `compile` (the last refusal, inductor with recompute and
    tp > 1, was lifted by runtime/recompute_policy.py), so every plan then runs compiled."""
    mode = os.environ.get("PARC_TEST_COMPILE")
    if mode and "\ncompile " not in "\n" + plan_text:
        plan_text = plan_text.rstrip("\n") + f"\ncompile {mode}\n"
    return _compile(plan_text, out, model)


def _compile(plan_text: str, out: Path, model: Path):
    compile_model(model, parse(plan_text, file=str(out.parent / "test.par")), out)
    return artifact.load(out)


def _train_body(ctx, compiled: str, steps: int, seed: int):
    trainer = Trainer.load(compiled, seed)
    local = [trainer.step(s).loss for s in range(steps)]
    losses = trainer.global_losses(local)
    state = trainer.gathered_state()
    return {"losses": losses, "state": state if ctx.rank == 0 else None}


def train_parallel(compiled: Path, steps: int = 3, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    art = artifact.load(compiled)
    results = spawn(art.world_size, _train_body, str(compiled), steps, seed)
    return results[0]["losses"], results[0]["state"]


def parallel_vs_serial(compiled: Path, steps: int = 3, seed: int = 0):
    """Train both ways from the same seed on the same global batches; return the Verdict."""
    losses, state = train_parallel(compiled, steps, seed)
    art = artifact.load(compiled)
    user = load_user_module(art.root / "model" / "model.py")
    serial_losses, serial_state = train_serial(user, art.plan, seed, steps)
    return compare(losses, serial_losses, state, serial_state)


def checkpoint_differences(a: Path, b: Path) -> list[str]:
    """Keys whose tensors differ (or exist in only one) between two checkpoints, plus parc.json. Its files'
    checksums are left out: DCP's .metadata records the directory it was written into."""
    ta, tb = checkpoint.read(a), checkpoint.read(b)
    bad = sorted(set(ta) ^ set(tb)) + [k for k in sorted(set(ta) & set(tb)) if not torch.equal(ta[k], tb[k])]
    info = [{k: v for k, v in json.loads((c / "parc.json").read_text()).items() if k != "files"} for c in (a, b)]
    if info[0] != info[1]:
        bad.append("parc.json")
    return bad


def checkpoint_sessions(ctx, sessions: list[tuple[str, str | None]], compiled: dict[str, str], root: str):
    """A chain of checkpoint sessions, (plan, plan whose first session's checkpoint it resumes from or None):
    each trains (or resumes) to step 2, saves, notes the state it saved, and takes one more step under its plan.
    Rank 0 returns [{first, saved, loss, after}] per session (test_checkpoint._check_reshard compares them)."""
    first_of = {}
    for i, (name, _) in enumerate(sessions):
        first_of.setdefault(name, i)
    out = []
    for i, (name, source) in enumerate(sessions):
        trainer = Trainer.load(compiled[name], 0)
        first = checkpoint.load(trainer, f"{root}/{first_of[source]}") if source else 0
        for s in range(first, 2):
            trainer.step(s)
        checkpoint.save(trainer, f"{root}/{i}", 2)
        saved = {k: v.clone() for k, v in trainer.gathered_state().items()}  # on CPU it may alias the live params
        loss = trainer.global_losses([trainer.step(2).loss])[0]
        out.append({"first": first, "saved": saved, "loss": loss, "after": trainer.gathered_state()})
    return out if ctx.rank == 0 else None


def checkpoint_leg(ctx, compiled: dict[str, str], root: str, resume: bool, first: int, last: int,
                   every: int = 2) -> None:
    """One leg of a kill-and-resume run: each plan trains steps [first, last), resuming from `root/<plan>` when
    `resume`, and saves there every `every` steps."""
    for name, path in compiled.items():
        trainer = Trainer.load(path, 0)
        out = f"{root}/{name}"
        if resume:
            assert checkpoint.load(trainer, out) == first
        for step in range(first, last):
            trainer.step(step)
            if (step + 1) % every == 0:
                checkpoint.save(trainer, out, step + 1)
