"""Parameters with more than one use under tensor parallelism (used by passes/tensor_parallel.py).

Start at `shared_rules`. A parameter read by several nodes of the loss graph (a tied
embedding and lm head, `lm_head.weight = wte.weight`; a module called twice; a weight
some other op also reads) is one placeholder, so it has one shard or none, and every
use must run on that shard. The tp pass visits nodes in graph order, so the check is
made here, over all uses at once, before any node is rewritten: a use earlier in the
graph than the sharded one must not read the full weight while another reads a slice.

parc shards a shared parameter in one case, Megatron's tied embedding: every use is an
embedding lookup of the table or a linear with it as weight, and each rule naming one of
them is `vocab`. One [V/tp, H] shard then serves the vocab-parallel embedding and the
vocab-parallel head (and its cross-entropy); autograd sums both uses' gradients into the
one shard, as the serial model sums them into the one tensor. A use no rule names runs
under the tie's `vocab` rule. Any other rule on a shared parameter is a ParcError at
that rule, naming both uses.

Assumes: `_as_linears` already ran (a Conv1D weight's use is the linear its `t(w)` feeds).
Guarantees: `shared_rules` returns, for each use of a tied vocab weight, the rule it runs
under, and raises for every other shared parameter that a rule would shard.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.fx as fx

from parc.errors import ParcError
from parc.passes.tp_shard import reads_only_meta
from parc.traced import module_path

aten = torch.ops.aten
_TORCH = Path(torch.__file__).resolve().parent
_PARC = tuple(Path(__file__).resolve().parent.parent / d for d in ("parc", "passes", "runtime", "grammar"))


def uses(p: fx.Node, views: dict) -> list[fx.Node]:
    """The nodes that read parameter `p`'s values; a `t(w)` view made for a Conv1D stands for the linear it
    feeds. A read of its dtype or shape only (`x.type_as(w)`) is no use: it is the same on every shard."""
    out = []
    for u in p.users:
        out.extend(u.users if views.get(u) is p else [] if reads_only_meta(u, p) else [u])
    return out


def role(u: fx.Node, p: fx.Node, views: dict) -> str:
    """How `u` reads `p`: "embedding" (the table), "weight" (a linear's), or the op's name."""
    args = [views.get(a, a) if isinstance(a, fx.Node) else a for a in u.args]
    if u.target is aten.embedding.default and args[:1] == [p] and p not in args[1:]:
        return "embedding"
    if u.target is aten.linear.default and args[1:2] == [p] and p not in args[:1] + args[2:]:
        return "weight"
    if u.target is aten.linear.default and args[2:3] == [p] and p not in args[:2]:
        return "bias"
    return getattr(u.target, "__name__", str(u.target))


def shared_rules(params: list[fx.Node], rule_for, views: dict) -> dict[fx.Node, object]:
    """Check every parameter with several uses; return use node → rule for the uses of tied vocab weights."""
    implied: dict[fx.Node, object] = {}
    for p in params:
        us = uses(p, views)
        if len(us) < 2:
            continue
        ruled = [(u, rule_for(u)) for u in us]
        sharding = [(u, r) for u, r in ruled if r is not None and r.style != "replicate"]
        if not sharding:
            continue  # replicated everywhere: every use reads the whole tensor
        roles = {role(u, p, views) for u in us}
        if roles in ({"weight"}, {"bias"}) and len({(r.style if r else None) for _, r in ruled}) == 1:
            continue  # one linear applied again (a recurrent block, a looped layer): each call shards alike
        bad = next(((u, r) for u, r in sharding if r.style != "vocab"), None)
        if bad is None:
            odd = next((u for u, r in ruled if role(u, p, views) not in ("embedding", "weight")
                        or (r is not None and r.style == "replicate")), None)
            if odd is None:
                for u, r in ruled:
                    implied[u] = r or sharding[0][1]
                continue
            _refuse(p, sharding[0], odd, ruled, views)
        _refuse(p, bad, next(u for u in us if u is not bad[0]), ruled, views)
    return implied


def _refuse(p: fx.Node, bad: tuple, other: fx.Node, ruled: list, views: dict) -> None:
    u, rule = bad
    fqn = p.meta.get("parc_fqn", p.name)
    mine, theirs = _describe(u, p, views, rule), _describe(other, p, views, dict(ruled).get(other))
    if module_path(u) == module_path(other):  # one module called twice: its path alone tells the uses apart not
        mine, theirs = f"{mine} at {call_site(u)}", f"{theirs} at {call_site(other)}"
    path = module_path(u) or "<top level>"
    roles = {role(u, p, views), role(other, p, views)}
    if rule.style != "vocab" and roles == {"embedding", "weight"}:
        hint = f"a tied embedding and lm head are sharded as `vocab` (Megatron's tied embedding): mark `{path}` `vocab`"
    elif rule.style == "vocab" and dict(ruled).get(other) is not None:
        hint = f"a tied weight has one shard for all its uses: drop the `replicate` rule of `{module_path(other)}`"
    else:
        hint = f"mark `{path}` `replicate`, or give the modules their own weights"
    raise ParcError(f"`{rule.style}` on `{path}` shards `{fqn}`, which has more than one use: {mine} and {theirs}; "
                    "parc shards a shared weight only as a tied embedding and lm head, both `vocab`",
                    rule.span, hint)


def call_site(u: fx.Node) -> str:
    """Where the user's code made this use: the innermost frame of its stack trace outside torch and parc
    (file:line), or the node's name when the trace has none."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', u.meta.get("stack_trace") or "")
    theirs = [(f, n) for f, n in frames
              if not any(Path(f).resolve().is_relative_to(d) for d in (_TORCH, *_PARC))]
    return f"{Path(theirs[-1][0]).name}:{theirs[-1][1]}" if theirs else f"`{u.name}`"


def _describe(u: fx.Node, p: fx.Node, views: dict, rule) -> str:
    r = role(u, p, views)
    what = {"embedding": "as its embedding table", "weight": "as its linear weight"}.get(r, f"in `{u.name}` ({r})")
    by = f" (rule `{rule.style}`)" if rule is not None else " (no rule)"
    return f"`{module_path(u) or '<top level>'}` reads it {what}{by}"
