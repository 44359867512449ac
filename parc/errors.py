"""Diagnostics: the one error hierarchy every user-facing mistake goes through.

Start here: `ParcError` is the base; `Diagnostic` is one message with a source
span. The CLI catches `ParcError`, prints every diagnostic it carries (at most
`MAX_SHOWN`, then how many more), and exits 2 without a traceback. Messages show
the arithmetic (`1024 ≠ 4 × 8 × 8 = 256`).

Lines and columns: a line ends at "\\n" only, as lark counts them (`source_lines`
is the one splitter the parser and the renderer share); a column counts code
points from 1, so a tab, a wide CJK character or a combining accent is one column.
The echoed line is made safe to print: control and format characters (\\f, \\x85,
\\u2028, a bidi override) show as a space (whitespace) or U+FFFD, one for one, and a
line longer than `MAX_ECHO` is cut to a window around the caret. The caret line
copies tabs and pads wide characters with two spaces, so the caret sits under
the spanned character on a terminal that expands tabs to any fixed tab stop.

This module sits in parc/, not grammar/: the plan language raises these errors,
and so do tracing, the passes and the runtime, which must not depend on the front end.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from dataclasses import dataclass

MAX_SHOWN = 50       # diagnostics printed per error; the rest are counted
MAX_ECHO = 160       # code points of a source line echoed under a message
MAX_MESSAGE = 1000   # characters of a message or hint (they may quote user text)
_MAX_REREAD = 1 << 20  # bytes of a file re-read to echo a line when no source was given


@dataclass(frozen=True)
class Span:
    """A location in a source file; lines and columns count from 1 (columns in code points)."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


def source_lines(text: str) -> list[str]:
    """The lines of `text` as spans number them: split at "\\n" only (lark's count), a CRLF's "\\r" dropped.
    Not str.splitlines(), which also splits at \\f, \\x1c-\\x1e, \\x85, \\u2028 and \\u2029."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def shown(ch: str) -> str:
    """How one code point of a source line is echoed: itself, or one safe stand-in."""
    if ch == "\t":
        return ch
    if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
        return " " if ch.isspace() else "\ufffd"
    return ch


def cells(ch: str) -> int:
    """Terminal cells of an echoed (already `shown`) code point other than a tab: 0, 1 or 2."""
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def _pad(prefix: str) -> str:
    """Blanks that fill the same cells as `prefix` (echoed text): tabs kept, wide characters two spaces."""
    return "".join(c if c == "\t" else " " * cells(c) for c in prefix)


def _clip(text: str) -> str:
    """A message or hint as printed: at most MAX_MESSAGE characters, control characters (an ESC from a
    quoted value, say) shown safely; its own line breaks kept."""
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + f"… ({len(text) - MAX_MESSAGE} more characters)"
    return "\n".join("".join(_escaped(c) for c in part) for part in text.split("\n"))


def _escaped(ch: str) -> str:
    """A code point of a message as printed: an invisible one spelled out as its escape (`\\x00`, `\\u200b`),
    so a NUL inside a quoted glob reads as what it is rather than as a space or a stand-in."""
    if ch != "\t" and unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
        return ch.encode("unicode_escape").decode("ascii")
    return ch


def _reread(file: str) -> str | None:
    """The text of a regular file, to echo a line of it; None for anything else (never opens a FIFO)."""
    try:
        st = os.stat(file)
        if not stat.S_ISREG(st.st_mode):
            return None
        with open(file, "rb") as f:
            data = f.read(_MAX_REREAD)
    except (OSError, ValueError):
        return None
    text = data.decode("utf-8", errors="replace")
    return text[1:] if text.startswith("\ufeff") else text


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
        lines = [f"{where}{self.severity}: {_clip(self.message)}"]
        text = self.source
        if text is None and self.span is not None:
            text = _reread(self.span.file)
        if text is not None and self.span is not None:
            lines += self._echo(text)
        if self.hint:
            lines.append(f"  hint: {_clip(self.hint)}")
        return "\n".join(lines)

    def _echo(self, text: str) -> list[str]:
        """The spanned line and a caret under column `col` (past the end: just after the last character)."""
        src = source_lines(text)
        if not 1 <= self.span.line <= len(src):
            return []
        line = src[self.span.line - 1]
        col = min(max(self.span.col, 1), len(line) + 1)
        width = 1
        if self.span.end_line == self.span.line and self.span.end_col:
            width = max(1, min(self.span.end_col, len(line) + 1) - col)
        start = 0
        if len(line) > MAX_ECHO:  # a window around the caret, marked with … at each cut end
            start = max(0, min(col - 1 - MAX_ECHO // 2, len(line) - MAX_ECHO))
        end = start + MAX_ECHO
        head = "…" if start > 0 else ""
        tail = "…" if end < len(line) else ""
        echoed = "".join(shown(c) for c in line[start:end])
        width = min(width, end - (col - 1)) if col - 1 < end else 1
        under = sum(1 if c == "\t" else cells(c) for c in echoed[col - 1 - start:col - 1 - start + width])
        caret = _pad(head + echoed[:col - 1 - start]) + "^" + "~" * (max(under, 1) - 1)
        return [f"    {head}{echoed}{tail}", f"    {caret}"]


def render_all(diagnostics: list[Diagnostic], limit: int = MAX_SHOWN) -> str:
    """Every diagnostic rendered, up to `limit`; then one line saying how many errors and warnings were left out."""
    out = [d.render() for d in diagnostics[:limit]]
    rest = diagnostics[limit:]
    if rest:
        errors = sum(d.severity == "error" for d in rest)
        words = [f"{n} more {w}{'s' * (n != 1)}" for n, w in ((errors, "error"), (len(rest) - errors, "warning")) if n]
        out.append(f"… and {' and '.join(words)} not shown")
    return "\n".join(out)


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
        super().__init__(diags[0].message)

    @property
    def span(self) -> Span | None:
        return self.diagnostics[0].span

    @property
    def message(self) -> str:
        return self.diagnostics[0].message

    def render(self) -> str:
        return render_all(self.diagnostics)

    def __str__(self) -> str:
        return self.render()
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
