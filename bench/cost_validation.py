"""Does the cost model order real plans? examples/gpt.py on 4 CPU ranks (issue 14, 4a).

    flock /work/cpu.lock sh -c 'parc calibrate --device cpu --ranks 4 -o bench/results/cpu_preset.json &&
        python bench/cost_validation.py measure -o bench/results/cpu_measured.json --rounds 3'
    python bench/cost_validation.py compare bench/results/cpu_measured.json --preset bench/results/cpu_preset.json

Calibrate and measure back to back, on a quiet machine: both see the same conditions.
`measure` compiles each plan below, runs it with `torchrun --nproc-per-node 4 -m
parc.run` for STEPS steps logging every LOG, and keeps the median of the metrics
rows after the warm-up steps (each row the mean step time of its LOG steps);
it goes round the plans `--rounds` times (interleaved, so a busy spell on this
shared machine hits every plan alike) and records every round, so the spread
between rounds is the noise figure. `compare` predicts each plan with
`parc.analysis.cost.estimate` under the calibrated preset (4 ranks on this
machine's cores) and prints measured against predicted, the error of each, the
prediction's parts (compute with the pipeline bubble, exposed communication, optimizer, in ms) and the
Spearman rank correlation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
TP = ('tensor_parallel {\n "blocks.*.attn.qkv" : column\n "blocks.*.attn.proj" : row\n'
      ' "blocks.*.mlp.fc" : column\n "blocks.*.mlp.proj" : row\n}\n')
OPT = "optimizer adamw lr=3e-4\n"
# every plan trains the same 32 samples per step on 4 ranks
PLANS = {
    "dp4-micro2": "mesh dp=4\nbatch global=32 micro=2\n" + OPT,
    "dp4-micro8": "mesh dp=4\nbatch global=32 micro=8\n" + OPT,
    "dp4-zero3": "mesh dp=4\nbatch global=32 micro=4\nzero stage=3\n" + OPT,
    "dp2-tp2": "mesh dp=2 tp=2\nbatch global=32 micro=4\n" + TP + OPT,
    "tp4-micro16": "mesh tp=4\nbatch global=32 micro=16\n" + TP + OPT,
    "pp2-dp2-1f1b": "mesh pp=2 dp=2\nbatch global=32 micro=2\npipeline schedule=1f1b stages=2\n" + OPT,
    "pp4-gpipe": "mesh pp=4\nbatch global=32 micro=4\npipeline schedule=gpipe stages=4\n" + OPT,
    "pp4-1f1b-micro1": "mesh pp=4\nbatch global=32 micro=1\npipeline schedule=1f1b stages=4\n" + OPT,
}
# parc.run logs every LOG steps: a log point reads the global loss and gradient norm (scalar all-reduces over
# dp and pp, a few ms each on gloo here), which are not part of a training step; a metrics row is the mean
# step time of its LOG steps, so the log point's cost is 1/LOG of it. Rows after the first WARMUP steps count.
STEPS, WARMUP, LOG = 24, 8, 8


def _compile(name: str, text: str, work: Path) -> Path:
    out = work / name
    plan = work / f"{name}.par"
    plan.write_text(text)
    subprocess.run([sys.executable, "-c", "import sys; from parc.cli import main; sys.exit(main())", "compile", str(GPT), "--plan", str(plan), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def _run(compiled: Path, work: Path) -> list[float]:
    metrics = work / f"{compiled.name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    metrics.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "-m", "parc.run",
                    str(compiled), "--steps", str(STEPS), "--log-every", str(LOG), "--metrics", str(metrics)],
                   check=True, capture_output=True, text=True, env=env)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step_time_s"] for r in rows if r["step"] >= WARMUP]


def measure(out: Path, rounds: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="parc-costval-"))
    compiled = {}
    for name, text in PLANS.items():
        try:
            compiled[name] = _compile(name, text, work)
        except subprocess.CalledProcessError as e:
            print(f"{name}: does not compile: {e.stderr[-2000:]}", flush=True)
    result = {"plans": PLANS, "steps": STEPS, "warmup": WARMUP, "log_every": LOG, "rounds": [], "load": []}
    for r in range(rounds):
        row = {}
        for name, path in compiled.items():
            try:
                times = _run(path, work)
            except subprocess.CalledProcessError as e:
                print(f"round {r} {name}: failed: {e.stderr[-2000:]}", flush=True)
                continue
            row[name] = statistics.median(times)
            print(f"round {r} {name:<16} {row[name] * 1e3:8.2f} ms/step (median of {len(times)} windows of {LOG})",
                  flush=True)
        result["rounds"].append(row)
        result["load"].append(os.getloadavg()[0])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for k, i in enumerate(order):
            r[i] = k
        return r
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def predict(text: str, preset: str):
    """The estimate (`parc.analysis.cost.Estimate`) of plan `text` under `preset`."""
    from parc.analysis import cost
    from parc.analysis.report import _trace_stats
    from parc.grammar.parser import parse

    plan = parse(text, file="bench.par")
    stats = _trace_stats(GPT, plan)
    return cost.estimate(plan, stats, cost.hardware(preset, plan.topology))


def compare(measured: Path, preset: str) -> int:
    data = json.loads(measured.read_text())
    names = list(data["plans"])
    med = {n: statistics.median(r[n] for r in data["rounds"]) for n in names}
    spread = {n: (max(r[n] for r in data["rounds"]) - min(r[n] for r in data["rounds"])) / med[n] for n in names}
    est = {n: predict(data["plans"][n], preset) for n in names}
    pred = {n: e.step_seconds for n, e in est.items()}
    print("| plan | measured ms (median of rounds) | round spread | predicted ms | error | predicted: compute and bubble / "
          "communication / optimizer ms |\n|---|---|---|---|---|---|")
    worst = 0.0
    for n in names:
        err = pred[n] / med[n] - 1
        worst = max(worst, abs(err))
        e = est[n]
        comm = e.exposed_comm_seconds
        print(f"| {n} | {med[n] * 1e3:.0f} | {spread[n]:.0%} | {pred[n] * 1e3:.0f} | {err:+.0%} | "
              f"{(e.step_seconds - comm - e.optimizer_seconds) * 1e3:.0f} / {comm * 1e3:.0f} / "
              f"{e.optimizer_seconds * 1e3:.0f} |")
    rho = spearman([med[n] for n in names], [pred[n] for n in names])
    within = sum(abs(pred[n] / med[n] - 1) <= 0.25 for n in names)
    print(f"\nSpearman {rho:.3f} over {len(names)} plans; {within} of {len(names)} within 25%, worst error {worst:.0%}; "
          f"{len(data['rounds'])} rounds, load average {', '.join(f'{x:.1f}' for x in data['load'])}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("-o", type=Path, default=ROOT / "bench" / "results" / "cpu_measured.json")
    m.add_argument("--rounds", type=int, default=3)
    c = sub.add_parser("compare")
    c.add_argument("measured", type=Path)
    c.add_argument("--preset", required=True)
    a = p.parse_args()
    if a.cmd == "measure":
        measure(a.o, a.rounds)
        return 0
    return compare(a.measured, a.preset)


if __name__ == "__main__":
    sys.exit(main())
