"""The front end: plan text → `Plan`, or a `ParcError` listing every mistake in it.

Start at `parse`. It runs in three steps:

1. lark parses the text with grammar/parc.lark (LALR); a syntax error stops here,
   at the first bad token, as a `PlanSyntaxError`.
2. `_Statements` (a lark Transformer) turns the tree into plain `_Stmt` records;
   nothing from lark (Tree, Token) survives this step.
3. `_Builder` checks each statement's keys and value types, and builds the frozen
   dataclasses of parc.grammar.plan, each with its Span. Its errors (unknown or duplicate
   keys and statements, a value of the wrong type) are collected, not raised one by
   one, and joined with those of `parc.grammar.validate.validate` run on the same plan, so a
   user sees every problem of a file at once.

Assumes: text is the whole file (str, not bytes; a leading BOM is dropped); `file`
names it in diagnostics. Guarantees: a returned `Plan` passed `validate` with no
error; otherwise a `PlanError` (or `PlanSyntaxError`) carries every diagnostic found,
each with a span. Bad input is cheap: a text over `MAX_PLAN_BYTES` or with a line
over `MAX_LINE_CHARS` is refused before lark sees it, so no input costs more than a
linear scan and one LALR parse of a small file.

Ranges and cross-statement arithmetic (tp=0, zero stage=7, the batch identity) are
checked in grammar/validate.py, not here, so plans built in code get the same checks.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lark import Lark, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from parc.errors import Diagnostic, PlanError, PlanSyntaxError, Span, source_lines
from parc.grammar.plan import (
    CP_DEFAULT_ORDER, DEFAULT_ORDER, LOSS_SCALING_KEYS, Batch, ContextParallel, Cut, ExpertParallel, LossScaling, Mesh,
    Optimizer, Pipeline, Plan, Recompute, TensorParallel, Topology, TPRule, Zero,
)
from parc.grammar.validate import validate

STATEMENTS = ("mesh", "topology", "batch", "tensor_parallel", "pipeline", "zero",
              "recompute", "precision", "optimizer", "expert_parallel", "compile",
              "context_parallel")
TP_FLAGS = ("sequence_parallel",)


MAX_PLAN_BYTES = 64 * 1024   # a plan is a page of text: 64 KiB is ~90× the largest example, and parses in ~1 s
MAX_LINE_CHARS = 4096        # code points per line: a statement, or one rule of a block


def parse(text: str, file: str = "<plan>") -> Plan:
    """Parse and check a plan. Raises PlanSyntaxError (or PlanError) with all diagnostics."""
    if text.startswith("\ufeff"):  # a UTF-8 byte-order mark, as some editors write: not part of the plan
        text = text[1:]
    _check_size(text, file)
    # Every statement ends with a newline token; adding one at the end moves no span.
    text_nl = text if text.endswith("\n") else text + "\n"
    try:
        tree = _parser().parse(text_nl)
    except UnexpectedInput as e:
        raise PlanSyntaxError(diagnostics=[_syntax_diagnostic(e, file, text)]) from None
    stmts = _Statements(file).transform(tree)
    builder = _Builder(file, text)
    plan = builder.build(stmts)
    errors = list(builder.errors)
    try:
        validate(plan)
    except PlanError as e:
        errors = errors + [d for d in e.diagnostics if d.severity == "error"]
    errors.sort(key=_position)  # the user reads top to bottom
    if builder.errors:
        raise PlanSyntaxError(diagnostics=errors)
    if errors:
        raise PlanError(diagnostics=errors)
    return plan


def load_plan(path: str | Path) -> Plan:
    """Read and parse a .par file; the file name goes into every span."""
    return parse(read_plan_text(path), str(path))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def path_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a source file ("no such file", "is a directory", ...), or None.
    Uses stat only: a FIFO is never opened, so it cannot hang the caller."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "no such file"
    except NotADirectoryError:
        return "no such file (a part of the path is not a directory)"
    except OSError as e:
        return f"cannot read it: {e.strerror or e}"
    if stat.S_ISREG(mode):
        return None
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a file"


def read_plan_text(path: str | Path) -> str:
    """The text of a plan file, checked to be a regular UTF-8 file of at most MAX_PLAN_BYTES."""
    problem = path_problem(path)
    if problem is not None:
        raise PlanSyntaxError(f"plan {path}: {problem}", hint="give the path of a .par file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)  # the file may be larger than stat said by now
    except OSError as e:
        raise PlanSyntaxError(f"plan {path}: cannot read it: {e.strerror or e}") from None
    if len(data) > MAX_PLAN_BYTES:
        raise PlanSyntaxError(f"plan {path} is over {MAX_PLAN_BYTES} bytes ({MAX_PLAN_BYTES // 1024} KiB), the "
                              "most parc reads", hint="a plan is a page of text; is this the right file?")
    return decode_plan(data, str(path))


def decode_plan(data: bytes, file: str = "<plan>") -> str:
    """The bytes of a plan as text: UTF-8, or a PlanSyntaxError at the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanSyntaxError(diagnostics=[_encoding_diagnostic(e, data, file)]) from None


def _encoding_diagnostic(e: UnicodeDecodeError, data: bytes, file: str) -> Diagnostic:
    """The first byte that is not UTF-8, at its line and column (code points of the valid text before it)."""
    line_start = data.rfind(b"\n", 0, e.start) + 1
    line = data.count(b"\n", 0, e.start) + 1
    prefix = data[line_start:e.start].decode("utf-8")  # valid: the first bad byte is at e.start
    if line == 1 and prefix.startswith("\ufeff"):
        prefix = prefix[1:]
    col = len(prefix) + 1
    text = data.decode("utf-8", errors="replace")  # one U+FFFD per bad sequence: the prefix is unchanged
    text = text[1:] if text.startswith("\ufeff") else text
    bad = data[e.start:e.end].hex(" ")
    return Diagnostic(f"the plan is not UTF-8 text: byte{'s' * (e.end - e.start > 1)} {bad} ({e.reason})",
                      Span(file, line, col, line, col + 1), "save the plan as UTF-8", source=text)


def _check_size(text: str, file: str) -> None:
    """Refuse a text too large to be a plan, or with an over-long line, before lark reads it."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PLAN_BYTES:
        raise PlanSyntaxError(f"the plan is {size} bytes, over {MAX_PLAN_BYTES} ({MAX_PLAN_BYTES // 1024} KiB), "
                              "the most parc reads", Span(file, 1, 1), "a plan is a page of text",
                              source=text)
    for number, line in enumerate(source_lines(text), 1):  # a CRLF's \r does not count, as in a span
        if len(line) > MAX_LINE_CHARS:
            raise PlanSyntaxError(f"line {number} is {len(line)} characters long, over {MAX_LINE_CHARS}, the most "
                                  "parc reads in one line", Span(file, number, MAX_LINE_CHARS + 1),
                                  "one statement per line; a { block } takes one rule per line", source=text)


def _position(d: Diagnostic) -> tuple[int, int]:
    return (d.span.line, d.span.col) if d.span else (0, 0)


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    grammar = (importlib.resources.files("parc.grammar") / "parc.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False)


# ---- step 1: syntax errors, said in words ---------------------------------------------

_WORDS = {"NAME": "a name", "VALUE": "a value", "STRING": 'a quoted "pattern"',
          "_NL": "end of line", "$END": "end of file"}


def _syntax_diagnostic(e: UnexpectedInput, file: str, text: str) -> Diagnostic:
    lines = source_lines(text)  # as lark counts them: "\n" only
    line, col = getattr(e, "line", -1), getattr(e, "column", -1)
    if isinstance(e, UnexpectedToken):
        expected, found, width = e.expected, _describe_token(e.token), max(1, len(str(e.token)))
    elif isinstance(e, UnexpectedCharacters):
        char = text[e.pos_in_stream:e.pos_in_stream + 1]
        expected, found, width = e.allowed or set(), f"character {char!r}", 1
    else:  # UnexpectedEOF
        expected, found, width = getattr(e, "expected", set()), "end of file", 1
    if not isinstance(line, int) or line < 1:  # lark reports -1 at end of input
        line, col = len(lines), len(lines[-1]) + 1
    if found == "end of line" or line > len(lines):
        width = 1
    words = _expected_words(expected or ())
    message = f"unexpected {found}" + (f"; expected {words}" if words else "")
    if "'='" in words:
        hint = "keys are written key=value, e.g. dp=2"
    elif "'}'" in words:
        hint = "a { block } ends with }"
    else:
        hint = "a statement is one line: `keyword key=value ...`; see docs/plan-language.md"
    return Diagnostic(message, Span(file, line, max(col, 1), line, max(col, 1) + width),
                      hint, source=text)


def _describe_token(tok) -> str:
    if tok.type in ("_NL", "$END"):
        return _WORDS[tok.type]
    return repr(str(tok))


def _expected_words(names) -> str:
    terminals = _parser().terminals
    literal = {t.name: t.pattern.value for t in terminals if t.pattern.type == "str"}
    words = set()
    for name in names:
        value = literal.get(name)
        if value in STATEMENTS:
            words.add("a statement")
        elif value is not None:
            words.add(f"'{value}'")
        else:
            words.add(_WORDS.get(name, name.lower()))
    return " or ".join(sorted(words))


# ---- step 2: the tree as plain records -------------------------------------------------

@dataclass
class _Arg:
    key: str
    key_span: Span
    values: list[str]
    span: Span  # the value(s)


@dataclass
class _Stmt:
    kind: str
    span: Span  # the whole statement
    head: Span  # its keyword
    args: list[_Arg] = field(default_factory=list)
    words: list[tuple[str, Span]] = field(default_factory=list)    # bare names
    strings: list[tuple[str, Span]] = field(default_factory=list)  # quoted patterns, unquoted
    optional: set[int] = field(default_factory=set)  # indices into strings marked `?`
    items: list[tuple] = field(default_factory=list)  # block contents


@v_args(meta=True)
class _Statements(Transformer):
    def __init__(self, file: str):
        super().__init__()
        self.file = file

    def _tok(self, t) -> Span:
        return Span(self.file, t.line, t.column, t.end_line, t.end_column)

    def _stmt(self, kind: str, meta, children) -> _Stmt:
        span = Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)
        stmt = _Stmt(kind, span, Span(self.file, meta.line, meta.column, meta.line, meta.column + len(kind)))
        for c in children:
            if isinstance(c, _Arg):
                stmt.args.append(c)
            elif isinstance(c, tuple):
                stmt.items.append(c)
            elif isinstance(c, list):
                stmt.items.extend(c)
            elif c.type == "STRING":
                stmt.strings.append((str(c)[1:-1], self._tok(c)))
            elif c.type == "OPTIONAL":
                stmt.optional.add(len(stmt.strings) - 1)
            else:
                stmt.words.append((str(c), self._tok(c)))
        return stmt

    def __default__(self, data, children, meta):
        """Every statement rule (mesh, topology, ...) becomes a _Stmt of that kind."""
        if data not in STATEMENTS:
            raise ValueError(f"grammar rule {data} has no transformer method")  # a bug in parc, not user input
        return self._stmt(str(data), meta, children)

    def start(self, meta, children):
        return list(children)

    def kwarg(self, meta, children):
        key, values = children
        first, last = values[0][1], values[-1][1]
        span = Span(self.file, first.line, first.col, last.end_line, last.end_col)
        return _Arg(str(key), self._tok(key), [v for v, _ in values], span)

    def value(self, meta, tokens):
        return [(str(t), self._tok(t)) for t in tokens]

    def tp_rule(self, meta, children):
        pattern, style = children[0], children[-1]  # between them, `?` when the rule is optional
        span = Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)
        return ("rule", str(pattern)[1:-1], str(style), span, self._tok(style), len(children) == 3)

    def tp_flag(self, meta, children):
        return ("flag", str(children[0]), self._tok(children[0]))

    def cuts(self, meta, children):
        return ("cuts", list(children))  # a tuple, so `{ }` still says "explicit cuts, none"

    def cut(self, meta, children):
        where, path = children
        span = Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)
        return ("cut", str(path)[1:-1], str(where), span, self._tok(where))

    def unknown_block(self, meta, children):
        return []

    def unknown(self, meta, children):
        name, rest = children[0], children[1:]
        stmt = self._stmt(str(name), meta, rest)
        stmt.head = self._tok(name)
        stmt.kind = "?" + str(name)
        return stmt


# ---- step 3: keys, value types, and the dataclasses -------------------------------------

class _Bad(Exception):
    """A value of the wrong type; caught in `_Builder._kwargs` and turned into a Diagnostic."""


# ASCII only: Python's \d also matches "２" (full width) and "٢" (Arabic-Indic), which int() reads as 2.
# Integers are counts: no sign, no leading zero ("08" is not the 8 it looks like in every language).
_NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_INT = re.compile(r"0|[1-9][0-9]*")
_BANDWIDTH = re.compile(r"(?P<num>(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?)(?P<unit>[KMGT]?B|[KMGT]?bit)/s")
_SCALE = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_WORD = re.compile(r"[A-Za-z0-9_]+")  # names in values may start with a digit: 1f1b, h100


def _clip(text: str) -> str:
    return text if len(text) <= 30 else text[:30] + "…"


def _one(arg: _Arg, what: str) -> str:
    if len(arg.values) != 1:
        raise _Bad(f"takes one value ({what}), got {','.join(arg.values)}")
    return arg.values[0]


def _int(what: str) -> Callable[[_Arg], int]:
    def conv(arg: _Arg) -> int:
        text = _one(arg, what)
        if not _INT.fullmatch(text) or len(text) > 30:  # Python refuses int() of huge digit strings
            # a look-alike of a count ("２", "٢", "+2", "08"): say what is accepted; "-2" needs no more words
            how = " in ASCII digits 0-9, without a sign or leading zeros" \
                if re.fullmatch(r"\+?\d+", text) else ""
            raise _Bad(f"must be {what}{how}, got {_clip(text)}")
        return int(text)
    return conv


def _float(arg: _Arg) -> float:
    text = _one(arg, "a number")
    if not _NUMBER.fullmatch(text) or not math.isfinite(float(text)):
        raise _Bad(f"must be a finite number, got {text}")
    return float(text)


def _bandwidth(arg: _Arg) -> float:
    text = _one(arg, "a bandwidth")
    m = _BANDWIDTH.fullmatch(text)
    if not m:
        raise _Bad(f"must be a bandwidth such as 900GB/s or 400Gbit/s, got {text}")
    unit = m["unit"]
    scale = _SCALE[unit[:-1] if unit.endswith("B") else unit[:-3]]
    value = float(m["num"]) * scale / (8 if unit.endswith("bit") else 1)
    if not math.isfinite(value):
        raise _Bad(f"must be a finite bandwidth, got {text}")
    return value


def _name(arg: _Arg) -> str:
    text = _one(arg, "a name")
    if not _WORD.fullmatch(text):
        raise _Bad(f"must be a name, got {text}")
    return text


_PRESET_FILE = re.compile(r"[A-Za-z0-9_./~+-]+\.json")


def _preset(arg: _Arg) -> str:
    """A preset name (h100) or a `parc calibrate` file's path ending in .json, relative to the plan's own
    directory (parc.analysis.preset_file.resolve): what `parc plan --preset FILE -o OUT` writes."""
    text = _one(arg, "a preset name or a .json file")
    if not (_WORD.fullmatch(text) or _PRESET_FILE.fullmatch(text)):
        raise _Bad(f"must be a preset name (h100) or a preset file's path ending in .json, got {_clip(text)}")
    return text


def _names(arg: _Arg) -> tuple[str, ...]:
    bad = [v for v in arg.values if not _WORD.fullmatch(v)]
    if bad:
        raise _Bad(f"must be a list of names, got {','.join(arg.values)}")
    return tuple(arg.values)


def _stages(arg: _Arg) -> int | None:
    text = _one(arg, "auto or an integer")
    if text == "auto":
        return None
    if not _INT.fullmatch(text) or len(text) > 30:
        raise _Bad(f"must be auto or a positive integer, got {_clip(text)}")
    return int(text)


def _betas(arg: _Arg) -> tuple[float, float]:
    if len(arg.values) != 2:
        raise _Bad(f"takes two numbers (beta1,beta2), got {','.join(arg.values)}")
    return tuple(_float(_Arg(arg.key, arg.key_span, [v], arg.span)) for v in arg.values)


_POSITIVE = _int("a positive integer")
KEYS: dict[str, dict[str, Callable[[_Arg], object]]] = {
    "mesh": {"dp": _POSITIVE, "pp": _POSITIVE, "tp": _POSITIVE, "order": _names, "ep": _POSITIVE,
             "cp": _POSITIVE},
    "topology": {"nodes": _POSITIVE, "gpus_per_node": _POSITIVE, "intra": _bandwidth,
                 "inter": _bandwidth, "preset": _preset},
    "batch": {"global": _POSITIVE, "micro": _POSITIVE, "accumulation": _POSITIVE},
    "tensor_parallel": {},
    "pipeline": {"schedule": _name, "stages": _stages, "virtual": _POSITIVE},
    "zero": {"stage": _int("an integer 0..3"), "shard": _POSITIVE, "offload": _name},
    "recompute": {},
    "precision": {"reduce": _name, "accumulate": _name, "initial_scale_power": _int("an integer 0..64"),
                  "loss_scale_window": _POSITIVE, "hysteresis": _POSITIVE, "min_loss_scale": _float,
                  "loss_scale": _float},
    "compile": {},
    "optimizer": {"lr": _float, "betas": _betas, "eps": _float, "weight_decay": _float,
                  "clip": _float,
                  "warmup": _int("a number of steps ≥ 0"), "decay": _name, "decay_steps": _POSITIVE,
                  "min_lr": _float, "no_decay": _names},
    "expert_parallel": {},
    "context_parallel": {},
}


def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    known = ", ".join(choices) if choices else "none"
    return (f"did you mean `{close[0]}`? " if close else "") + f"known: {known}"


class _Builder:
    """Checks keys and types statement by statement; collects errors in `self.errors`."""

    def __init__(self, file: str, text: str):
        self.file, self.text = file, text
        self.errors: list[Diagnostic] = []
        self.spans: dict[str, Span] = {}

    def error(self, message: str, span: Span, hint: str | None = None) -> None:
        self.errors.append(Diagnostic(message, span, hint, source=self.text))

    def build(self, stmts: list[_Stmt]) -> Plan:
        seen: dict[str, _Stmt] = {}
        parts: dict[str, object] = {}
        for stmt in stmts:
            if stmt.kind.startswith("?"):
                self.error(f"unknown statement `{stmt.kind[1:]}`", stmt.head,
                           _did_you_mean(stmt.kind[1:], STATEMENTS))
                continue
            if stmt.kind in seen:
                self.error(f"duplicate `{stmt.kind}` statement", stmt.head,
                           f"the first `{stmt.kind}` is on line {seen[stmt.kind].span.line}; "
                           "merge them into one")
                continue
            seen[stmt.kind] = stmt
            self.spans[stmt.kind] = stmt.head
            parts[stmt.kind] = getattr(self, "_" + stmt.kind)(stmt, self._kwargs(stmt))
        if "mesh" not in seen:
            self.error("the plan has no `mesh` statement", Span(self.file, 1, 1, 1, 2),
                       "every plan states its mesh, e.g. `mesh dp=2`")
        plan = Plan(**{k: v for k, v in parts.items() if v is not None and k != "batch"},
                    batch=parts.get("batch"), file=self.file, source=self.text, spans=self.spans,
                    grad_reduce=getattr(self, "grad_reduce", "fp32"),
                    grad_accumulate=getattr(self, "grad_accumulate", "fp32"),
                    loss_scaling=getattr(self, "loss_scaling", LossScaling()))
        return plan

    def _kwargs(self, stmt: _Stmt) -> dict[str, object]:
        allowed = KEYS[stmt.kind]
        out: dict[str, object] = {}
        first: dict[str, _Arg] = {}
        for arg in stmt.args:
            if arg.key not in allowed:
                hint = _did_you_mean(arg.key, tuple(allowed))
                if not allowed:
                    hint = f"`{stmt.kind}` takes no keys; see docs/plan-language.md"
                self.error(f"unknown key `{arg.key}` in `{stmt.kind}`", arg.key_span, hint)
            elif arg.key in first:
                self.error(f"duplicate key `{arg.key}` in `{stmt.kind}`", arg.key_span,
                           f"`{arg.key}` is first given at column {first[arg.key].key_span.col}")
            else:
                first[arg.key] = arg
                try:
                    out[arg.key] = allowed[arg.key](arg)
                except _Bad as bad:
                    self.error(f"{stmt.kind} {arg.key} {bad}", arg.span)
                else:
                    self.spans[f"{stmt.kind}.{arg.key}"] = arg.span
        return out

    def _mesh(self, stmt: _Stmt, kw: dict) -> Mesh:
        cp = kw.get("cp", 1)
        return Mesh(dp=kw.get("dp", 1), pp=kw.get("pp", 1), tp=kw.get("tp", 1),
                    order=kw.get("order", CP_DEFAULT_ORDER if cp > 1 else DEFAULT_ORDER), ep=kw.get("ep", 1),
                    span=stmt.span, cp=cp)

    def _topology(self, stmt: _Stmt, kw: dict) -> Topology:
        return Topology(nodes=kw.get("nodes", 1), gpus_per_node=kw.get("gpus_per_node", 8),
                        intra_bw=kw.get("intra"), inter_bw=kw.get("inter"),
                        preset=kw.get("preset"), span=stmt.span)

    def _batch(self, stmt: _Stmt, kw: dict) -> Batch | None:
        given = {arg.key for arg in stmt.args}  # a key given with a bad value is not "missing"
        missing = [k for k in ("global", "micro") if k not in given]
        if missing:
            self.error(f"`batch` needs {' and '.join(k + '=' for k in missing)}", stmt.head,
                       "e.g. `batch global=32 micro=2`; accumulation is derived")
        if "global" not in kw or "micro" not in kw:
            return None
        return Batch(kw["global"], kw["micro"], kw.get("accumulation"), span=stmt.span)

    def _tensor_parallel(self, stmt: _Stmt, kw: dict) -> TensorParallel:
        rules, flags = [], {}
        for item in stmt.items:
            if item[0] == "rule":
                _, pattern, style, span, style_span, optional = item
                self.spans[f"tensor_parallel.rules[{len(rules)}].style"] = style_span
                rules.append(TPRule(pattern, style, span=span, optional=optional))
                continue
            _, flag, span = item
            if flag not in TP_FLAGS:
                self.error(f"unknown flag `{flag}` in `tensor_parallel`", span,
                           _did_you_mean(flag, TP_FLAGS) + '; rules are written "pattern" : style')
            elif flag in flags:
                self.error(f"duplicate flag `{flag}`", span, f"first given on line {flags[flag].line}")
            else:
                flags[flag] = span
        return TensorParallel(tuple(rules), "sequence_parallel" in flags, span=stmt.span)

    def _pipeline(self, stmt: _Stmt, kw: dict) -> Pipeline:
        cuts = None  # no block: the compiler places the cuts
        for _, block in stmt.items:
            cuts = []
            for _, path, where, span, where_span in block:
                self.spans[f"pipeline.cuts[{len(cuts)}].where"] = where_span
                cuts.append(Cut(path, where, span=span))
            cuts = tuple(cuts)
        return Pipeline(schedule=kw.get("schedule", "1f1b"), stages=kw.get("stages"),
                        virtual=kw.get("virtual", 1), cuts=cuts, span=stmt.span)

    def _zero(self, stmt: _Stmt, kw: dict) -> Zero:
        return Zero(kw.get("stage", 0), kw.get("shard"), kw.get("offload"), span=stmt.span)

    def _recompute(self, stmt: _Stmt, kw: dict) -> Recompute:
        for i, (_, span) in enumerate(stmt.strings):
            self.spans[f"recompute.patterns[{i}]"] = span
        return Recompute(tuple(p for p, _ in stmt.strings), span=stmt.span,
                         optional=tuple(p for i, (p, _) in enumerate(stmt.strings) if i in stmt.optional))

    def _expert_parallel(self, stmt: _Stmt, kw: dict) -> ExpertParallel:
        for i, (_, span) in enumerate(stmt.strings):
            self.spans[f"expert_parallel.patterns[{i}]"] = span
        return ExpertParallel(tuple(p for p, _ in stmt.strings), span=stmt.span)

    def _precision(self, stmt: _Stmt, kw: dict) -> str:
        name, span = stmt.words[0]
        self.spans["precision"] = span
        self.grad_reduce = kw.get("reduce", "fp32")  # a Plan field of its own: `precision` stays a name
        self.grad_accumulate = kw.get("accumulate", "fp32")  # ZeRO-1/2's gradient accumulators (validate)
        # fp16's scaler keys (validate refuses them under another precision, at the key)
        self.loss_scaling = LossScaling(**{k: kw[k] for k in LOSS_SCALING_KEYS if k in kw})
        return name

    def _context_parallel(self, stmt: _Stmt, kw: dict) -> ContextParallel:
        name, span = stmt.words[0]
        self.spans["context_parallel"] = span
        return ContextParallel(name, span=span)

    def _compile(self, stmt: _Stmt, kw: dict) -> str:
        name, span = stmt.words[0]
        self.spans["compile"] = span
        return name

    def _optimizer(self, stmt: _Stmt, kw: dict) -> Optimizer:
        name, span = stmt.words[0]
        self.spans["optimizer.name"] = span
        base = Optimizer()
        return Optimizer(name, kw.get("lr", base.lr), kw.get("betas", base.betas),
                         kw.get("eps", base.eps), kw.get("weight_decay", base.weight_decay),
                         kw.get("clip", base.grad_clip), kw.get("warmup", base.warmup),
                         kw.get("decay", base.decay), kw.get("decay_steps", base.decay_steps),
                         kw.get("min_lr", base.min_lr), kw.get("no_decay", base.no_decay), span=stmt.span)
