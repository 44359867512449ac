"""Tensor-parallel rules for a zoo family, derived with no hand-written table, from one of two sources:

- `hf`: the family's own tensor-parallel plan, `config_class.base_model_tp_plan` (paths under the base model,
  so prefixed with the causal LM's `base_model_prefix`) and the head class's `_tp_plan` (`lm_head`), mapped to
  parc's styles by `STYLES`. A transformers style parc has no counterpart for is dropped (its module stays
  replicated) and listed in `Rules.dropped`. Every rule is written optional (`"glob"? : style`): the family's
  plan names modules a tiny config may not have.
- `graph`: the rules `parc plan` derives from the traced graph (`parc.analysis.planner.tp_rules`).

Start at `derive(family, source, model_file)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.zoo.families import families

# transformers' tp styles → parc's (docs/plan-language.md); None: no parc counterpart, the module stays whole
STYLES = {
    "colwise": "column", "local_colwise": "column", "packed_colwise": "column",
    "rowwise": "row", "local_rowwise": "row", "rowwise_split_input": "row", "packed_rowwise": "row",
    "embedding_rowwise": "vocab",        # the table's rows (the vocabulary) split: parc's vocab embedding
    # a column layer whose output is all-gathered back whole: parc has no such style. Paired in its module with
    # a `rowwise_split_input` (which splits that whole output again: Phi-3, OLMo-2) it is Megatron's column → row,
    # so `column`; on the head `vocab`; alone (Qwen3-Next's linear attention, which concatenates and convolves
    # along those features) the module stays whole (see _style)
    "colwise_gather_output": "column",
    "replicate": "replicate", "replicated_with_grad_allreduce": "replicate",
    "embedding_colwise": None,           # parc shards an embedding only along the vocabulary
    "moe_tp_experts": None, "moe_identity_expert": None, "mla_kv_a_proj": None, "local_params": None,
    "all_reduce": None, "gather": None, "sequence_parallel": None,
}
SOURCES = ("hf", "graph")


@dataclass
class Rules:
    block: str | None                 # a tensor_parallel { … } body (without sequence_parallel), or None
    why_not: str | None = None        # why there are no rules
    dropped: list[str] = field(default_factory=list)  # "glob: style" entries parc has no style for


HEADS = ("lm_head", "embed_out", "output", "decoder")


def _style(path: str, hf_style: str, plan: dict[str, str]) -> str | None:
    style = STYLES.get(hf_style)
    if style == "column" and path.rsplit(".", 1)[-1] in HEADS:
        return "vocab"  # a head as wide as the vocabulary feeds parc's vocab-parallel cross-entropy
    if hf_style == "colwise_gather_output":
        parent = path.rsplit(".", 1)[0]
        paired = any(s in ("rowwise_split_input", "rowwise") and g.rsplit(".", 1)[0] == parent for g, s in plan.items())
        return "column" if paired else None
    return style


def hf_rules(family: str) -> Rules:
    fam = families()[family]
    base = getattr(fam.config_class, "base_model_tp_plan", None) or {}
    if not base:
        return Rules(None, f"`{fam.config_class.__name__}` declares no base_model_tp_plan")
    prefix = fam.model_class.base_model_prefix
    plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
    plan.update(getattr(fam.model_class, "_tp_plan", None) or {})
    lines, dropped = [], []
    for glob, hf_style in plan.items():
        style = _style(glob, hf_style, plan)
        if style is None:
            dropped.append(f"{glob}: {hf_style}")
        else:
            lines.append(f'    "{glob}"? : {style}\n')
    if not any(": column" in x or ": vocab" in x for x in lines):
        return Rules(None, "the family's tp plan has no style parc shards", dropped)
    return Rules("".join(lines), None, dropped)


def graph_rules(model_file: Path) -> Rules:
    from parc.analysis.planner import tp_rules
    from parc.trace import load_user_module, trace

    layout = tp_rules(trace(load_user_module(model_file), 1))
    if layout.why_not:
        return Rules(None, f"parc plan derives no tp rules: {layout.why_not}")
    return Rules("".join(f'    "{r.pattern}" : {r.style}\n' for r in layout.rules))


def derive(family: str, source: str, model_file: Path) -> Rules:
    if source == "hf":
        return hf_rules(family)
    if source == "graph":
        return graph_rules(model_file)
    raise ValueError(f"unknown rule source {source!r}; one of {SOURCES}")


def block(rules: Rules, sequence_parallel: bool = False) -> str:
    return "tensor_parallel {\n" + rules.block + ("    sequence_parallel\n" if sequence_parallel else "") + "}\n"
