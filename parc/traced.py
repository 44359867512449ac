"""What tracing produces, and how to read it: the `Traced` loss graph and module paths.

Start here when a pass or the runtime needs to know where a graph node came from
(`module_path`) or which tensor of the user's model a state placeholder stands for
(`StateInput`, `get`, `state_values`). parc/trace.py makes a `Traced` with
torch.export; parc/replicate.py makes one by copying blocks. Both build on this
module, and nothing here imports either of them (nor torch.export's tracer), so the
passes and the runtime can read graphs without pulling in tracing.

Assumes graphs come from torch.export (nodes carry `nn_module_stack`) or from
parc.replicate (which keeps those stacks consistent). Guarantees: `module_path`
returns the user's own FQNs, never a wrapper's.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.export import ExportedProgram

WRAPPER_ATTR = "model"  # the wrapper's attribute holding the user's model; stripped from FQNs


@dataclass(frozen=True)
class StateInput:
    """One state placeholder of the graph: its name there and its FQN in the user's model."""

    name: str
    fqn: str
    kind: str  # "param" | "buffer" | "constant"
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32"
    requires_grad: bool


@dataclass(frozen=True)
class UserInputSpec:
    name: str
    shape: tuple[int, ...]  # dim 0 is the micro-batch
    dtype: str


@dataclass
class Traced:
    """The loss graph. `gm`'s placeholders are `state` then `inputs`, in order; it returns `(loss,)`."""

    gm: torch.fx.GraphModule
    state: list[StateInput]
    inputs: list[UserInputSpec]
    module_paths: list[str]
    num_layers: int
    param_count: int
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn → CPU value of lifted constants
    program: ExportedProgram | None = None  # None when replicated from a 2-block export (parc.replicate)


def state_values(traced: Traced, model: torch.nn.Module) -> list[torch.Tensor]:
    """The real tensors for `traced.state`, in placeholder order, from a model built for real."""
    return [traced.constants[s.fqn] if s.fqn in traced.constants else get(model, s.fqn) for s in traced.state]


def unread_params(traced: Traced) -> list[str]:
    """FQNs of the trainable parameters the loss does not depend on in the traced graph: a submodule the forward
    never calls, a projection whose output it drops, a branch not taken at the traced shapes (deepseek_v4's
    attention compressor below its window). The serial model's gradient of each is None, so its optimizer
    leaves it as it is; the parallel run holds and saves them like any parameter, and steps them with a zero
    gradient and no weight decay (runtime/train.py), which leaves them as they are too."""
    out_node = next(n for n in reversed(traced.gm.graph.nodes) if n.op == "output")
    names = {n.name for n in ancestors(out_node) if n.op == "placeholder"}
    return sorted(s.fqn for s in traced.state if s.kind == "param" and s.requires_grad and s.name not in names)


def ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """`node` and every node it reads, directly or through others."""
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += n.all_input_nodes
    return out


def get(model: torch.nn.Module, fqn: str):
    """The attribute at a dotted FQN (a parameter, buffer or plain tensor attribute). A part below a list or
    tuple is an index, below a dict a key: `tables.0` is `model.tables[0]` (parc/trace_constants.py)."""
    obj = model
    for part in fqn.split("."):
        if isinstance(obj, (list, tuple)):
            obj = obj[int(part)]
        elif isinstance(obj, dict):
            obj = obj[part]
        else:
            obj = getattr(obj, part)
    return obj


# --- module paths ----------------------------------------------------------------

_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")  # blocks[0] / L['self'] → .0 / .self


def module_path(node: torch.fx.Node) -> str:
    """The dotted FQN of the innermost module `node` ran in, e.g. `blocks.0.attn.qkv`; '' for the root.

    torch 2.13's non-strict export stores `nn_module_stack` as {key: (path, type)},
    outermost first, e.g. `{'L__self__': ('', W), 'L__self__model.blocks.0.attn.qkv':
    ('model.blocks.0.attn.qkv', Linear), ...}`. Strict export and older versions write
    paths like `L['self'].model.blocks[0]`; both normalize to the user's FQN.
    State placeholders have no stack: their path is their FQN's owner.
    """
    fqn = node.meta.get("parc_fqn")
    if fqn is not None:
        return fqn.rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return normalize_path(path)


@functools.lru_cache(maxsize=65536)
def normalize_path(path: str) -> str:
    """`L['self'].model.blocks[0].attn` or `model.blocks.0.attn` → `blocks.0.attn`. Memoized: the cost model
    asks for every node's path in each of its graph walks (a planner's dozens over a 126-layer graph)."""
    path = _INDEX.sub(r".\1", path.split("@")[0])
    parts = [p for p in path.split(".") if p]
    if parts[:1] in (["L"], ["self"]):
        parts = parts[2:] if parts[:2] == ["L", "self"] else parts[1:]
    return ".".join(parts[1:] if parts[:1] == [WRAPPER_ATTR] else parts)


def num_layers(model: torch.nn.Module) -> int:
    """Length of the longest ModuleList/Sequential of same-class blocks; 0 when there is none."""
    return repeated_blocks(model)[1]


def repeated_blocks(model: torch.nn.Module) -> tuple[str, int]:
    """(path, length) of the longest ModuleList/Sequential whose children share one class."""
    best = ("", 0)
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)) and len(mod) > best[1]:
            if len({type(child) for child in mod}) == 1:
                best = (name, len(mod))
    return best


# --- what the integer inputs index ------------------------------------------------

_PASS_THROUGH = {"reshape", "view", "_unsafe_view", "flatten", "clone", "contiguous", "slice", "select",
                 "unsqueeze", "squeeze", "_to_copy", "to", "alias", "detach", "expand", "t", "transpose"}


def index_bounds(traced: Traced) -> dict[str, tuple[int, str]]:
    """For each integer input used as an index: (the bound its values must stay below, what sets it).

    An embedding's ids must be below its table's rows; a cross entropy's targets below its classes (the
    ignore_index aside). Followed through ops that only reshape or copy. A token file read with the
    wrong --data-dtype gives ids far beyond the vocabulary, which the embedding reports as an
    IndexError deep inside the program on every rank: runtime/data.py checks against these instead.
    """
    by_name = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    fqn = {s.name: s.fqn for s in traced.state}
    out: dict[str, tuple[int, str]] = {}
    for spec in traced.inputs:
        node = by_name.get(spec.name)
        if node is None or not spec.dtype.startswith("int"):
            continue
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            for user in n.users:
                if user in seen:
                    continue
                seen.add(user)
                op = getattr(user.target, "__name__", str(user.target)).split(".")[0]
                bound = None
                if op == "embedding" and len(user.args) > 1 and user.args[1] is n:
                    table = user.args[0]
                    bound = (_rows(table), f"the rows of {fqn.get(table.name, table.name)}")
                elif op in ("cross_entropy_loss", "nll_loss_forward", "nll_loss", "nll_loss_nd") and \
                        len(user.args) > 1 and user.args[1] is n:
                    bound = (_classes(user.args[0]), "the classes of the loss")
                elif op in _PASS_THROUGH:
                    todo.append(user)
                if bound and bound[0] and (spec.name not in out or bound[0] < out[spec.name][0]):
                    out[spec.name] = bound
    return out


def _rows(node) -> int | None:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return int(val.shape[0]) if val is not None and val.dim() >= 1 else None


def _classes(node) -> int | None:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    return int(val.shape[1]) if val is not None and val.dim() >= 2 else None
