"""Fuzzing every way a plan file can be bad (issue 10): over 10,000 inputs, deterministic.

Start at `_check_all`. Each input (bytes or text) goes through what `parc check` runs
without --model, in-process: decode, parse, validate, and the review (`parc.cli._review`:
support, precision, topology, schedule). Each must end within `LIMIT_S` (a SIGALRM
hang guard, so a hang fails instead of stalling CI; speed is bench/plan_parse.py's), either as a plan that round-trips
through the printer, or as a ParcError whose every diagnostic has a span in the file
and renders with the caret under the spanned character (`_check_caret` recomputes
the terminal cells independently of parc/errors.py). Any other exception is a bug.
The categories: truncations at every byte of every example, invalid encodings,
control and separator characters, token swaps and duplications, extreme integers,
deep nesting, megabyte lines, CRLF and BOM (which must not change a diagnostic), and,
through the real CLI as subprocesses, special files and a sample of the rest (exit
2, no traceback). tests/test_plan_fuzz.py adds hypothesis's random edits.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from parc.cli import _review
from parc.errors import MAX_ECHO, MAX_SHOWN, ParcError, PlanError, render_all
from parc.grammar.parser import MAX_PLAN_BYTES, decode_plan, parse
from parc.grammar.printer import format_plan
from parc.grammar.validate import validate

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {p.name: p.read_bytes() for p in sorted((ROOT / "examples").glob("*.par"))}
FILE = "fuzz.par"
# A hang guard, not a speed bound (tests assert behaviour; bench/plan_parse.py measures speed): the hangs
# of issue 10 took minutes or never ended, a small plan takes ~5 ms, the worst accepted size ~1 s. On a
# loaded machine a 2 s bound failed a test that passes alone (issue 29). Past it SIGALRM fails the input.
LIMIT_S = 60.0
ARGS = argparse.Namespace(world_size=None, preset=None)
CONTROL = ["\x00", "\x07", "\x08", "\x0b", "\x0c", "\r", "\x1b", "\x1c", "\x1f", "\x7f", "\x85", "\x9b",
           "\u00a0", "\u200b", "\u200d", "\u2028", "\u2029", "\u202e", "\ufeff", "\ufffd", "\t", "\n",
           "日", "本", "\u0301", "😀", "\U000e0001", "\uffff"]
EXTREME = ["0", "-0", "-1", "+1", "00", "1.5", "1e3", "1e999", "nan", "inf", "65536", "65537", "4096", "4097",
           str(2**16 + 1), str(2**31), str(2**63), str(10**29), str(10**30), "9" * 31, "1" + "0" * 200]
BAD_BYTES = [b"\xff", b"\xfe", b"\x80", b"\xc3", b"\xc3(", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf",
             b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80"]
TOKEN = re.compile(r'"[^"\n]*"|[{}=,:#]|[^\s{}=,:#"]+|\s+')


# Warm up outside any timer: the first review imports torch (parc.runtime.precision) and lark builds
# its tables once; an alarm inside an import would measure the import and could leave it half done.
_review(parse("mesh\n", FILE), ARGS, None, failed=False)


class _Hang(BaseException):
    """Raised by SIGALRM inside the input that ran past LIMIT_S (a BaseException: no `except Exception` eats it)."""


def _on_alarm(signum, frame):
    raise _Hang()


def _run(data: bytes | str, limit: float = LIMIT_S):
    """(plan, None) or (None, ParcError) for one input, within `limit` seconds."""
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        text = decode_plan(data, FILE) if isinstance(data, bytes) else data
        plan = parse(text, FILE)
        validate(plan)
        diags = _review(plan, ARGS, None, failed=False)
        if any(d.severity == "error" for d in diags):  # as parc check raises them, all together
            raise PlanError(diagnostics=diags)
        return plan, None
    except ParcError as e:
        return None, e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _stand_in(ch: str) -> str:
    """How the renderer must echo a code point (docs/plan-language.md, Diagnostics)."""
    if ch == "\t":
        return ch
    if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
        return " " if ch.isspace() else "\ufffd"
    return ch


def _starts(printed: str) -> tuple[list[int], int]:
    """The terminal cell where each character of a printed line starts (tab stops every 8), and the end."""
    col, starts = 0, []
    for ch in printed:
        starts.append(col)
        if ch == "\t":
            col = (col // 8 + 1) * 8
        elif not (unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me")):
            col += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return starts, col


def _check_caret(d, text: str) -> None:
    """The echoed line is the spanned one, and the caret's cell is where the spanned character starts."""
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]  # lark counts "\n" only
    assert d.span is not None and d.span.file == FILE, d
    assert 1 <= d.span.line <= len(lines), (d.span, len(lines))
    src = lines[d.span.line - 1]
    assert 1 <= d.span.col <= len(src) + 1, (d.span, len(src))
    out = d.render().split("\n")
    assert len(out) >= 3 and out[1].startswith("    ") and out[2].startswith("    "), out[:3]
    echoed, caret = out[1], out[2]
    assert set(caret[4:caret.index("^")]) <= {" ", "\t"} and set(caret[caret.index("^") + 1:]) <= {"~"}, caret
    starts, end = _starts(echoed)
    cell = _starts(caret[:caret.index("^")])[1]
    at = [k for k, s in enumerate(starts) if s == cell]
    k = 4 + d.span.col - 1  # where the spanned character is, if the whole line is echoed
    if len(src) <= MAX_ECHO:
        assert echoed[4:] == "".join(_stand_in(c) for c in src)
        assert (k in at) if d.span.col <= len(src) else cell == end, (echoed, caret, d.span)
    elif d.span.col <= len(src):  # a window: the caret is over the same character
        assert any(echoed[j] == _stand_in(src[d.span.col - 1]) for j in at), (echoed, caret, d.span)
    else:
        assert cell == end and echoed.endswith(_stand_in(src[-1])), (echoed[-5:], caret[-5:])


def _check_all(inputs, limit: float = LIMIT_S) -> dict[str, int]:
    """Every input ends in time, as a round-tripping plan or a ParcError rendered as promised."""
    seen = {"plans": 0, "errors": 0}
    for data in inputs:
        try:
            plan, err = _run(data, limit)
        except _Hang:
            pytest.fail(f"over {limit} s: {data[:200]!r}… ({len(data)} long)")
        except Exception as e:  # any other exception escaping is the traceback issue 10 is about
            raise AssertionError(f"{type(e).__name__} for input {data[:300]!r}") from e
        if plan is not None:
            seen["plans"] += 1
            assert parse(format_plan(plan)) == plan
            continue
        seen["errors"] += 1
        text = data if isinstance(data, str) else data.decode("utf-8", errors="replace")
        text = text[1:] if text.startswith("\ufeff") else text
        try:
            for d in err.diagnostics[:MAX_SHOWN]:
                _check_caret(d, text)
        except AssertionError as e:
            raise AssertionError(f"input {data[:300]!r}: {e}") from e
        assert len(render_all(err.diagnostics)) < 300_000  # 50 × (two 160-character lines, a clipped message)
    return seen


def _texts() -> list[str]:
    return [b.decode("utf-8") for b in EXAMPLES.values()]


def _rng(name: str) -> random.Random:
    return random.Random(f"parc-fuzz-{name}")  # a string seed: the same inputs on every run and machine


# ---- the categories ------------------------------------------------------------------

def test_truncations_at_every_byte_of_every_example():
    inputs = [data[:i] for data in EXAMPLES.values() for i in range(len(data) + 1)]
    assert len(inputs) > 2000
    seen = _check_all(inputs)
    assert seen["errors"] > 100 and seen["plans"] > 100  # both outcomes exercised


def test_invalid_encodings():
    rng, inputs = _rng("encodings"), []
    for _ in range(800):
        data = rng.choice(list(EXAMPLES.values()))
        at = rng.randrange(len(data) + 1)
        if rng.random() < 0.5:
            data = data[:at] + rng.choice(BAD_BYTES) + data[at:]
        else:
            data = data[:at] + bytes([rng.randrange(0x80, 0x100)]) + data[at + 1:]
        inputs.append(data if rng.random() < 0.8 else b"\xef\xbb\xbf" + data)
    _check_all(inputs)
    for data in inputs[:200]:  # each one that is not UTF-8 is located at its first bad byte
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            _, err = _run(data)
            assert err.message.startswith("the plan is not UTF-8 text") and err.span.line == \
                data[:e.start].count(b"\n") + 1


def test_control_separator_and_wide_characters():
    rng, inputs = _rng("control"), []
    for _ in range(1500):
        text = rng.choice(_texts())
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(CONTROL) * rng.choice((1, 1, 2, 7)) + text[at:]
        inputs.append(text)
    assert _check_all(inputs)["errors"] > 500


def _token_edit(rng: random.Random, text: str) -> str:
    tokens = TOKEN.findall(text)
    words = [i for i, t in enumerate(tokens) if not t.isspace()]
    op = rng.choice(("swap", "duplicate", "delete", "line", "move"))
    if op == "swap":
        i, j = rng.choice(words), rng.choice(words)
        tokens[i], tokens[j] = tokens[j], tokens[i]
    elif op == "duplicate":
        i = rng.choice(words)
        tokens.insert(rng.choice((i, rng.randrange(len(tokens) + 1))), tokens[i] + rng.choice(("", " ")))
    elif op == "delete":
        del tokens[rng.choice(words)]
    else:
        lines = "".join(tokens).split("\n")
        i = rng.randrange(len(lines))
        if op == "line":
            lines.insert(rng.randrange(len(lines) + 1), lines[i])
        else:
            lines.insert(rng.randrange(len(lines) + 1), lines.pop(i))
        return "\n".join(lines)
    return "".join(tokens)


def test_token_swaps_duplications_and_deletions():
    rng, inputs = _rng("tokens"), []
    for _ in range(2500):
        text = rng.choice(_texts())
        for _ in range(rng.randint(1, 3)):
            text = _token_edit(rng, text)
        inputs.append(text)
    assert _check_all(inputs)["errors"] > 1000


def test_extreme_integers():
    rng, inputs = _rng("integers"), []
    for _ in range(1500):
        text = rng.choice(_texts())
        numbers = list(re.finditer(r"\d+(\.\d+)?", text))
        for m in sorted(rng.sample(numbers, rng.randint(1, 3)), key=lambda m: -m.start()):
            text = text[:m.start()] + rng.choice(EXTREME) + text[m.end():]
        inputs.append(text)
    # and every key of every integer-valued statement at each extreme, alone
    for stmt in ("mesh dp={}", "mesh pp={}", "mesh tp={}", "mesh dp={0} pp={0} tp={0}",
                 "mesh\ntopology nodes={}", "mesh\ntopology gpus_per_node={}", "mesh pp=2\nbatch global={} micro=1",
                 "mesh\nbatch global={0} micro={0}", "mesh\nbatch global=8 micro=1 accumulation={}",
                 "mesh pp=4\npipeline schedule=interleaved_1f1b virtual={}", "mesh\npipeline stages={}",
                 "mesh\nzero stage={}"):
        inputs += [stmt.format(v) + "\n" for v in EXTREME]
    _check_all(inputs)


def test_deep_nesting():
    inputs = []
    for n in (1, 2, 3, 10, 100, 1000, 4000):
        inputs += ["{" * n, "}" * n, "mesh\ntensor_parallel " + "{" * n + "}" * n + "\n",
                   "mesh\ntensor_parallel {\n" + "{\n" * n + "}\n" * n + "}\n",
                   "mesh\npipeline schedule=gpipe " + "{ " * n + "\n",
                   "mesh\nfoo " + "{ " * n + "} " * n + "\n", "mesh dp=" + "=" * n + "\n",
                   "mesh order=" + ",".join(["tp"] * n) + "\n", "mesh\nrecompute " + '"a" ' * n + "\n",
                   "mesh\n" + "tensor_parallel {\n" * n, '"' * n, "mesh " + "(" * n + ")" * n + "\n",
                   ("mesh\n" + "\n".join(["pipeline {"] + ['cut after "x"'] * n + ["}"]))[:60_000] + "\n"]
    assert len(inputs) == 91
    _check_all(inputs)


def test_megabyte_lines_and_files_are_refused_quickly():
    mb = 1 << 20
    inputs = ["mesh # " + "x" * mb, "mesh dp=" + "1" * mb, "mesh " + "dp=1 " * (mb // 5),
              'mesh\nrecompute "' + "a" * mb + '"', "mesh\n" + "\n" * mb, "mesh\n" + "# c\n" * (mb // 4),
              "mesh " + "日" * mb, "\x00" * mb, b"mesh \xff" + b"x" * mb, "mesh\n" + "{" * mb,
              "mesh\n" + "x" * 4097, "mesh\n" + "#" * (MAX_PLAN_BYTES + 1)]
    seen = _check_all(inputs)
    assert seen["errors"] == len(inputs)


def test_the_worst_accepted_size_still_parses_in_seconds():
    line = "mesh " + " ".join(["dp=1"] * 800) + "\n"  # the duplicate keys of issue 10, at 64 KiB
    # ~1 s on an idle core (bench/plan_parse.py); issue 10's version printed 481 MB
    _check_all([line * (MAX_PLAN_BYTES // len(line))])


def test_crlf_and_bom_change_no_diagnostic():
    rng, inputs = _rng("crlf"), []
    for _ in range(1000):
        text = _token_edit(rng, rng.choice(_texts()))
        if rng.random() < 0.5:
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(EXTREME + ["{", "}", "=", '"']) + text[at:]
        inputs.append(text)
    variants = [t.replace("\n", "\r\n") for t in inputs] + ["\ufeff" + t for t in inputs]
    _check_all(variants)

    def key(text):
        _, err = _run(text)
        return None if err is None else [(d.message, d.span.line, d.span.col) for d in err.diagnostics]

    for text in inputs[:200]:
        assert key(text.replace("\n", "\r\n")) == key(text) == key("\ufeff" + text), repr(text)


# ---- through the real CLI: special files and a sample of the above ------------------------

def test_cli_sample_exits_2_without_traceback(tmp_path):
    files = {"bad_utf8.par": b"mesh dp=2 \xff\n", "control.par": "mesh dp=2\x1b[31m\u2028\nzero stage=9\n".encode(),
             "truncated.par": EXAMPLES["3d.par"][:300], "extreme.par": b"mesh dp=99999999999999999999 tp=2\n",
             "nested.par": b"mesh\ntensor_parallel " + b"{" * 5000 + b"\n", "huge.par": b"mesh # " + b"x" * (1 << 20),
             "crlf_bom.par": b"\xef\xbb\xbfmesh dp=2\r\nbatch global=7 micro=2\r\n",
             "dups.par": ("mesh " + " ".join(["dp=1"] * 800) + "\n").encode() * 10}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    os.mkfifo(tmp_path / "fifo.par")  # never opened: a reader would block until a writer came
    targets = [*files, "fifo.par", "/dev/null", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "parc.cli", "check", t], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in targets]
    procs.append(subprocess.Popen([sys.executable, "-m", "parc.cli", "compile", str(ROOT / "examples/gpt.py"),
                                   "--plan", "bad_utf8.par", "-o", "out"], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for target, proc in zip(targets + ["bad_utf8.par"], procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 2 and "Traceback" not in err and err.strip(), (target, err[-2000:])
        assert len(err) < 300_000 and "\x1b" not in err, target  # bounded, and no raw escape reaches a terminal
        first = err.splitlines()[0]
        assert first.startswith((f"{target}:", "error: plan ")), (target, first)
    assert not (tmp_path / "out").exists()
