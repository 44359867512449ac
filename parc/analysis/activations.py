"""What one micro-batch's forward keeps alive for its backward: the activation half of the cost model.

Start at `kept_bytes`. An op's output costs memory after the forward only if
something keeps it: an op that saves it for backward (a linear saves its input,
a GELU its input, a softmax its own output), a recomputed region's checkpoint
(which holds its inputs), or the pipeline (a stage holds what it sent until the
backward comes back). An output that only flows into a residual add, a
collective or a p=0 dropout is freed as soon as they ran. So, per node:

- follow its uses through views, getitems and p=0 dropouts (aliases, no new
  memory) to the ops that consume the data, and ask each whether it saves it
  (`_saves`: casts, stack, repeat_interleave and export's metadata checks save
  nothing; a product saves an operand only for a gradient that is needed, so
  rotary positions times a constant table keep the table, not the projection);
- count each distinct copy once. Under tensor parallelism the copy a column
  layer saves is the one its input collective made (all-gathered under sequence
  parallelism: the full sequence, except in an eager program, which keeps the
  slice and gathers it again in backward, as Megatron-LM does: `regather`); under
  `precision bf16` the copy a matmul saves is autocast's bf16 cast of an fp32
  input (a layer norm's output);
- add what ops keep besides their inputs: attention's log-sum-exp, layer norm's
  mean and reciprocal std, cross-entropy's log-softmax, a dropout's mask.

Dtypes under bf16 (runtime/precision.py): the trainable parameters are bf16
copies, so whatever computes from them is bf16 (embeddings, matmuls, residual
adds, GELU, attention) except autocast's fp32 ops and what they feed; a value
crossing a pipeline cut travels and waits in bf16. The weight copies themselves
are state (parc/analysis/cost.py), not activations.

Sizes: a value of the tp-sharded core (between a column and a row layer) is
1/tp per rank; a value of the replicated region is 1/tp under sequence
parallelism (a slice of the sequence), else full. `tests/test_report_memory.py`
holds the result to what a run keeps, measured by runtime/memory.py.

Under `recompute`, what a recomputed module's nodes keep for each other is not
kept: it is that module's working set, rebuilt in backward; the largest one per
stage is reported as the recompute peak. Under `compile inductor | aot_eager` with
tp > 1 (`keep_collectives`), a recomputed region keeps the outputs of its forward
collectives instead of running them again (runtime/recompute_policy.py): the
all-gathered input of a column layer under sequence parallelism, and the output of a
row layer's all-reduce (reduce-scatter under sequence parallelism) when the backward
needs it: when an op of the region saves it, or rebuilds from it what the backward
needs (`_rebuilt`). Those copies are kept, not part of the working set.

Another framework's selective (op-level) checkpointing (`saved`, `parc report --recompute-saves`;
`saved_ops` picks the nodes): inside a recomputed region the outputs of some ops are saved in the forward and
every other op runs again in the backward. torchtitan's op policy saves the outputs of `mm` and of the flash
attention, except every second `mm` of a region. A saved output is kept (once, whoever reads it), with what its
op keeps besides (attention's log-sum-exp); the rest of the region is its working set, as under full recompute.
"""

from __future__ import annotations

import functools
import math
import operator

import torch.fx as fx

# matmul-like ops autocast runs in bf16 (runtime/precision.py); their outputs are bf16
LOWERED = ("aten.linear.", "aten.mm.", "aten.addmm.", "aten.bmm.", "aten.matmul.", "aten.baddbmm.",
           "aten.scaled_dot_product_attention.", "aten.conv")
# ops autocast keeps in fp32
FP32 = ("aten.layer_norm.", "aten.softmax.", "aten._softmax.", "aten.log_softmax.", "aten._log_softmax.",
        "aten.cross_entropy_loss.", "aten.nll_loss", "aten.rms_norm.", "parc.vocab_parallel_cross_entropy.")
VIEWS = ("view", "reshape", "expand", "permute", "transpose", "t.default", "slice", "select", "alias",
         "detach", "unsqueeze", "squeeze", "split", "chunk", "unbind", "as_strided", "_unsafe_view", "flatten")
# consumers whose backward needs none of their tensor inputs (a dtype cast's backward casts back; stack's
# unbinds; repeat_interleave's sums the repeats)
NO_SAVE = ("aten.add.", "aten.sub.", "aten.cat.", "aten.stack.", "aten.clone.", "aten._to_copy.", "aten.to.",
           "aten.type_as.", "aten.repeat_interleave.", "aten._assert_tensor_metadata.", "aten.neg.", "aten.sum.",
           "aten.mean.", "aten.embedding.", "aten.cross_entropy_loss.", "parc.identity_allreduce.",
           "parc.allreduce_identity.", "parc.allgather_reducescatter.", "parc.reducescatter_allgather.",
           "parc.split_allgather.", "parc.allgather_split.", "parc.vocab_parallel_cross_entropy.")
SAVES_OUTPUT = ("aten.softmax.", "aten._softmax.", "aten.log_softmax.", "aten._log_softmax.", "aten.relu.",
                "aten.tanh.", "aten.sigmoid.", "aten.exp.", "aten.scaled_dot_product_attention.")
# ops that multiply by a python number save nothing; by a tensor, the other operand
SCALAR_FREE = ("aten.mul.", "aten.div.")


def _name(n: fx.Node) -> str:
    return _target_name(n.target) if n.op == "call_function" else n.op


@functools.lru_cache(maxsize=4096)
def _target_name(target) -> str:
    """str() of an op (`aten.mm.default`), built once per op: the walks over a large graph ask millions of times."""
    return str(target)


def _is(n: fx.Node, names) -> bool:
    return _matches(_name(n), names)


@functools.lru_cache(maxsize=16384)
def _matches(t: str, names: tuple) -> bool:
    """Whether op name `t` is one of `names` (a prefix or a part of it): once per (op, list), as `_target_name`."""
    return any(t.startswith(x) or x in t for x in names)


def _numel(n) -> int:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return math.prod(val.shape) if hasattr(val, "shape") else 0


def is_alias(n: fx.Node) -> bool:
    """A node whose output is its input's memory: a view, a getitem, a p=0 or eval dropout."""
    if n.target is operator.getitem or _is(n, VIEWS):
        return True
    if "aten.dropout." in _name(n):
        p = n.args[1] if len(n.args) > 1 else 0.0
        train = n.args[2] if len(n.args) > 2 else True
        return p == 0 or not train
    return False


def is_cast(n: fx.Node) -> bool:
    """A dtype conversion of one tensor (`x.float()`, `x.to(torch.bfloat16)`): its input's values, another dtype."""
    return _is(n, ("aten.to.", "aten._to_copy.")) and "dtype" in str(n.target) + str(n.kwargs)


def is_copy(n: fx.Node) -> bool:
    """A copy of one tensor, the same values in new memory (`x.contiguous()`, `x.clone()`)."""
    return _is(n, ("aten.contiguous.", "aten.clone."))


def _grad(n) -> bool:
    """Does `n` need a gradient: a trainable parameter, or computed from one (floating point)? Cached on the
    node. A value computed only from the batch and constants (token ids, positions, a rotary table) does not,
    so an op's backward never needs what only its gradient would use."""
    if not isinstance(n, fx.Node):
        return False
    if "parc_grad" not in n.meta:
        # every node of the graph in its (topological) order, each from its inputs' answers: no recursion,
        # which a 126-layer graph (Llama 405B, replicated in full) took past Python's depth limit
        for m in n.graph.nodes:
            if "parc_grad" in m.meta:
                continue
            if m.op == "placeholder":
                m.meta["parc_grad"] = bool(getattr(m.meta.get("val"), "requires_grad", False))
            else:
                m.meta["parc_grad"] = _floating(m) and any(a.meta.get("parc_grad", False)
                                                           for a in m.all_input_nodes)
    return n.meta["parc_grad"]


def _root(a: fx.Node) -> fx.Node:
    """The value whose memory `a` is: through views, getitems and p=0 dropouts."""
    while a.op == "call_function" and is_alias(a) and a.args and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a


def _saves(c: fx.Node, value: fx.Node) -> bool:
    """Does consumer `c` save `value` (one of its inputs) for backward? A product a·b saves b for a's
    gradient and a for b's, each only if that gradient is needed; a quotient a / b saves b for either."""
    if c.op != "call_function":
        return False
    if _is(c, NO_SAVE):
        return False
    if _is(c, SCALAR_FREE):
        others = [a for a in c.args if isinstance(a, fx.Node) and _root(a) is not value]
        if _is(c, ("aten.div.",)) and isinstance(c.args[1] if len(c.args) > 1 else None, fx.Node) \
                and _root(c.args[1]) is value:
            return any(_grad(a) for a in c.all_input_nodes)
        return any(_grad(a) for a in others)
    return True


def _consumers(n: fx.Node) -> list[fx.Node]:
    """The ops that read `n`'s memory: users, looking through aliases."""
    out, todo = [], list(n.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and is_alias(u):
            todo.extend(u.users)
        else:
            out.append(u)
    return out


LOSS = ("aten.cross_entropy_loss.", "parc.vocab_parallel_cross_entropy.")


def _aux(n: fx.Node, fused_loss: bool = False) -> int:
    """Elements an op keeps besides its inputs and output (all fp32). A fused loss kernel (`fused_loss`)
    keeps one log-sum-exp a row of its logits instead of the whole log-softmax."""
    if _is(n, ("aten.scaled_dot_product_attention.",)):
        return _numel(n) // n.args[0].meta["val"].shape[-1]   # log-sum-exp: (B, nh, T)
    if _is(n, ("aten.layer_norm.",)):
        return 2 * _numel(n) // math.prod(n.args[1])          # mean, rstd: one per normalized row
    if _is(n, ("aten.rms_norm.",)):
        return _numel(n) // n.meta["val"].shape[-1]
    if _is(n, LOSS):
        logits = n.args[0]
        return _numel(logits) // logits.meta["val"].shape[-1] if fused_loss else _numel(logits)  # (N,) or (N, V)
    if "aten.dropout." in _name(n) and not is_alias(n):
        return _numel(n)                                       # the mask
    return 0


MATMUL = ("aten.linear.", "aten.mm.", "aten.addmm.")   # a 2-d weight: one `mm` as eager PyTorch dispatches it


def saved_ops(nodes, instance_of, saves) -> frozenset:
    """The nodes of recomputed regions whose outputs another framework's op-level checkpointing saves.

    `saves` names op classes: `matmul` (every matmul by a weight: linear, mm, addmm), `matmul-odd` (the 1st,
    3rd, 5th, ... of them in each region, in forward order: torchtitan's op policy, which recomputes every
    second `mm` of a checkpointed block, its per-block count % 2 == 0), `attention` (the attention kernel's
    outputs). Batched matmuls (bmm) are not `mm` to that policy and are not counted."""
    out, count = set(), {}
    for n in nodes:
        inst = instance_of(n)
        if inst is None or n.op != "call_function":
            continue
        if _is(n, MATMUL):
            count[inst] = count.get(inst, 0) + 1
            if "matmul" in saves or ("matmul-odd" in saves and count[inst] % 2 == 1):
                out.add(n)
        elif "attention" in saves and _is(n, ("aten.scaled_dot_product_attention.",)):
            out.add(n)
    return frozenset(out)


def kept_bytes(gm: fx.GraphModule, *, stage_of, sharded_of, instance_of, tp: int, sequence_parallel: bool,
               bf16: bool, n_stages: int, row_outputs=frozenset(), keep_collectives: bool = False,
               saved=frozenset(), fused_loss: bool = False, regather: bool = False,
               sizes: dict | None = None) -> list[dict]:
    """Per stage: bytes one micro-batch keeps after its forward and the largest recomputed working set.

    Returns [{"kept_*", "peak_*"}] in bytes, * = sharded | replicated; a `sharded` figure is
    for all tp ranks together (a rank holds 1/tp of it). `row_outputs`: the nodes whose value a
    forward collective reduces (a row layer's output); `keep_collectives`: recomputed regions keep
    their collectives' outputs (see the module docstring); `saved`: the region nodes whose outputs are
    saved (`saved_ops`: another framework's op-level checkpointing), kept rather than rebuilt;
    `fused_loss`: the loss is one fused kernel (another framework's: `System.loss`), which keeps its logits
    as they are and a log-sum-exp a row, where eager cross-entropy keeps its fp32 log-softmax; `regather`:
    sequence parallelism's gathered inputs are gathered again in backward, each column layer keeping the
    slice it was gathered from (an eager program: runtime/parallel/sequence_regather.py; Megatron-LM). `sizes`:
    `_dtype_sizes` of the graph at `bf16`, where the caller has them.
    """
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    size = sizes if sizes is not None else _dtype_sizes(gm, nodes, bf16)
    out = [dict.fromkeys(("kept_sharded", "kept_replicated", "peak_sharded", "peak_replicated"), 0)
           for _ in range(n_stages)]
    working: dict[tuple[str, int], list[int]] = {}  # (recompute instance, stage) -> [sharded, replicated]
    keep_collectives = keep_collectives and tp > 1
    sp = tp > 1 and sequence_parallel

    def own_scale(n) -> str:
        return "sharded" if sharded_of.get(n) or sp else "replicated"

    def gathered(n, c) -> bool:  # sequence parallelism all-gathers n before the column layer c
        return sp and bool(sharded_of.get(c)) and not sharded_of.get(n)

    rebuilt = _rebuilt(nodes, instance_of, row_outputs, gathered) if keep_collectives else set()

    for n in nodes:
        if is_alias(n) or not _numel(n):
            continue
        s, inst = stage_of(n), instance_of(n)
        copies: set[tuple] = set()   # (stage, scale, bytes per element, which copy)
        # across a pipeline cut an fp32 value with dims travels in bf16 (runtime/precision.py boundary_specs)
        sent = 2 if bf16 and size[n] == 4 and _floating(n) and n.meta["val"].dim() else size[n]
        if n in saved:   # op-level checkpointing saved it in the forward: kept, whoever reads it
            copies.add((s, own_scale(n), size[n], "saved"))
        if _is(n, SAVES_OUTPUT):
            copies.add((s, own_scale(n), size[n], "own" if inst is None else "saved" if n in saved else "region"))
        for c in _consumers(n):
            if c.op == "output":
                continue
            cs, cinst = stage_of(c), instance_of(c)
            seen = size[n]
            if cs != s:  # the sender holds what it sent, the receiver its buffer, until the backward
                copies.add((s, own_scale(n), sent, "own"))
                copies.add((cs, own_scale(n), sent, "own"))
                seen = sent
            if cinst is not None and cinst != inst:
                copies.add((cs, own_scale(n), seen, "own"))        # a checkpoint holds its inputs
                continue
            if keep_collectives and inst is not None and cinst == inst:  # a collective's kept output
                if n in row_outputs and (c in rebuilt or _saves(c, n)):  # all-reduced (SP: reduce-scattered)
                    copies.add((cs, "sharded" if sp else "replicated", seen, "collective"))
                    continue
                if gathered(n, c) and _saves(c, n):                      # the full sequence
                    copies.add((cs, "replicated", seen, "collective"))
                    continue
            if not (_saves(c, n) or (fused_loss and _is(c, LOSS))):
                continue
            if inst is not None and cinst == inst:
                # rebuilt in backward, unless saved (then the saved copy above is the one read)
                copies.add((cs, own_scale(n), seen, "saved" if n in saved else "region"))
                continue
            core = tp > 1 and sharded_of.get(c) and not sharded_of.get(n)
            if regather and gathered(n, c):  # the slice it is gathered from again in backward
                copies.add((cs, own_scale(n), seen, "own"))
                continue
            scale = "replicated" if core else own_scale(n)         # the gathered copy is the full sequence
            cast = bf16 and _is(c, LOWERED) and seen == 4
            copies.add((cs, scale, 2 if cast else seen, "gathered" if core else "cast" if cast else "own"))
        if n in saved:   # a checkpoint or a saving op outside the region holds the same tensor: one copy
            copies = {(cs, scale, b, "saved" if which == "own" else which) for cs, scale, b, which in copies}
        aux = _aux(n, fused_loss) * 4
        if aux:  # a cross-entropy's log-softmax has its logits' layout (vocab-parallel: 1/tp)
            copies.add((s, own_scale(n.args[0] if _is(n, LOSS) else n), 0, "aux"))
        for cs, scale, b, which in copies:
            nbytes = aux if which == "aux" else _numel(n) * b
            if which == "region" or (inst is not None and which == "aux" and n not in saved):
                w = working.setdefault((inst, cs), [0, 0])
                w[0 if scale == "sharded" else 1] += nbytes
            else:
                out[cs][f"kept_{scale}"] += nbytes
    for (_, s), (sh, rep) in working.items():
        if sh / tp + rep > out[s]["peak_sharded"] / tp + out[s]["peak_replicated"]:
            out[s]["peak_sharded"], out[s]["peak_replicated"] = sh, rep
    return out


def _rebuilt(nodes: list[fx.Node], instance_of, row_outputs, gathered) -> set[fx.Node]:
    """The nodes of recomputed regions that backward runs again when the regions keep their collectives'
    outputs: a node whose output the backward needs (it saves it itself, or keeps something besides its
    inputs, or an op of its region saves it or is run again from it), apart from what a collective reads:
    a row output's consumers read the all-reduced copy, a column layer under sequence parallelism the
    all-gathered one, and both copies are kept."""
    out: set[fx.Node] = set()
    for n in reversed(nodes):
        inst = instance_of(n)
        if inst is None or is_alias(n):
            continue
        if _is(n, SAVES_OUTPUT) or _aux(n):
            out.add(n)
        elif n not in row_outputs and any(
                instance_of(c) == inst and not gathered(n, c) and (c in out or _saves(c, n)) for c in _consumers(n)):
            out.add(n)
    return out


def _floating(n: fx.Node) -> bool:
    return getattr(n.meta.get("val"), "is_floating_point", lambda: False)()


def _dtype_sizes(gm: fx.GraphModule, nodes: list[fx.Node], bf16: bool) -> dict[fx.Node, int]:
    """Bytes per element of each node's output as the runtime computes it: under bf16 the trainable
    parameters are their bf16 copies, and the program runs under autocast."""
    size: dict[fx.Node, int] = {}
    if bf16:
        for p in gm.graph.nodes:
            if p.op == "placeholder" and _floating(p) and getattr(p.meta["val"], "requires_grad", False):
                size[p] = 2

    def of(a) -> int:
        if a in size:
            return size[a]
        val = a.meta.get("val")
        return val.element_size() if hasattr(val, "element_size") else 4

    for n in nodes:
        val = n.meta.get("val")
        native = val.element_size() if hasattr(val, "element_size") else 4
        if not bf16 or not getattr(val, "is_floating_point", lambda: False)():
            size[n] = native
        elif is_cast(n):
            size[n] = native          # an explicit cast (`x.float()`): the dtype it names, autocast or not
        elif _is(n, ("aten.type_as.",)) and len(n.args) > 1:
            size[n] = of(n.args[1])   # the other operand's dtype as the runtime holds it
        elif _is(n, LOWERED):
            size[n] = 2
        elif _is(n, FP32):
            size[n] = 4
        else:  # elementwise: type promotion of its float tensor inputs
            ins = [of(a) for a in n.all_input_nodes if getattr(a.meta.get("val"), "is_floating_point", lambda: False)()]
            size[n] = max(ins) if ins else native
    return size
