"""Progress bar and metrics log, on rank 0 only.

A rich progress bar (step, loss, tokens/s) on stderr when it is a terminal; plain
log lines on stdout every `log_every` steps otherwise (with parc.run's other
lines, so one redirect keeps them in order), so CI logs stay readable. Every
logged step is also written to a JSON-lines file. A record holds the step, loss, speed, the
step's learning rate and the global gradient norm; an eval record (--eval-every) the step and
`val_loss`. With --tensorboard DIR the same scalars also go to TensorBoard event files
(torch.utils.tensorboard, which needs the `tensorboard` package: `tensorboard_writer`).

Start here: `Metrics(total_steps, path, enabled, first_step, tensorboard)`, built once by parc.run.
A fresh run (`first_step` 0) starts a new file. A resumed run starts at the checkpoint's step,
which may be earlier than the last step the crashed run logged: the steps in between are run
again, so each step appears once only if their old records go. `keep_before` rewrites the file
with the records of steps before `first_step` (and without a line half-written at the crash),
then the run appends; TensorBoard is told the same with SummaryWriter's `purge_step`, which
hides the earlier runs' events at or after that step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from parc.errors import LaunchError


def tensorboard_writer(path: Path, purge_step: int | None = None):
    """A SummaryWriter for `--tensorboard path`; without the `tensorboard` package, one line. `purge_step`:
    a resumed run's first step; TensorBoard drops what earlier runs logged in DIR at or after it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise LaunchError(f"--tensorboard {path}: the `tensorboard` package is not installed; pip install "
                          f"tensorboard, or drop --tensorboard (the metrics JSON-lines file has the same scalars)") from None
    return SummaryWriter(log_dir=str(path), purge_step=purge_step)


def keep_before(path: Path, first_step: int) -> None:
    """Rewrite the JSON-lines file `path` with only its records of steps before `first_step`.

    Atomic (a temporary file beside it, then os.replace): a crash here leaves the old file or the new
    one, never half of it. A line that is not a JSON record with a step (the last one, half-written when
    the earlier run was killed) is dropped too: appending after it would join two records on one line.
    """
    if not path.exists():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < first_step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Metrics:
    def __init__(self, total_steps: int, path: Path | None, enabled: bool, first_step: int = 0,
                 tensorboard: Path | None = None):
        """`first_step`: the step this run starts at (a resumed run: the steps its checkpoint holds); the
        records of that step and later ones, from a run that got further before it crashed, are dropped."""
        self.enabled = enabled
        self.tb = None
        if enabled and tensorboard is not None:
            self.tb = tensorboard_writer(tensorboard, purge_step=first_step if first_step > 0 else None)
        tty = sys.stderr.isatty()
        self.console = Console(stderr=True) if tty else Console(soft_wrap=True)
        self.file = None
        self.bar = None
        if not enabled:
            return
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if first_step > 0:
                keep_before(path, first_step)
            self.file = path.open("a" if first_step > 0 else "w")
        if tty:
            self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} tok/s"),
                                TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("train", total=total_steps, loss="-", tok_s="-")
            self.bar.start()

    def log(self, step: int, loss: float, tokens_per_s: float, step_time_s: float, advance: int,
            lr: float | None = None, grad_norm: float | None = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s}
        extra = {k: v for k, v in (("lr", lr), ("grad_norm", grad_norm)) if v is not None}
        record.update(extra)
        self._write(step, record)
        if self.bar:
            self.bar.update(self.task, advance=advance, loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        else:
            more = (f"  lr {lr:.3g}" if lr is not None else "") + (f"  grad norm {grad_norm:.3g}"
                                                                      if grad_norm is not None else "")
            self.console.print(f"step {step:>6}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                               f"{step_time_s * 1e3:.1f} ms/step{more}", highlight=False)

    def log_eval(self, step: int, val_loss: float, batches: int) -> None:
        """The held-out loss after `step` (--eval-every)."""
        if not self.enabled:
            return
        self._write(step, {"step": step, "val_loss": val_loss})
        # counted as checkpoints are named: after step index 49 come 50 steps and step_50
        line = f"eval after {step + 1} steps: val loss {val_loss:.4f} ({batches} held-out batches)"
        if self.bar:
            self.bar.console.print(line, highlight=False)
        else:
            self.console.print(line, highlight=False)

    def _write(self, step: int, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb:
            for k, v in record.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
