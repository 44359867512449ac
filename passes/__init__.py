"""Compiler passes over the traced aten-level FX graph.

Start here: every pass is one module with `run(graph, plan, ctx) -> graph` and a
docstring that states what it assumes and what it guarantees. `run_passes` runs
them in order, lints the graph after each, checks the contract every pass shares
(the program still returns exactly one scalar loss; a pipeline stage before
the last returns the values it sends), and logs each pass's name,
its rewrite count and, with `debug=True`, its time and a before/after diff.
"""

from __future__ import annotations

import difflib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:  # the report imports parc.passes.schedule without torch
    import torch.fx as fx

log = logging.getLogger("parc.passes")


@dataclass
class PassCtx:
    """What a pass may read and write besides the graph: no globals, no process groups.

    `stage` and `tp_rank` say which program is being compiled; `traced` is the
    front end's `parc.traced.Traced`; `state` maps placeholder names to the shard
    spec the runtime uses to slice the full weight (`{"dim": d, "parts": n,
    "index": i}`, or None for a full copy); `rewrites` counts each pass's edits.
    """

    traced: object
    stage: int = 0
    tp_rank: int = 0
    shards: dict[str, dict | None] = field(default_factory=dict)
    rewrites: dict[str, int] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)

    def count(self, pass_name: str, n: int = 1) -> None:
        self.rewrites[pass_name] = self.rewrites.get(pass_name, 0) + n


class Pass(Protocol):
    __name__: str

    def __call__(self, graph: fx.GraphModule, plan, ctx: PassCtx) -> fx.GraphModule: ...


def _check_contract(gm: fx.GraphModule, name: str, ctx: PassCtx | None = None) -> None:
    gm.graph.lint()
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    (result,) = out.args
    split = ctx.notes.get("pipeline") if ctx is not None else None
    if split is not None and not split["last"]:
        # a stage before the last returns the values it sends (passes/pipeline_split.py)
        if not (isinstance(result, (tuple, list)) and len(result) == len(split["send"])):
            raise RuntimeError(f"pass {name} broke the stage contract: output must be the "
                               f"{len(split['send'])} sent values, got {result!r}")
        return
    if not (isinstance(result, (tuple, list)) and len(result) == 1):
        raise RuntimeError(f"pass {name} broke the program contract: output must be (loss,), got {result!r}")


def run_passes(gm: fx.GraphModule, plan, ctx: PassCtx, passes: list[tuple[str, Callable]],
               debug: bool = False) -> fx.GraphModule:
    for name, fn in passes:
        before = gm.code if debug else None
        t0 = time.perf_counter()
        gm = fn(gm, plan, ctx)
        _check_contract(gm, name, ctx)
        dt = time.perf_counter() - t0
        log.info("pass %-18s stage %d tp %d: %d rewrites", name, ctx.stage, ctx.tp_rank, ctx.rewrites.get(name, 0))
        if debug:
            diff = difflib.unified_diff(before.splitlines(), gm.code.splitlines(), "before", "after", lineterm="", n=1)
            log.debug("pass %s took %.3fs\n%s", name, dt, "\n".join(diff))
    return gm
