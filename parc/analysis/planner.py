"""`parc plan`: choose a parallel plan for a model on a cluster by searching the plan space with the cost model.

Start at `search(model, gpus=, nodes=, preset=, global_batch=)`. It traces the model ONCE (micro-batch 1,
on meta), then:

1. derives tensor-parallel rules from the traced graph (`tp_rules`): inside each repeated layer, a
   linear whose input comes from outside its parent module is `column`, one whose input is computed
   from another linear of the same parent is `row` (Megatron's pairs: qkv → proj, fc → proj,
   gate/up → down); the token embedding and a head as wide as the vocabulary are `vocab`; norms
   `replicate`. A model whose structure does not fit gets no tp > 1 candidate, with the reason;
2. enumerates dp × tp × pp × schedule (× virtual stages) × micro-batch × ZeRO stage × recompute ×
   sequence parallelism (`_plans`), and for a model with self-attention cp × tp × dp × pp (`_cp_plans`, priced
   by cp_cost as `parc report` prices them); each is a `Plan` built in code, dropped with its reason when
   the mesh, batch or widths do not divide, or when `validate` or `support.check` refuse it (what `parc check` and `parc compile` would say);
3. gives each survivor the per-stage statistics `cost.graph_stats` would (`_Stats`): those are
   computed for one stage and for one stage per layer, and any pp × virtual split is assembled from
   the per-layer ones by `pipeline_split`'s balancing rule, scaled linearly to the micro-batch;
4. asks `cost.estimate` — the same function `parc report` uses, so what the cost model learns, the
   ranking learns — for memory and step time, drops what does not fit, and ranks by step time.
   Deep pipelines are the expensive part (the estimate simulates every slot of the schedule), so
   pipelined candidates are first bounded below by a probe at one micro-batch per step
   (`pipeline_bound`: the bottleneck rank's compute with the pipeline's fill and drain, and the exposed dp
   time, admissible: tests/test_planner_exact.py checks it against every full estimate of small searches),
   and fully estimated in the order of the probe's extrapolated step, skipping those whose bound
   reaches the `top`-th best step found (branch and bound; `_Search.run`): the winner does not
   depend on `top`;
5. runs compile's passes on the winner (`compiler.pass_errors`, as `parc check --model` does) and
   moves on to the next if they refuse it.

Assumes: the model file follows the convention (docs/model-convention.md) and has repeated layers
for pipelining; the cost model's compute time is linear in micro-batches per step (cost.py).
Guarantees: every ranked plan passed validate, support and precision checks; the winner also
compile's passes; `write` never replaces an existing file unless told to.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

# torch._dynamo (and torch with it) imported with this module, not first inside `search`: torch loads dynamo on a
# model's first initializer call, and its modules call torch.fx.wrap as they load, which holds its caller's frame
# in a reference cycle (inspect.currentframe() in a local) and with it every frame below; loaded inside `search`,
# they would keep all of the search's state alive until the cyclic collector found it (for 16,384 GPUs 1.7M
# objects, a 2.5 s collection after the search: `_collector_paused`)
importlib.import_module("torch._dynamo")

from parc.analysis import compute, cost, cp_cost, plan_experts
from parc.analysis.preset_file import is_file
from parc.analysis.schedules import Schedules
from parc.analysis.report import _size
from parc.errors import ParcError
from parc.grammar.plan import (CP_DEFAULT_ORDER, CP_METHODS, Batch, ContextParallel, Mesh, Pipeline, Plan, Recompute,
                               TensorParallel, Topology, TPRule, Zero)

log = logging.getLogger(__name__)
MICROS = (1, 2, 4, 8)            # micro-batch sizes tried (those dividing global / dp)
VIRTUALS = (2, 3, 4)             # virtual stages per pp rank tried with interleaved 1F1B
SCHEDULES = ("1f1b", "gpipe", "zb_h1")
KINDS_SHOWN = 12                 # kinds of reasons printed (--json has every dropped plan)


# ---------------------------------------------------------------- tensor-parallel rules from the graph

LINEAR_OPS = ("aten.linear.", "aten.addmm.", "aten.mm.", "aten.matmul.")
NORM_OPS = ("aten.layer_norm.", "aten.rms_norm.", "aten.native_layer_norm.", "aten.group_norm.")


@dataclass
class TPLayout:
    rules: tuple[TPRule, ...]
    widths: tuple[int, ...]      # every dim tp must divide: heads, kv heads, sharded widths, vocab
    why_not: str | None          # set when the model's structure is not recognised: no tp > 1


def tp_rules(traced) -> TPLayout:
    """Megatron rules for the traced model, from module paths and what each module's weight feeds."""
    from parc.passes.pipeline_split import _layer_prefix
    from parc.traced import module_path

    gm = traced.gm
    fqn = {s.name: s.fqn for s in traced.state}
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    path = {n: module_path(n) for n in nodes}
    kind, op_of, shape = {}, {}, {}
    scales = set()   # modules applying a 1-D weight by hand: a norm written out (LlamaRMSNorm), a layer scale
    for n in nodes:
        p, t = path[n], str(n.target)
        weights = [a for a in _through_views(n) if fqn.get(a.name) == f"{p}.weight"]
        if not weights or p in kind:
            continue
        w = weights[0].meta["val"].shape
        if "aten.embedding." in t:
            kind[p], shape[p] = "embedding", tuple(w)
        elif any(o in t for o in LINEAR_OPS) and len(w) == 2:
            kind[p], op_of[p], shape[p] = "linear", n, tuple(w)
        elif any(o in t for o in NORM_OPS):
            kind[p] = "norm"
        elif len(w) == 1:
            scales.add(p)
    prefix = _layer_prefix(traced.module_paths, traced.num_layers)
    if prefix is None:
        return TPLayout((), (), "no repeated layers (an nn.ModuleList of one block class) to shard")

    def pattern(p: str) -> str | None:  # blocks.3.attn.qkv → blocks.*.attn.qkv
        head, _, rest = p[len(prefix) + 1:].partition(".")
        return f"{prefix}.*.{rest}" if p.startswith(prefix + ".") and head.isdigit() and rest else None

    linear_styles: dict[str, str] = {}

    def linear_style(p: str) -> str:   # memoized: a sibling's linear is asked for its own style
        if p not in linear_styles:
            layer = f"{prefix}.{p[len(prefix) + 1:].partition('.')[0]}"
            linear_styles[p] = _pair_style(op_of[p], p, layer, path, op_of, fqn, scales, linear_style)
        return linear_styles[p]

    styles: dict[str, str] = {}
    widths: set[int] = set()
    for p, k in kind.items():
        pat = pattern(p)
        if pat is None:
            continue
        if k == "norm":
            style = "replicate"
        elif k == "linear":
            style = linear_style(p)
            # (out, in) for nn.Linear; a Conv1D's (in, out) has the same widths to divide
            widths.update(shape[p])
        else:
            return TPLayout((), (), f"an embedding inside the repeated layers ({p}): no Megatron rule for it")
        if styles.setdefault(pat, style) != style:
            return TPLayout((), (), f"{pat} is {styles[pat]} in one layer and {style} in another")
    if "column" not in styles.values() or "row" not in styles.values():
        return TPLayout((), (), f"no column → row linear pair found inside `{prefix}.*` "
                                "(Megatron's qkv → proj, fc → proj)")
    vocab = next((shape[p][0] for p, k in kind.items() if k == "embedding" and pattern(p) is None
                  and any(a.op == "placeholder" and a.name not in fqn for n in nodes if path[n] == p
                          for a in n.all_input_nodes)), None)  # the embedding of a user input: token ids
    outside = {}
    for p, k in kind.items():
        if pattern(p) is None and vocab is not None and (
                (k == "embedding" and shape[p][0] == vocab) or (k == "linear" and vocab in shape[p])):
            outside[p] = "vocab"
    widths.update([vocab] if outside else [])
    for n in nodes:  # attention heads: tp splits whole heads of q and of k/v (B, nh, T, hs)
        if "scaled_dot_product_attention" in str(n.target):
            widths.update(a.meta["val"].shape[1] for a in n.args[:3] if hasattr(a, "meta"))
    rules = [TPRule(pat, style) for pat, style in styles.items()] + [TPRule(p, s) for p, s in outside.items()]
    return TPLayout(tuple(rules), tuple(sorted(widths)), None)


def _through_views(n):
    """The inputs of `n`, looking through transposes and views of a parameter (x @ w.t(), x @ w.T)."""
    out = []
    for a in n.all_input_nodes:
        while a.op == "call_function" and any(v in str(a.target) for v in ("aten.t.", "transpose", "permute", "numpy_T",
                                                                             "aten.mT.", "view", "aten.alias")):
            a = a.all_input_nodes[0]
        out.append(a)
    return out


def _pair_style(node, p: str, layer: str, path: dict, op_of: dict, params: dict, scales: set, style_of) -> str:
    """`row` when the linear's input is computed from another linear's output inside the linear's parent module,
    or from a column linear's inside a sibling module (one under the same grandparent, within the layer) that is not
    a norm: the second of a Megatron pair (GPT-2's `attn.c_attn` → `attn.c_proj`; BERT's `attention.self.query` →
    `attention.output.dense` and `intermediate.dense` → `output.dense`). `column` when it arrives from anywhere
    else: the layer's own ops (its residual adds), a norm (a new sharded region's input), a sibling's row linear
    (whose output is whole), another layer. The walk starts at the activation the linear multiplies:
    `linear(x, w, b)`'s and `mm(x, w)`'s first input, `addmm(b, x, w)`'s (a Conv1D) second. `style_of(path)`: a
    sibling's linear's style."""
    parent = p.rsplit(".", 1)[0]
    grand = parent.rsplit(".", 1)[0]
    siblings = grand != parent and (grand == layer or grand.startswith(layer + "."))   # not above the layer

    def in_sibling(q: str) -> bool:
        return siblings and q.startswith(grand + ".") and not any(q == m or q.startswith(m + ".") for m in scales)

    linears = {v: k for k, v in op_of.items()}
    todo = [a for a, root in zip(node.all_input_nodes, _through_views(node)) if root.name not in params][:1]
    seen = set()
    while todo:
        a = todo.pop()
        if a in seen or getattr(a, "op", None) != "call_function":
            continue
        seen.add(a)
        q = path.get(a, "")
        if not (q == parent or q.startswith(parent + ".") or in_sibling(q)):
            continue
        if a in linears and linears[a] != p:
            inside = q == parent or q.startswith(parent + ".")
            return "row" if inside or style_of(linears[a]) == "column" else "column"
        if not any(o in str(a.target) for o in NORM_OPS):  # a norm starts a new sharded region's input
            todo.extend(a.all_input_nodes)
    return "column"


# ---------------------------------------------------------------- per-stage statistics, assembled

ADDITIVE = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
            "params_sharded", "params_replicated", "tp_bytes", "tp_ops", "kept_bytes_sharded",
            "kept_bytes_replicated", "logits_elements_sharded", "logits_elements_replicated", "param_tensors",
            "zero_units", "tp_bytes_recomputed", "tp_ops_recomputed", "tp_bytes_regathered", "tp_ops_regathered",
            "tp_bytes_regathered_ahead", "tp_ops_regathered_ahead")
PER_SAMPLE = ("flops_sharded", "flops_replicated", "flops_recomputed", "act_sharded", "act_replicated",
              "tp_bytes", "tp_bytes_recomputed", "tp_bytes_regathered", "tp_bytes_regathered_ahead", "kept_bytes_sharded", "kept_bytes_replicated", "recompute_peak_bytes_sharded",
              "recompute_peak_bytes_replicated", "logits_elements_sharded", "logits_elements_replicated")
# The per-operation tables (`ops`, parc/analysis/compute.py) hold shapes: a group's are its units' merged,
# scaled to the micro-batch by growing each row's sample dimension (compute.scale_ops), so matmul
# efficiency is looked up at the micro-batch's shapes, as `parc report` prices them.


class _Stats:
    """`cost.graph_stats` for any candidate from few real calls: one stage, and one stage per layer.

    A variant is (recompute, tp rules, sequence parallel, bf16 step casts). A split into S stages
    groups the per-layer stages (units) as `pipeline_split`'s auto split does (contiguous layers,
    minimising the largest mean of FLOP share and parameter share); additive counts add, peaks take
    the max, the values crossing a group boundary are those crossing that layer boundary. A layer
    boundary inside a group is no cut: what per-layer stats keep for the send and receive buffers there
    is taken off (the same at every boundary of identical layers: (one stage's total − the units'
    sum) / (L − 1)). Counts are of one sample; `get` scales them to the micro-batch.
    """

    def __init__(self, traced, base: Plan, layout: TPLayout, prefix: str | None):
        self.traced, self.base, self.layout, self.prefix = traced, base, layout, prefix
        self.cache: dict = {}
        self.assembled: dict = {}
        self.split: dict = {}
        self.alike: dict = {}      # (units, variant) → each unit's first equal unit (`_alike`)
        self.stage_of: dict = {}   # stages → {node: its stage}: assign_stages' marks, computed once per split

    def _plan(self, variant) -> Plan:
        rec, tp, sp, casts = variant
        return replace(self.base, mesh=Mesh(tp=2 if tp else 1),
                       tensor_parallel=TensorParallel(self.layout.rules if tp else (), sp),
                       recompute=Recompute((f"{self.prefix}.*",) if rec else ()),
                       zero=Zero(0 if casts else 3))

    def _raw(self, stages: int, variant) -> dict:
        key = (stages, variant)
        if key not in self.cache:
            from parc.passes.pipeline_split import STAGE, assign_stages
            nodes = self.traced.gm.graph.nodes
            if stages not in self.stage_of:
                assign_stages(self.traced, replace(self.base, pipeline=None), stages)
                self.stage_of[stages] = {n: n.meta[STAGE] for n in nodes if STAGE in n.meta}
            # the marks of this split, restored each time: the variants alternate between two splits, and
            # compile's passes on a winner (`_pass_refusal`) mark the graph with theirs
            marks = self.stage_of[stages]
            for n in nodes:
                if n in marks:
                    n.meta[STAGE] = marks[n]
            self.cache[key] = cost.graph_stats(self.traced, self._plan(variant))
        return self.cache[key]

    def get(self, stages: int, variant, micro: int) -> dict:
        key = (stages, variant, micro)
        if key not in self.assembled:  # the candidates of one shape differ in ZeRO stage and schedule only
            self.assembled[key] = self._get(stages, variant, micro)
        return self.assembled[key]

    def _get(self, stages: int, variant, micro: int) -> dict:
        L = self.traced.num_layers
        if stages == 1 or stages == L:
            out = self._raw(stages, variant)
            groups = [[s] for s in range(stages)]
            sends = out["send_elements"]
            units, inner = out["stages"], {}
        else:
            whole, per = self._raw(1, variant), self._raw(L, variant)
            units, groups = per["stages"], self._groups(stages, variant)
            inner = {k: (sum(u[k] for u in units) - whole["stages"][0][k]) / (L - 1)
                     for k in ("kept_bytes_sharded", "kept_bytes_replicated")}
            sends = [per["send_elements"][g[-1]] for g in groups[:-1]]
            out = per
        alike = self._alike(variant, units)
        built: dict = {}   # a group's units, each named by its first equal unit → that group's stage
        stages_out = []
        for g in groups:
            same = tuple(alike[u] for u in g)
            if same not in built:
                built[same] = self._group([units[u] for u in g], inner, micro)
            stages_out.append(built[same])
        return {"stages": stages_out, "send_elements": [s * micro for s in sends],
                "param_count": out["param_count"], "tokens_per_sample": out["tokens_per_sample"]}

    @staticmethod
    def _group(units: list[dict], inner: dict, micro: int) -> dict:
        """One stage of `units` (per-layer stages) at `micro` samples; `inner`: what each layer boundary
        inside it keeps for sends and receives that a group does not (its count taken off per boundary)."""
        d = {k: sum(u[k] for u in units) for k in ADDITIVE}
        for k in inner if len(units) > 1 else ():
            d[k] -= (len(units) - 1) * inner[k]
        for k in ("recompute_peak_bytes_sharded", "recompute_peak_bytes_replicated"):
            d[k] = max(u[k] for u in units)
        if all("ops" in u for u in units):
            d["ops"] = compute.scale_ops(compute.merge_ops([u["ops"] for u in units]), micro)
        for k in PER_SAMPLE:
            d[k] *= micro
        return d

    def _alike(self, variant, units: list[dict]) -> list[int]:
        """Each unit's index as its first equal unit's: groups of equal units make equal stages, and `_get`
        gives them one dict, so the cost model's memo of stage costs (by identity) prices each once."""
        key = (len(units), variant)
        if key not in self.alike:
            first: list[int] = []
            out = []
            for u in units:
                i = next((i for i in first if units[i] == u), None)
                if i is None:
                    first.append(i := len(out))
                out.append(i)
            self.alike[key] = out
        return self.alike[key]

    def _groups(self, stages: int, variant) -> list[list[int]]:
        """pipeline_split's auto split over layers: contiguous groups minimising the largest load."""
        if stages in self.split:
            return self.split[stages]
        units = self._raw(self.traced.num_layers, variant)["stages"]
        f = [u["flops_sharded"] + u["flops_replicated"] for u in units]
        p = [u["params_sharded"] + u["params_replicated"] for u in units]
        cf, cp = [0], [0]
        for a, b in zip(f, p):
            cf.append(cf[-1] + a)
            cp.append(cp[-1] + b)
        n, tf, tp = len(units), max(cf[-1], 1), max(cp[-1], 1)

        def load(a, b):
            return 0.5 * (cf[b] - cf[a]) / tf + 0.5 * (cp[b] - cp[a]) / tp
        # best[k][j]: (the smallest largest load of k groups over units [0, j), where group k starts)
        best = [{0: (0.0, 0)}]
        for k in range(1, stages + 1):
            prev, row = best[-1], {}
            for j in range(k, n - (stages - k) + 1):
                row[j] = min((max(prev[i][0], load(i, j)), i) for i in range(k - 1, j) if i in prev)
            best.append(row)
        ends, j = [], n
        for k in range(stages, 0, -1):
            ends.append(j)
            j = best[k][j][1]
        ends.reverse()
        self.split[stages] = [list(range(a, b)) for a, b in zip([0] + ends[:-1], ends)]
        return self.split[stages]


# ---------------------------------------------------------------- candidates

@dataclass
class Candidate:
    plan: Plan
    reason: str | None = None          # why it was dropped; None while it competes
    bound: float = 0.0                 # lower bound on step seconds (pipelines)
    guess: float = 0.0                 # step seconds extrapolated from the probe (pipelines; for ordering)
    probe: object = None               # the probe's cost.Estimate (pipelines): one micro-batch, its bound and memory
    est: object = None                 # cost.Estimate
    peak: float = 0.0                  # bytes on the fullest rank

    @property
    def step(self) -> float:
        return self.est.step_seconds if self.est is not None else math.inf

    def describe(self) -> str:
        p, m = self.plan, self.plan.mesh
        parts = [_mesh(self)]
        if m.cp > 1:
            parts.append(f"cp {p.context_parallel.method}")
        if m.pp > 1:
            v = p.pipeline.virtual
            parts.append(p.pipeline.schedule + (f" v{v}" if v > 1 else ""))
        parts.append(f"micro {p.micro_batch} × acc {p.accumulation}")
        parts.append(f"ZeRO {p.zero.stage}" + (f" shard {p.zero.shard}" if p.zero.shard else "")
                     + (f" offload {p.zero.offload}" if p.zero.offload else ""))
        if p.recompute.patterns:
            parts.append("recompute")
        if p.tensor_parallel.sequence_parallel:
            parts.append("SP")
        return ", ".join(parts)


@dataclass
class Result:
    ranked: list[Candidate]            # feasible, fully estimated, best first
    dropped: list[Candidate]           # with reasons
    considered: int
    seconds: float                     # wall time of the search, tracing included
    cpu_seconds: float                 # its CPU time (on a shared machine, wall time measures the neighbours)
    hw: cost.Hardware
    layout: TPLayout
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # said first: what makes every figure doubtful

    @property
    def winner(self) -> Candidate:
        return self.ranked[0]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_inputs(gpus: int, nodes: int | None, global_batch: int, hw) -> int:
    """Nodes, or a one-line ParcError showing the arithmetic."""
    if gpus < 1:
        raise ParcError(f"--gpus {gpus}: need at least 1")
    if global_batch < 1:
        raise ParcError(f"--global-batch {global_batch}: need at least 1 sample per step")
    if nodes is None:
        per = hw.gpus_per_node
        if gpus > per and gpus % per:
            raise ParcError(f"--gpus {gpus} do not fill whole {hw.name} nodes of {per}: {gpus} = "
                            f"{gpus // per} × {per} + {gpus % per}", hint="give --nodes K with K dividing the GPUs")
        return max(1, gpus // per)
    if nodes < 1:
        raise ParcError(f"--nodes {nodes}: need at least 1")
    if gpus % nodes:
        raise ParcError(f"--gpus {gpus} is not divisible by --nodes {nodes}: {gpus} = {gpus // nodes} × {nodes} + "
                        f"{gpus % nodes}", hint="every node holds the same number of GPUs")
    return nodes


def _plans(traced, layout: TPLayout, gpus: int, topo: Topology, global_batch: int, precision: str,
           dropped: list) -> list[Plan]:
    """Every combination, as a Plan; those whose numbers cannot divide go to `dropped` with the reason."""
    from parc.passes.pipeline_split import _layer_prefix

    L = traced.num_layers
    prefix = _layer_prefix(traced.module_paths, L)
    out = []
    for tp in _divisors(gpus):
        if tp > 1 and layout.why_not:
            dropped.append(Candidate(Plan(mesh=Mesh(tp=tp)), f"tp {tp}: {layout.why_not}"))
            continue
        bad = next((w for w in layout.widths if w % tp), None) if tp > 1 else None
        if bad is not None:
            dropped.append(Candidate(Plan(mesh=Mesh(tp=tp)), f"tp {tp} does not divide width {bad} "
                                                              f"({bad} = {bad // tp} × {tp} + {bad % tp})"))
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if pp > 1 and (prefix is None or pp > L):
                dropped.append(Candidate(Plan(mesh=Mesh(dp, pp, tp)), f"pp {pp} > {L} layers" if prefix else
                                         "pp > 1 needs repeated layers to cut between"))
                continue
            if global_batch % dp:
                dropped.append(Candidate(Plan(mesh=Mesh(dp, pp, tp)), f"global batch {global_batch} is not a "
                                         f"multiple of dp {dp}"))
                continue
            pipes = [None] if pp == 1 else [Pipeline(s) for s in SCHEDULES] + \
                [Pipeline("interleaved_1f1b", virtual=v) for v in VIRTUALS if pp * v <= L]
            for micro in (m for m in MICROS if (global_batch // dp) % m == 0):
                for pipe in pipes:
                    for zero, shard in _zero_choices(Mesh(dp, pp, tp), topo):
                        for rec in (False, True):
                            for sp in ((False, True) if tp > 1 else (False,)):
                                out.append(Plan(
                                    mesh=Mesh(dp, pp, tp), topology=topo, batch=Batch(global_batch, micro),
                                    tensor_parallel=TensorParallel(layout.rules if tp > 1 else (), sp),
                                    pipeline=pipe, zero=Zero(zero, shard),
                                    recompute=Recompute((f"{prefix}.*",) if rec and prefix else ()),
                                    precision=precision))
    return out + _cp_plans(traced, layout, gpus, topo, global_batch, precision, dropped)


CP_SCHEDULES = ("1f1b", "gpipe")   # the pipelines proven with cp (parc/analysis/cp_support.py)


def attention_length(traced) -> int | None:
    """T, the one sequence length every fused attention (scaled_dot_product_attention) of the model runs over
    as self-attention; None without attention, or with attentions over other lengths (cross attention):
    context parallelism splits one sequence (passes/context_parallel.py refuses the rest)."""
    lengths = set()
    for n in traced.gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
            q, k = (a.meta["val"].shape for a in n.args[:2])
            lengths.add(q[-2] if q[-2] == k[-2] else -1)
    return lengths.pop() if len(lengths) == 1 and -1 not in lengths else None


def attention_heads(traced) -> int | None:
    """The fewest query heads of the model's fused attentions (all-to-all attention scatters them over cp)."""
    heads = [n.args[0].meta["val"].shape[-3] for n in traced.gm.graph.nodes
             if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
    return min(heads) if heads else None


def _cp_plans(traced, layout: TPLayout, gpus: int, topo: Topology, global_batch: int, precision: str,
              dropped: list) -> list[Plan]:
    """Context-parallel candidates (`mesh … cp=N`, `context_parallel ring|alltoall`) for a model with
    self-attention over one length T: each cp > 1 dividing the GPUs whose 2·cp chunks divide T (the causal
    load balancing both methods use), over tp × dp × pp with what cp composes with today (cp_support.py,
    tests/test_cp_tp.py): tp with and without sequence parallelism, within a node (tp is the innermost axis,
    `tp,cp,pp,dp`: a tp group across nodes is priced at their NICs and never wins there, `_plans` tries it
    without cp), all-to-all only where the heads a tp rank holds divide over cp; pipelines 1F1B and GPipe,
    ZeRO 0–3 over dp × cp without `shard=`; the cp order of Megatron-Core (`tp,cp,pp,dp`: cp ranks next to
    tp's, on one node while tp × cp ≤ its GPUs)."""
    from parc.passes.pipeline_split import _layer_prefix

    t = attention_length(traced)
    if not t:
        return []
    L = traced.num_layers
    prefix = _layer_prefix(traced.module_paths, L)
    heads = attention_heads(traced)
    tps = [tp for tp in _divisors(topo.gpus_per_node) if tp == 1 or not layout.why_not and
           all(w % tp == 0 for w in layout.widths)]  # `_plans` says why the others cannot be
    out = []
    for cp in _divisors(gpus)[1:]:
        if t % (2 * cp):
            dropped.append(Candidate(Plan(mesh=Mesh(tp=1, cp=cp, order=CP_DEFAULT_ORDER)),
                                     f"cp {cp}: sequence length {t} is not divisible by 2 × cp = {2 * cp} "
                                     f"({t} = {t // (2 * cp)} × {2 * cp} + {t % (2 * cp)})"))
            continue
        for tp in (tp for tp in tps if (gpus // cp) % tp == 0):
            methods = [m for m in CP_METHODS if m != "alltoall" or (heads // tp) % cp == 0]
            if len(methods) < len(CP_METHODS):
                dropped.append(Candidate(Plan(mesh=Mesh(tp=tp, cp=cp, order=CP_DEFAULT_ORDER),
                                              context_parallel=ContextParallel("alltoall")),
                                         f"all-to-all attention scatters heads over cp: {heads} heads / tp {tp} = "
                                         f"{heads // tp} are not divisible by cp {cp}"))
            for pp in _divisors(gpus // (cp * tp)):
                dp = gpus // (cp * tp * pp)
                mesh = Mesh(dp, pp, tp, order=CP_DEFAULT_ORDER, cp=cp)
                if pp > 1 and (prefix is None or pp > L):
                    dropped.append(Candidate(Plan(mesh=mesh), f"pp {pp} > {L} layers" if prefix else
                                             "pp > 1 needs repeated layers to cut between"))
                    continue
                if global_batch % dp:
                    dropped.append(Candidate(Plan(mesh=mesh), f"global batch {global_batch} is not a multiple of "
                                                              f"dp {dp}"))
                    continue
                pipes = [None] if pp == 1 else [Pipeline(s) for s in CP_SCHEDULES]
                micros = [m for m in MICROS if (global_batch // dp) % m == 0]
                for micro, pipe, zero, rec, sp, method in itertools.product(
                        micros, pipes, (0, 1, 2, 3), (False, True), (False, True) if tp > 1 else (False,), methods):
                    out.append(Plan(mesh=mesh, topology=topo, batch=Batch(global_batch, micro), pipeline=pipe,
                                    zero=Zero(zero), precision=precision, context_parallel=ContextParallel(method),
                                    tensor_parallel=TensorParallel(layout.rules if tp > 1 else (), sp),
                                    recompute=Recompute((f"{prefix}.*",) if rec and prefix else ())))
    return out


def _zero_choices(mesh: Mesh, topo: Topology) -> list[tuple[int, int | None]]:
    """(ZeRO stage, shard) pairs to try: stages 0–3 over all of dp, and, when dp's groups leave a node, each
    stage ≥ 1 with HSDP's largest shard K < dp whose groups stay inside one (parc/mesh.py `zero_groups`):
    memory × dp / K for collectives on NVLink and an all-reduce of 1/K of the gradients across nodes."""
    from parc import mesh as meshlib

    out: list[tuple[int, int | None]] = [(z, None) for z in (0, 1, 2, 3)]
    inside = [k for k in meshlib.shard_sizes_in_node(mesh, topo.gpus_per_node) if 1 < k < mesh.dp]
    if inside and mesh.dp not in meshlib.shard_sizes_in_node(mesh, topo.gpus_per_node):
        out += [(z, inside[-1]) for z in (1, 2, 3)]
    return out


def offload_variants(plans: list[Plan]) -> list[Plan]:
    """`zero … offload=cpu` for each ZeRO plan (those offload is not proven with, parc/analysis/support.py
    `_offload`, are refused with the reason); the search tries them only when no plan fits without, as
    DeepSpeed's users reach for ZeRO-Offload: it frees the optimizer state's device memory (and under bf16
    the fp32 masters') at the price of two PCIe copies and a host step a step."""
    return [replace(p, zero=replace(p.zero, offload="cpu")) for p in plans if p.zero.stage >= 1]


def _refusal(plan: Plan, traced) -> str | None:
    """What parc check / compile would refuse in `plan`, as one line; None if nothing."""
    from parc.analysis.review import review
    from parc.compiler import plan_refusals

    refused = plan_refusals(plan, traced.num_layers)   # compile's own checks on the plan alone
    if refused:
        return refused[0].message
    try:
        errors = [d for d in review(plan, world_size=plan.mesh.world_size) if d.severity == "error"]
    except ParcError as e:
        return e.diagnostics[0].message
    return errors[0].message if errors else None


# ---------------------------------------------------------------- the search

class _Search:
    def __init__(self, traced, stats: _Stats, hw, top: int, moe: dict | None = None):
        self.traced, self.stats, self.hw, self.top = traced, stats, hw, top
        self.moe = moe  # the model's experts (plan_experts.find), for ep candidates
        self.groups: dict = {}
        self.schedules = Schedules()  # each schedule built once, simulated once per set of costs
        self.local: dict = {}         # (id of statistics, cp) → (them, one cp rank's share): cp_cost.local_stats

    def _groups(self, mesh: Mesh) -> dict:
        from parc import mesh as meshlib
        key = (mesh.dp, mesh.pp, mesh.tp, mesh.cp, mesh.order)
        if key not in self.groups:  # the same for every candidate of one mesh shape
            every = cp_cost.groups_of(mesh, lazily=True) if mesh.cp > 1 else \
                {a: meshlib.iter_groups(mesh, a) for a in ("dp", "pp", "tp")}
            self.groups[key] = {a: self._distinct(g) for a, g in every.items()}
        return self.groups[key]

    def _distinct(self, groups) -> list[list[int]]:
        """One group of each placement: groups whose ranks sit alike on their nodes (the same slots, the same
        node offsets from the first) cost the same, so the cost model need not walk all world / n of them.
        Assumes the groups are translates of one another, as an axis's (and dp × cp's) are. `groups`: any
        iterable of them, read only until every slot of a node has started one."""
        per, seen = self.hw.gpus_per_node, {}
        for g in groups:
            # the groups of an axis are translates of one another (parc/mesh.py `groups`): one whose first rank
            # has the same slot on its node as a group seen sits alike (its key would be the same)
            if g[0] % per not in seen:
                seen[g[0] % per] = g
                if len(seen) == per:   # no other slot is left to start a group
                    break
        keys = {}
        for g in seen.values():
            keys.setdefault(tuple((r // per - g[0] // per, r % per) for r in g), list(g))
        return list(keys.values())

    def estimate(self, plan: Plan, limit: float | None = None):
        """`cost.estimate`'s (or `cp_cost.estimate`'s) of `plan`, as `parc report` prices it. `limit`: the bytes a
        rank has; a plan needing more comes back untimed (its memory only, step infinite: `_fits` drops it)."""
        m = plan.mesh
        virtual = plan.pipeline.virtual if plan.pipeline is not None and m.pp > 1 else 1
        variant = (bool(plan.recompute.patterns), m.tp > 1, plan.tensor_parallel.sequence_parallel,
                   plan.zero.stage < 3)
        stats = self.stats.get(m.pp * virtual, variant, plan.micro_batch)
        if m.cp > 1:  # as `parc report` prices cp: dp × cp ranks on 1/cp of the tokens, plus the ring or all-to-alls
            key = (id(stats), m.cp)   # one cp rank's statistics, kept with the serial ones they come from
            held = self.local.get(key)
            if held is None or held[0] is not stats:
                held = self.local[key] = (stats, cp_cost.local_stats(stats, m.cp))
            est = cp_cost.estimate(plan, stats, self.hw, params_per_rank=plan_experts.params_per_rank(plan, self.moe),
                                   groups=self._groups(m), local=held[1], schedules=self.schedules,
                                   memory_limit=limit)
        else:
            est = cost.estimate(plan, stats, self.hw, groups=self._groups(m), schedules=self.schedules,
                                params_per_rank=plan_experts.params_per_rank(plan, self.moe), memory_limit=limit)
        return est if math.isinf(est.step_seconds) else plan_experts.price(est, plan, self.moe, self.hw)

    def _fits(self, c: Candidate, est) -> bool:
        c.peak = max(r["total"] for r in est.memory)
        if c.peak > self.hw.memory:
            worst = max(est.memory, key=lambda r: r["total"])
            c.reason = (f"does not fit: pp rank {worst['pp_rank']} needs {c.peak / cost.GiB:.1f} GiB > "
                        f"{self.hw.memory / cost.GiB:.1f} GiB (params {worst['params'] / cost.GiB:.1f}, grads "
                        f"{worst['grads'] / cost.GiB:.1f}, optimizer {worst['optimizer'] / cost.GiB:.1f}, "
                        f"activations {worst['activations'] / cost.GiB:.1f})")
            return False
        return True

    def _probe(self, c: Candidate):
        """A lower bound on `c`'s compute and memory, cheap to simulate: one micro-batch per step, one stage
        per pp rank. Interleaved candidates are probed as 1F1B over pp × virtual ranks holding one of their
        stages each (interleaving needs a multiple of pp micro-batches, pp² × virtual slots to simulate):
        the same per-stage costs, of one stage, not of the `virtual` a rank holds, so no more than theirs."""
        p = c.plan
        v = p.pipeline.virtual
        probe = replace(p, batch=Batch(p.micro_batch * p.mesh.dp, p.micro_batch), pipeline=Pipeline("1f1b"),
                        mesh=replace(p.mesh, pp=p.mesh.pp * v))
        return self.estimate(probe)

    def run(self, cands: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
        """Estimate pp = 1 candidates outright. Probe each pipeline shape once; estimate pipelined candidates
        in the order of the probe's extrapolated step, skipping those whose lower bound (`pipeline_bound`,
        admissible: never above the full estimate) already reaches the `top`-th best step found. Every
        candidate that could rank among the `top` best is estimated in full, so the best does not depend on
        `top`: it only decides how many plans the bound must beat. (ranked, pruned): `resume` takes the
        pruned back should the ranked lose their winner."""
        done, pending, probes = [], [], {}
        for c in cands:
            p = c.plan
            if p.mesh.pp == 1:
                c.est = self.estimate(p, limit=self.hw.memory)
                if self._fits(c, c.est):
                    done.append(c)
                continue
            # compute is the same for every schedule of one pipeline shape and ZeRO layout: probed once (the
            # ZeRO stage changes the exposed dp time the bound counts, and under ZeRO-3 the weight casts)
            key = (p.mesh, p.micro_batch, p.recompute, p.tensor_parallel.sequence_parallel, p.pipeline.virtual,
                   p.zero)
            if key not in probes:
                probes[key] = self._probe(c)
            c.probe = probe = probes[key]
            c.bound = pipeline_bound(probe, p)
            # 1F1B's step is the probe's (fill, drain, dp) plus a compute per further micro-batch (a ranking)
            c.guess = probe.step_seconds + probe.compute_seconds * (p.accumulation - 1)
            pending.append(c)
        done.sort(key=lambda c: c.step)
        log.info("%d pp=1 estimated, %d pipeline shapes probed, %.1f s CPU", len(cands) - len(pending), len(probes),
                 time.process_time())
        return done, self.resume(done, sorted(pending, key=lambda c: c.guess))

    def resume(self, done: list[Candidate], pending: list[Candidate]) -> list[Candidate]:
        """Estimate each of `pending` (ordered) whose bound is below the `top`-th best step of `done`, adding
        those that fit to `done`; return those bounded out (each with its reason)."""
        pruned = []
        for c in pending:
            c.reason = None
            kth = done[self.top - 1].step if len(done) >= self.top else math.inf
            if c.bound >= kth:
                c.reason = (f"bounded out: its step is at least {c.bound:.3g} s (compute, fill and drain) ≥ the "
                            f"{self.top}th best, {kth:.3g} s")
                pruned.append(c)
                continue
            if not self._fits(c, c.probe):  # fewer micro-batches in flight than at full size
                continue
            c.est = self.estimate(c.plan, limit=self.hw.memory)
            log.debug("estimated %s: %.3g s, %.1f s CPU", c.describe(), c.step, time.process_time())
            if self._fits(c, c.est):
                done.append(c)
                done.sort(key=lambda c: c.step)
        return pruned


def pipeline_bound(probe, plan: Plan) -> float:
    """A lower bound on `plan`'s step from its probe (one micro-batch, the same stages): the simulated
    makespan is at least, for any pp rank r, the forwards of the stages before r (its first micro-batch
    arrives through them), then all of r's own work (acc × (F + B) of each stage it holds, one action at a
    time), then under 1F1B, GPipe and interleaved 1F1B the backwards of the stages before r (r's last action
    is a backward of its first stage: every action of a micro-batch on r comes before that micro-batch's
    backward there, which then crosses the stages before r; ZB-H1 may run weight gradients after it: not
    counted). The optimizer step follows it (the probe's, at one micro-batch: no more than at acc). P2P only
    adds. An interleaved probe has one stage per virtual stage, pp × virtual of them: rank r holds stages
    r, r + pp, ….

    The dp communication the step exposes after the makespan (`cost.estimate`'s `dp_exposed`) is added too,
    the probe's: it prices the same mesh, groups, parameters per rank and one micro-batch's backward as its
    window, so plain dp's exposed all-reduce and ZeRO-1's collectives come out equal to the full plan's, and
    ZeRO-2's per-micro-batch reduce-scatter is one of the plan's `acc` (`cost.zero_exposed`). Not where the
    probe differs from the plan (interleaved: one stage a rank) or a call's price depends on the compute
    between calls (a calibrated CPU's measured `collectives`)."""
    acc, pp, virtual = plan.accumulation, plan.mesh.pp, plan.pipeline.virtual
    fb = probe.stage_seconds
    if len(fb) != pp * virtual:
        return probe.compute_seconds * acc + probe.optimizer_seconds
    drain = plan.pipeline.schedule in ("1f1b", "gpipe", "interleaved_1f1b")
    best, before_f, before_b = 0.0, 0.0, 0.0
    for r in range(pp):
        own = sum(f + b for f, b in fb[r::pp])
        best = max(best, before_f + acc * own + (before_b if drain else 0.0))
        before_f, before_b = before_f + fb[r][0], before_b + fb[r][1]
    dp = probe.dp_exposed_seconds if virtual == 1 and not probe.hw.collectives else 0.0
    return best + probe.optimizer_seconds + dp


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while the search runs, as it was after. The search holds millions
    of long-lived objects (the trace's graph, schedules' actions, memoized statistics and timings) and frees what
    it drops by reference counting; each of the collector's full passes walks all of them and finds next to
    nothing. Measured on the 16,384-GPU search of docs/planner.md: 20 full passes, 12–13 s of its 52 s; paused,
    the same search in 44 s at the same peak memory."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@_collector_paused()
def search(model: Path, *, gpus: int, nodes: int | None = None, preset: str | None = "h100", global_batch: int,
           top: int = 5, precision: str = "bf16") -> Result:
    """Every candidate plan for `model` on `gpus`, ranked by the cost model's step time. `preset` None: an
    H100, said loudly in the result's warnings (`parc plan` without --preset)."""
    from parc.analysis.preset_file import implausible
    from parc.analysis.report import assumed_hardware

    from parc.passes.pipeline_split import _layer_prefix
    from parc.trace import load_user_module, trace

    t0, c0 = time.perf_counter(), time.process_time()
    if top < 1:
        raise ParcError(f"--top {top}: need at least 1 plan to print")
    hw = cost.hardware(preset)
    warnings = assumed_hardware(preset, hw) + implausible(hw)
    if preset is None and warnings:
        warnings[0] += f"; the plans are {precision} (--precision)"
    nodes = _check_inputs(gpus, nodes, global_batch, hw)
    topo = Topology(nodes=nodes, gpus_per_node=gpus // nodes, preset=preset)
    hw = cost.hardware(preset, topo)
    if not Path(model).is_file():
        raise ParcError(f"model {model}: no such file")
    traced = trace(load_user_module(model), 1)
    log.info("traced in %.1f s CPU", time.process_time() - c0)
    layout = tp_rules(traced)
    prefix = _layer_prefix(traced.module_paths, traced.num_layers)
    dropped: list[Candidate] = []
    plans = _plans(traced, layout, gpus, topo, global_batch, precision, dropped)
    moe = plan_experts.find(traced, prefix)
    plans += plan_experts.variants(plans, moe)
    early = len(dropped)  # mesh shapes refused before their plans were built
    log.info("%d plans built, %.1f s CPU", len(plans), time.process_time() - c0)
    cands = []
    for plan in plans:
        c = Candidate(plan, _refusal(plan, traced))
        (dropped if c.reason else cands).append(c)
    if not cands:
        why = sorted({c.reason for c in dropped})
        raise ParcError(f"no plan for {gpus} GPUs and global batch {global_batch}: every candidate was refused "
                        f"({len(dropped)}), e.g. {why[0]}" if why else f"no plan for {gpus} GPUs",
                        hint="a global batch that is a multiple of the GPUs always has a data-parallel plan")
    log.info("%d plans refused by parc's checks, %.1f s CPU", len(dropped) - early, time.process_time() - c0)
    stats = _Stats(traced, Plan(batch=Batch(1, 1), precision=precision), layout, prefix)
    finder = _Search(traced, stats, hw, top, moe=moe)
    ranked, pruned = finder.run(cands)
    refused, considered, notes = [], list(cands), []
    if not ranked:  # nothing fits on the device: ZeRO-Offload trades PCIe copies and a host step for its memory
        offloaded = [Candidate(p, _refusal(p, traced)) for p in offload_variants(plans)]
        dropped += [c for c in cands if c.reason] + [c for c in offloaded if c.reason]
        considered = [c for c in offloaded if not c.reason]
        finder = _Search(traced, stats, hw, top, moe=moe)
        ranked, pruned = finder.run(considered)
        notes.append(f"no plan fits on the device: {len(offloaded)} ZeRO-Offload variants (zero … offload=cpu) "
                     f"considered, {len(ranked)} fit")
    pass_refusals: dict = {}
    while ranked:  # compile's passes on the winner, as `parc check --model` runs them
        reason = _pass_refusal(traced, ranked[0].plan, pass_refusals)
        if reason is None:
            break
        ranked[0].reason = f"compile's passes refuse it: {reason}"
        refused.append(ranked.pop(0))
        pruned = finder.resume(ranked, pruned)   # the bound beat the refused plan: it may not beat the next
    by_passes = {id(c) for c in refused}   # identity: a Candidate's == compares whole plans and estimates
    dropped += [c for c in considered if c.reason and id(c) not in by_passes] + refused
    if layout.why_not:
        notes.append(f"no tensor parallelism: {layout.why_not}")
    if ranked and ranked[0].est.mfu > 1:
        from parc.analysis.report import mfu_warning
        warnings.append(mfu_warning(ranked[0].est))
    return Result(ranked, dropped, len(plans) + early, time.perf_counter() - t0, time.process_time() - c0, hw,
                  layout, notes, warnings)


def _pass_refusal(traced, plan: Plan, refusals: dict | None = None) -> str | None:
    """The first error compile's passes give `plan`, or None. `refusals`: the whole-graph passes' refusals so
    far (compiler.pass_errors' memo): a model tensor parallelism cannot shard refuses every plan with the same
    tensor-parallel layout the same way, and each run of the passes on a large model takes most of a second."""
    from parc import compiler
    from parc.passes.pipeline_split import assign_stages

    refusals = {} if refusals is None else refusals
    known = refusals.get(compiler.whole_pass_key(plan))
    if known is not None:
        errors = known
    else:
        virtual = plan.pipeline.virtual if plan.pipeline is not None and plan.mesh.pp > 1 else 1
        try:
            assign_stages(traced, plan, plan.mesh.pp * virtual)
            errors = compiler.pass_errors(traced, plan, refusals)
        except ParcError as e:
            errors = e.diagnostics
    errors = [d for d in errors if d.severity == "error"]
    return errors[0].message if errors else None


# ---------------------------------------------------------------- why each loses, and the written plan

def why_loses(c: Candidate, w: Candidate) -> str:
    """The biggest differences of `c` from the winner `w`, each with its figures."""
    a, b = c.est, w.est
    out = [f"{c.step / w.step - 1:+.1%} step time"]
    for name, x, y in (("bubble", a.bubble, b.bubble),
                       ("communication share", a.comm_seconds / a.step_seconds, b.comm_seconds / b.step_seconds),
                       ("MFU", a.mfu, b.mfu)):
        if abs(x - y) >= 0.005:
            out.append(f"{name} {x:.1%} vs {y:.1%}")
    if abs(c.peak - w.peak) >= 0.05 * w.peak:
        out.append(f"memory {_size(c.peak)} vs {_size(w.peak)}")
    return "; ".join(out)


def plan_text(result: Result, command: str, out: Path | None = None) -> str:
    """The winner as a .par, headed by how it was found and what it is predicted to do. A preset file is
    named relative to `out`'s directory, where the written plan reads it from (preset_file.resolve)."""
    from parc.grammar.printer import format_plan

    w = result.winner
    e = w.est
    plan = w.plan
    if out is not None and plan.topology.preset is not None and is_file(plan.topology.preset):
        rel = os.path.relpath(Path(plan.topology.preset).resolve(), Path(out).resolve().parent)
        plan = replace(plan, topology=replace(plan.topology, preset=Path(rel).as_posix()))
    head = (f"# written by: {command}\n"
            f"# predicted on {result.hw.name}: {e.step_seconds:.4g} s per step, MFU {e.mfu:.1%}, "
            f"bubble {e.bubble:.1%}, {_size(w.peak)} on the fullest rank\n")
    return head + format_plan(plan)


def write(result: Result, out: Path, command: str, force: bool = False) -> None:
    """Write the winner to `out`; refuse to replace an existing file unless `force`. The text is parsed as
    `out` before it is written (a preset file found from there), so a plan that would not read back is
    refused, located, without leaving a file."""
    from parc.analysis.review import preset_error
    from parc.errors import PlanError
    from parc.grammar.parser import parse

    out = Path(out)
    if out.exists() and not force:
        raise ParcError(f"{out} exists: parc plan does not overwrite a file unless told to",
                        hint=f"pass --force to replace it, or choose another -o than {out}")
    text = plan_text(result, command, out)
    plan = parse(text, file=str(out))
    if (bad := preset_error(plan)) is not None:
        raise PlanError(diagnostics=[bad])
    out.write_text(text, encoding="utf-8")


def _kinds(dropped: list[Candidate]) -> list[tuple[str, int, Candidate]]:
    """Reasons grouped by kind (their first clause, numbers aside), most common first, one example each."""
    import re

    kinds: dict[str, list[Candidate]] = {}
    for c in dropped:
        kinds.setdefault(re.sub(r"[0-9.]+", "N", c.reason.split(":")[0]), []).append(c)
    return sorted(((k, len(v), v[0]) for k, v in kinds.items()), key=lambda t: -t[1])


def _row(i: int, c: Candidate, w: Candidate) -> dict:
    e = c.est
    return {"rank": i, "plan": c.describe(), "step_seconds": e.step_seconds, "mfu": e.mfu, "bubble": e.bubble,
            "communication_share": e.comm_seconds / e.step_seconds if e.step_seconds else 0.0,
            "peak_memory_bytes": round(c.peak), "why_it_loses": why_loses(c, w) if i > 1 else None}


def summary(result: Result, top: int) -> list[str]:
    hw, w = result.hw, result.ranked[0] if result.ranked else None
    n_drop = len(result.dropped)
    lines = [f"warning: {w}" for w in result.warnings]
    lines += [f"searched {result.considered} candidate plans in {result.seconds:.1f} s ({result.cpu_seconds:.1f} s "
             f"CPU, tracing included) for {hw.name} × "
             f"{hw.gpus_per_node} per node: {len(result.ranked)} fit and were ranked, {n_drop} dropped"]
    kinds = _kinds(result.dropped)
    for k, n, c in kinds[:KINDS_SHOWN]:
        lines.append(f"  dropped {n:6d}: {c.reason}  (e.g. {c.describe() if c.plan.batch else 'mesh ' + _mesh(c)})")
    if len(kinds) > KINDS_SHOWN:
        lines.append(f"  dropped {sum(n for _, n, _ in kinds[KINDS_SHOWN:]):6d}: {len(kinds) - KINDS_SHOWN} other "
                     "reasons (--json lists every dropped plan with its reason)")
    if result.layout.rules:
        lines.append("tensor_parallel rules derived from the model: " +
                     ", ".join(f"{r.pattern} {r.style}" for r in result.layout.rules))
    lines += [f"note: {n}" for n in result.notes]
    if w is None:
        lines.append("no candidate fits: see the reasons above")
        return lines
    lines.append(f"{'#':>2}  {'plan':60s} {'step s':>9} {'MFU':>6} {'bubble':>7} {'comm':>6} {'memory':>10}  "
                 "why it loses")
    for i, c in enumerate(result.ranked[:top], 1):
        r = _row(i, c, w)
        lines.append(f"{i:>2}  {r['plan']:60s} {r['step_seconds']:9.4g} {r['mfu']:6.1%} {r['bubble']:7.1%} "
                     f"{r['communication_share']:6.1%} {_size(c.peak):>10}  {r['why_it_loses'] or 'the winner'}")
    return lines


def _mesh(c: Candidate) -> str:
    m = c.plan.mesh
    return f"dp {m.dp} × tp {m.tp} × pp {m.pp}" + (f" × cp {m.cp}" if m.cp > 1 else "") + \
        (f" (ep {m.ep})" if m.ep > 1 else "")


def to_json(result: Result, top: int) -> str:
    import json

    w = result.ranked[0] if result.ranked else None
    return json.dumps({
        "seconds": result.seconds, "cpu_seconds": result.cpu_seconds, "considered": result.considered,
        "hardware": result.hw.name,
        "tp_rules": [{"pattern": r.pattern, "style": r.style} for r in result.layout.rules],
        "notes": result.notes,
        "warnings": result.warnings,
        "ranked": [_row(i, c, w) for i, c in enumerate(result.ranked[:top], 1)],
        "winner_plan": plan_text(result, "parc plan").split("\n", 2)[2] if w else None,
        "dropped": [{"plan": c.describe() if c.plan.batch else _mesh(c), "reason": c.reason}
                    for c in result.dropped],
    }, indent=2, ensure_ascii=False)
