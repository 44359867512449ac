"""The runtime calls no torch.distributed name newer than the declared minimum torch (pyproject.toml).

torch 2.13 added `dist.reduce_scatter_single` / `dist.all_gather_single`; the runtime used them and
failed at the first ZeRO backward on the H200's torch 2.11 (../shared/gpu/README.md). This test
reads the source with `ast` (no import, no torch version needed) and lists every `torch.distributed`
name the package touches — `dist.x`, `torch.distributed.x`, `from torch.distributed[.sub] import x`,
`dcp.x` for an imported submodule — and requires each to be in `torch_min_api.txt`, the names
checked present in the minimum version. A new name fails here until someone checks it against
that torch (its docs or source at the tag) and adds it; the header of the list says how it was made.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("parc", "runtime", "passes", "grammar")
ALLOWED = Path(__file__).with_name("torch_min_api.txt")


def _declared_minimum() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'"torch>=([0-9.]+),', text).group(1)


def _allowed() -> tuple[str, set[tuple[str, str]]]:
    version, names = None, set()
    for line in ALLOWED.read_text().splitlines():
        if line.startswith("# minimum:"):
            version = line.split(":", 1)[1].strip()
        line = line.split("#", 1)[0].strip()
        if line:
            module, name = line.split()
            names.add((module, name))
    return version, names


def used_names(source: str) -> set[tuple[str, str]]:
    """(torch.distributed module, attribute) pairs a module's source uses."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> torch.distributed module it stands for
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed") and a.asname:
                    aliases[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            for a in node.names:
                out.add((node.module, a.name))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.add((aliases[node.value.id], node.attr))
        chain, v = [], node.value  # torch.distributed.x spelled out
        while isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        if isinstance(v, ast.Name) and v.id == "torch" and chain[::-1] == ["distributed"]:
            out.add(("torch.distributed", node.attr))
    return out


def test_scanner_sees_every_spelling():
    src = ("import torch\nimport torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
           "from torch.distributed.tensor import DTensor\n"
           "dist.all_reduce(x)\ntorch.distributed.barrier()\ndcp.save(s)\n")
    assert used_names(src) == {("torch.distributed", "all_reduce"), ("torch.distributed", "barrier"),
                               ("torch.distributed.checkpoint", "save"), ("torch.distributed.tensor", "DTensor")}


def test_known_newer_names_are_caught():
    assert ("torch.distributed", "reduce_scatter_single") not in _allowed()[1]
    assert ("torch.distributed", "all_gather_single") not in _allowed()[1]


def test_runtime_uses_only_names_of_the_declared_minimum():
    version, allowed = _allowed()
    assert version == _declared_minimum(), (f"{ALLOWED.name} was checked against torch {version} but "
                                            f"pyproject.toml declares torch>={_declared_minimum()}")
    missing = {}
    for d in PACKAGE_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            for pair in used_names(f.read_text()) - allowed:
                missing.setdefault(pair, []).append(str(f.relative_to(ROOT)))
    assert not missing, "torch names not checked against torch " + version + ": " + "; ".join(
        f"{m}.{n} ({', '.join(fs)})" for (m, n), fs in sorted(missing.items()))
