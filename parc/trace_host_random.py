"""Host randomness in forward: refused at compile, located, never baked into the program as a constant.

Start here: parc/trace.py exports under `watched(model, user)` and, when it reports a draw, calls
`locate_draw`. torch.export (strict=False) runs the forward's Python exactly once. A number drawn
there from a host generator (`random.random()`, `random.choice(...)`, `np.random.rand()`, a
`random.Random` or numpy `Generator` the model holds) is a Python value, not a tensor op, so it
becomes a constant of the traced graph: eager draws anew on every call, the compiled program would
replay the one draw on every step and every rank. That trains differently from the serial model
with no error anywhere, so compile refuses it. Randomness drawn with torch (`torch.rand`,
`torch.bernoulli`, dropout) is a graph op and stays random (passes/dropout.py keys dropout).

Two stages, so that a model without host randomness pays nothing:

1. `watched` snapshots the state of every host generator in reach: Python's global `random`,
   numpy's global `RandomState` (when numpy is imported), and each `random.Random`, numpy
   `RandomState` or `Generator` held by an attribute of one of the model's modules or a global of
   the model file. A state that changed across the export means forward drew from it.
2. `locate_draw` exports once more under a profile hook that sees every call into those
   generators' C methods and records the first whose innermost caller outside the standard
   library, numpy, torch and parc is the user's code: the refusal points at that line and columns,
   naming the module whose forward ran. A draw made only by torch's or a library's own machinery is
   not the model's, and is let through.

Not seen: generators without state to compare (`random.SystemRandom`, `os.urandom`, `secrets`)
and ones reachable only through containers or other modules' globals; the clock (`time.time()`) is
baked in the same way. docs/model-convention.md says so.

Assumes tracing runs in this thread. Guarantees: the profile hook is removed on exit, also on error;
generator states are read, never set, so the user's random streams are those of an eager run that
called forward once more.
"""

from __future__ import annotations

import contextlib
import linecache
import random
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from parc.errors import Span, TraceError
from parc.trace_guards import _PARC, _TORCH, running_module

_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_HINT = ("draw with torch inside forward (`torch.rand`, `torch.bernoulli`, `nn.Dropout`: graph ops, random on "
         "every step), or draw outside the model and pass the value in the batch")


@contextlib.contextmanager
def watched(model: torch.nn.Module, user_module: ModuleType | None) -> Iterator[Callable[[], bool]]:
    """Yield `drew()`: whether a host generator in reach has changed state since the block began (called after
    it; module docstring)."""
    generators = _generators(model, user_module)
    before = [_state(g) for g in generators]
    yield lambda: any(_state(g) != s for g, s in zip(generators, before))


@contextlib.contextmanager
def locate_draw(model: torch.nn.Module, user_module: ModuleType | None) -> Iterator[None]:
    """Run the block (the same export again) tracing the model's own lines; refuse at the first line after which
    a host generator's state had changed (module docstring)."""
    names = {id(m): n for n, m in model.named_modules()}
    generators = _generators(model, user_module)
    library = _library_test()
    before = [_state(g) for g in generators]
    last: list = [None]  # the model's line that ran last: (frame, line)
    found: list = []

    def check(frame, line: int | None) -> None:
        """A generator changed since the last check: the draw was on the line that ran last."""
        if found:
            return
        now = [_state(g) for g in generators]
        if now != before and last[0] is not None:
            drawn = next(g for g, a, b in zip(generators, before, now) if a != b)
            at_frame, at_line = last[0]
            found.append((drawn, at_frame.f_code.co_filename, at_line, running_module(names, at_frame)))
        before[:] = now
        if line is not None:
            last[0] = (frame, line)

    def in_model(frame, event, arg):
        if event == "line":
            check(frame, frame.f_lineno)
        elif event == "return":  # back to the model's innermost line still running
            caller = frame.f_back
            while caller is not None and library(caller.f_code.co_filename):
                caller = caller.f_back
            check(caller, caller.f_lineno if caller is not None else None)
        return in_model

    def on_call(frame, event, arg):
        if library(frame.f_code.co_filename):
            return None  # no line events inside torch, numpy, the standard library or parc
        check(frame, None)
        return in_model

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)
    if found:
        drawn, file, line, where = found[0]
        text = linecache.getline(file, line)
        span = Span(str(Path(file).resolve()), line, len(text) - len(text.lstrip()) + 1)
        raise TraceError(f"{_name(drawn)} in forward{where}: torch.export runs the forward's Python once, so the "
                         f"compiled program would replay this one draw on every step, where eager draws anew", span,
                         hint=_HINT)


def _generators(model: torch.nn.Module, user_module: ModuleType | None) -> list:
    """The host generators in reach: the global ones, then those the model's modules or the model file hold."""
    found = [random._inst]
    np_random = _numpy_random()
    if np_random is not None:
        found.append(np_random.mtrand._rand)
    kinds = _generator_types()
    values = [v for m in model.modules() for v in vars(m).values()]
    values += list(vars(user_module).values()) if user_module is not None else []
    for v in values:
        if isinstance(v, kinds) and not any(v is g for g in found):
            found.append(v)
    return found


def _state(generator) -> object:
    """A comparable snapshot of a generator's state."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    np_random = _numpy_random()
    if isinstance(generator, np_random.RandomState):
        name, keys, pos, has_gauss, gauss = generator.get_state()
        return name, keys.tobytes(), pos, has_gauss, gauss
    return repr(generator.bit_generator.state)  # a Generator: nested dicts of ints and arrays


def _name(generator) -> str:
    """How the refusal names the generator drawn from."""
    if isinstance(generator, random.Random):
        return "a draw from Python's `random`" if generator is random._inst else "a draw from a `random.Random`"
    np_random = _numpy_random()
    return "a draw from `numpy.random`" if generator is np_random.mtrand._rand else "a draw from a numpy generator"


def _generator_types() -> tuple[type, ...]:
    np_random = _numpy_random()
    numpy_kinds = (np_random.RandomState, np_random.Generator) if np_random is not None else ()
    return (random.Random, *numpy_kinds)


def _numpy_random() -> ModuleType | None:
    """numpy.random if the model (or anything) imported numpy; parc never imports numpy for this."""
    numpy = sys.modules.get("numpy")
    return numpy.random if numpy is not None else None  # numpy ≥ 2 loads numpy.random on first use


def _library_test() -> Callable[[str], bool]:
    """Whether a file is code whose calls are not the model's own: the standard library (random.py's wrappers),
    numpy, torch, parc, generated code. Packages installed beside the standard library (site-packages: transformers, say) are
    the model's."""
    dirs = [_TORCH, *_PARC]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        dirs.append(Path(numpy.__file__).resolve().parent)
    seen: dict[str, bool] = {}

    def library(filename: str) -> bool:
        if filename not in seen:
            if filename.startswith("<"):  # generated code (`<string>`, `<frozen ...>`): torch's and Python's own
                seen[filename] = True
                return True
            path = Path(filename).resolve()
            stdlib = path.is_relative_to(_STDLIB) and not {"site-packages", "dist-packages"} & set(path.parts)
            seen[filename] = stdlib or any(path.is_relative_to(d) for d in dirs)
        return seen[filename]
    return library
