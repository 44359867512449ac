"""A memo of pipeline schedules, their simulations and stages' compute prices, for callers that estimate many plans.

`cost.estimate` builds a schedule (name, pp, micro-batches, virtual stages) and simulates it with each
stage's costs. Candidates of a search that differ only in what the pipeline does not see (ZeRO stage,
the probe of the same shape) ask for the same schedules and simulations; one `Schedules` passed to every
`estimate` of the search (`estimate(..., schedules=memo)`) builds each once and simulates it once per set
of costs. Schedules are pure functions of their arguments, so sharing them changes no result.
"""
from __future__ import annotations


def _frozen(v):
    """`v` hashable: per-stage costs arrive as lists, order costs as dicts of lists."""
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    return v


class Schedules:
    """Builds and simulates schedules through `parc.passes.schedule` / `parc.passes.simulate`, each
    distinct call once. Holds every schedule it built, so their ids stay unique as simulation keys."""

    def __init__(self):
        self.built: dict = {}
        self.ran: dict = {}
        # (ids of a stage's statistics and the hardware, dtype, tp, attention) → (the statistics, the hardware,
        # their (forward, backward) seconds from parc.analysis.compute): held with both, so their ids name them
        self.stage_costs: dict = {}

    def build(self, name: str, pp: int, acc: int, virtual: int = 1, **kwargs):
        from parc.passes.schedule import build_schedule

        key = (name, pp, acc, virtual, _frozen(kwargs))
        if key not in self.built:
            self.built[key] = build_schedule(name, pp, acc, virtual, **kwargs)
        return self.built[key]

    def simulate(self, schedule, **kwargs):
        from parc.passes.simulate import simulate

        key = (id(schedule), _frozen(kwargs))
        if key not in self.ran:
            self.ran[key] = (schedule, simulate(schedule, **kwargs))  # holding it keeps its id unique
        return self.ran[key][1]
