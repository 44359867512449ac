"""What autograd saves for backward, as every part of the runtime that cares about it sees it, composed.

Start at `hooks`. Three parts of the runtime change or watch what autograd saves:

- ZeRO-3 (runtime/parallel/zero.py) replaces a saved view of a gathered weight bucket by a reference that
  gathers the bucket again in backward;
- sequence parallelism (runtime/parallel/sequence_regather.py) replaces a saved copy of a column layer's
  all-gathered input by this rank's slice, all-gathered again in backward, as Megatron does;
- the memory probe (runtime/memory.py) watches every saved tensor, to measure what a forward keeps.

`torch.autograd.graph.saved_tensors_hooks` is a stack of which only the innermost pair runs: two parts that
each installed their own pair would shadow each other (the probe, inside ZeRO-3's, used to keep every
gathered weight alive while it measured). So each part enters `hooks(part)`, which lists it and installs
this module's one pair: a saved tensor is shown to every listed part's `saw` (observers), then offered to
each listed part's `pack`, innermost first; the first that returns something other than the tensor itself
claims it, and its `unpack` makes the tensor again in backward (the claim carries the part, so a backward
that runs after the part's block has ended still finds it); what the claim holds instead (`keeps`, if the
part says) is shown to the observers too. A part has `pack`/`unpack` (and `keeps`), or `saw`, or both.

Regions under `recompute` save through torch.utils.checkpoint's own pair, which is inner to this one: what
they save is rebuilt in backward anyway, and no part here sees it (as before this module).
"""

from __future__ import annotations

import contextlib

import torch

_PARTS: list = []  # the listed parts, outermost first


@contextlib.contextmanager
def hooks(part, active: list | None = None):
    """Within the block, `part` sees (`saw`) and may claim (`pack`/`unpack`) what autograd saves; `active`: a
    list of its module's that holds `part` for the block too (how that module's ops find the running part)."""
    _PARTS.append(part)
    if active is not None:
        active.append(part)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _PARTS.remove(part)
        if active is not None:
            active.remove(part)


def _pack(t: torch.Tensor):
    _show(t)
    for part in reversed(_PARTS):
        pack = getattr(part, "pack", None)
        if pack is not None:
            held = pack(t)
            if held is not t:
                for kept in getattr(part, "keeps", lambda held: ())(held):
                    _show(kept)
                return part, held
    return t


def _show(t: torch.Tensor) -> None:
    for part in _PARTS:
        saw = getattr(part, "saw", None)
        if saw is not None:
            saw(t)


def _unpack(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    part, held = packed
    return part.unpack(held)
