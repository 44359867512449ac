"""Progress bar and metrics log, on rank 0 only.

A rich progress bar (step, loss, tokens/s) on stderr when it is a terminal; plain
log lines on stdout every `log_every` steps otherwise (with parc.run's other
lines, so one redirect keeps them in order), so CI logs stay readable. Every
logged step is also written to a JSON-lines file: a fresh one for a fresh run,
appended to on --resume so the earlier steps stay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class Metrics:
    def __init__(self, total_steps: int, path: Path | None, enabled: bool, append: bool = False):
        self.enabled = enabled
        tty = sys.stderr.isatty()
        self.console = Console(stderr=True) if tty else Console(soft_wrap=True)
        self.file = None
        self.bar = None
        if not enabled:
            return
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a" if append else "w")
        if tty:
            self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tok_s]} tok/s"),
                                TimeRemainingColumn(), console=self.console)
            self.task = self.bar.add_task("train", total=total_steps, loss="-", tok_s="-")
            self.bar.start()

    def log(self, step: int, loss: float, tokens_per_s: float, step_time_s: float, advance: int) -> None:
        if not self.enabled:
            return
        record = {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s}
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.bar:
            self.bar.update(self.task, advance=advance, loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        else:
            self.console.print(f"step {step:>6}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
                               f"{step_time_s * 1e3:.1f} ms/step", highlight=False)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
        if self.file:
            self.file.close()
