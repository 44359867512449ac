"""Diagnostics: the one error hierarchy every user-facing mistake goes through.

Start here: `ParcError` is the base; `Diagnostic` is one message with a source
span. The CLI catches `ParcError`, prints every diagnostic it carries, and exits 2
without a traceback. Messages show the arithmetic (`1024 ≠ 4 × 8 × 8 = 256`).

This module sits in parc/, not grammar/: the plan language raises these errors,
and so do tracing, the passes and the runtime, which must not depend on the front end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Span:
    """A location in a source file; lines and columns count from 1."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    """One message: severity is "error" or "warning"; span may be None (no file)."""

    message: str
    span: Span | None = None
    hint: str | None = None
    severity: str = "error"
    source: str | None = None  # the file's text, to print the offending line

    def render(self) -> str:
        where = f"{self.span}: " if self.span else ""
        lines = [f"{where}{self.severity}: {self.message}"]
        text = self.source
        if text is None and self.span is not None:
            try:
                text = Path(self.span.file).read_text()
            except OSError:
                text = None
        if text is not None and self.span is not None:
            src = text.splitlines()
            if 1 <= self.span.line <= len(src):
                line = src[self.span.line - 1]
                width = 1
                if self.span.end_line == self.span.line and self.span.end_col:
                    width = max(1, self.span.end_col - self.span.col)
                lines.append(f"    {line}")
                lines.append("    " + " " * (self.span.col - 1) + "^" + "~" * (width - 1))
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


class ParcError(Exception):
    """Base of every error a user can cause. Carries one or more diagnostics."""

    def __init__(self, message: str | None = None, span: Span | None = None, hint: str | None = None,
                 *, diagnostics: list[Diagnostic] | None = None, source: str | None = None):
        diags = list(diagnostics or [])
        if message is not None:
            diags.insert(0, Diagnostic(message, span, hint, "error", source))
        if not diags:
            raise ValueError("ParcError needs a message or diagnostics")
        self.diagnostics = diags
        super().__init__(self.render())

    @property
    def span(self) -> Span | None:
        return self.diagnostics[0].span

    @property
    def message(self) -> str:
        return self.diagnostics[0].message

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class PlanSyntaxError(ParcError):
    """The .par file does not parse."""


class PlanError(ParcError):
    """The plan parses but is inconsistent (with itself, the model or the world)."""


class TraceError(ParcError):
    """The user's model could not be traced."""


class ArtifactError(ParcError):
    """A compiled/ directory is damaged, foreign or meant for another launch."""


class LaunchError(ParcError):
    """The launch environment does not match the compiled plan."""
