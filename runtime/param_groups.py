"""Weight-decay groups: which parameters the plan's `weight_decay` applies to, under any plan.

Start here: `classify(model)` names each parameter's class by model FQN, `decays(classes, cfg)` says
which ones decay under the plan's `no_decay=` (default bias,norm,embedding; `none` decays all), and
`torch_groups` makes the optimizer's param groups from them. The classes (nanoGPT and Megatron skip
the first two; embeddings too by default here, as the issue asks, configurable):

  embedding   the weight of an nn.Embedding (and every parameter tied to it: GPT-2's lm_head)
  bias        a parameter named `bias`
  norm        every other parameter of at most one dim (LayerNorm/RMSNorm scales, gains)

The class is a property of the model's parameter, found on a model built on the meta device (no
weights), so a tp shard, a pipeline stage and a ZeRO range of one parameter get the same decay as
the serial model's parameter: the plan cannot change it.

ZeRO (`RangeGroups`): the optimizer updates one flat fp32 range per bucket, which mixes parameters
of both kinds. The range is cut into runs of consecutive parameters of one kind, and the optimizer
gets the runs (views into the range, their gradients views into the range's gradient) in two
groups. Every update is elementwise, so each element gets exactly the serial update of its
parameter; the optimizer state of the runs is put back together per range for checkpoints.
"""

from __future__ import annotations

import torch

DEFAULT_NO_DECAY = ("bias", "norm", "embedding")


def classify(model: torch.nn.Module) -> dict[str, str | None]:
    """Model FQN → "embedding", "bias", "norm" or None (decayed), for every parameter name, tied aliases
    included; a tensor that is an embedding under any name is one under all."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    out = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if id(p) in embeddings:
            out[fqn] = "embedding"
        elif fqn.rpartition(".")[2] == "bias":
            out[fqn] = "bias"
        elif p.dim() <= 1:
            out[fqn] = "norm"
        else:
            out[fqn] = None
    return out


def classify_user(user) -> dict[str, str | None]:
    """`classify` on the user's model built on meta: no weight memory, the same FQNs as plan.json.
    A build that calls `from_pretrained` builds from the checkpoint's config, as the tracer does
    (parc/pretrained.py): transformers refuses to load weights on meta."""
    from parc.pretrained import pretrained_as_config

    with torch.device("meta"), pretrained_as_config([]):
        return classify(user.build_model())


def decays(classes: dict[str, str | None], cfg: dict) -> dict[str, bool]:
    """Model FQN → whether weight decay applies, under the plan's optimizer settings `cfg`. Without weight
    decay every parameter is one kind: no groups, and ZeRO's ranges stay one tensor each."""
    if not cfg.get("weight_decay"):
        return {fqn: True for fqn in classes}
    skip = set(cfg.get("no_decay", DEFAULT_NO_DECAY)) - {"none"}
    return {fqn: c not in skip for fqn, c in classes.items()}


def torch_groups(named: list[tuple[torch.Tensor, bool]]) -> list[dict]:
    """torch param groups from (tensor, decays): the decayed ones take the optimizer's weight_decay,
    the others 0. Empty groups are left out (torch refuses them)."""
    on = [t for t, d in named if d]
    off = [t for t, d in named if not d]
    return ([{"params": on}] if on else []) + ([{"params": off, "weight_decay": 0.0}] if off else [])


class RangeGroups:
    """This rank's ZeRO ranges (`master`, one per bucket) cut into runs of one decay kind."""

    def __init__(self, master: list[torch.Tensor], buckets: list[dict], rank: int, decay_of: dict[str, bool]):
        self.master = master
        self.runs: list[list[tuple[int, int, bool]]] = []  # per bucket: (start, end, decays), within the range
        for b, bucket in enumerate(buckets):
            lo, n = rank * bucket["shard"], bucket["shard"]
            runs: list[list] = []
            for s in bucket["params"]:
                a, e = max(s["offset"], lo) - lo, min(s["offset"] + s["numel"], lo + n) - lo
                if a >= e:
                    continue
                d = decay_of.get(s["name"], True)
                if runs and runs[-1][2] == d:
                    runs[-1][1] = e
                else:
                    if runs:
                        runs[-1][1] = a  # a gap (alignment padding) joins the run before it
                    runs.append([0 if not runs else a, e, d])
            if runs:
                runs[-1][1] = n  # the bucket's tail padding (zeros, zero gradient) joins the last run
            self.runs.append([tuple(r) for r in runs] or [(0, n, True)])
        self.views = [[m[a:e] for a, e, _ in runs] for m, runs in zip(master, self.runs)]

    def groups(self) -> list[dict]:
        return torch_groups([(v, d) for views, runs in zip(self.views, self.runs) for v, (_, _, d) in zip(views, runs)])

    def bind_grads(self) -> None:
        """Give each run its slice of the range's reduced gradient (call before the optimizer steps)."""
        for m, views, runs in zip(self.master, self.views, self.runs):
            for v, (a, e, _) in zip(views, runs):
                v.grad = None if m.grad is None else m.grad[a:e]

    def clear_grads(self) -> None:
        for views in self.views:
            for v in views:
                v.grad = None

    def state(self, optimizer: torch.optim.Optimizer, b: int) -> dict[str, torch.Tensor]:
        """Bucket b's optimizer state over its whole range (runs concatenated; scalars such as Adam's step,
        equal on every run, taken once)."""
        per = [optimizer.state.get(v, {}) for v in self.views[b]]
        if not per[0]:
            return {}
        return {k: (v.clone() if v.dim() == 0 else torch.cat([p[k] for p in per])) for k, v in per[0].items()}

    def set_state(self, optimizer: torch.optim.Optimizer, b: int, state: dict[str, torch.Tensor]) -> None:
        """Load bucket b's state over its whole range (the inverse of `state`)."""
        for v, (a, e, _) in zip(self.views[b], self.runs[b]):
            optimizer.state[v] = {k: (t.clone() if t.dim() == 0 else t[a:e].clone()) for k, t in state.items()}
