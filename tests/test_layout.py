"""The source layout keeps its promises: module-level imports between parc's modules form
no cycle (deferred imports included), the plan language (grammar/) stands alone, without torch or the rest of parc,
and the analysis (parc/analysis/) only reads: no pass or runtime module imports it."""

from __future__ import annotations

import ast

from helpers import ROOT

PACKAGES = {"parc": ROOT / "parc", "parc.grammar": ROOT / "grammar", "parc.passes": ROOT / "passes",
            "parc.runtime": ROOT / "runtime", "parc.runtime.checkpoint": ROOT / "runtime" / "checkpoint",
            "parc.runtime.parallel": ROOT / "runtime" / "parallel", "parc.analysis": ROOT / "parc" / "analysis"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.glob("*.py"):
            name = pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"
            out[name] = ast.parse(f.read_text(), str(f))
    return out


def _imports(tree: ast.Module, top_level_only: bool = False) -> set[str]:
    """Modules imported anywhere in the file (a deferred import inside a function still ties the two
    modules together), or only by the statements run when it loads."""
    names = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_no_import_cycle():
    mods = _modules()
    edges = {m: {i for i in _imports(t) if i in mods and i != m} for m, t in mods.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " → ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(edges[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(mods):
        visit(m)


def test_grammar_needs_only_lark_and_diagnostics():
    for name, tree in _modules().items():
        if name.startswith("parc.grammar"):
            for imp in _imports(tree, top_level_only=True):
                assert not imp.startswith("torch"), (name, imp)
                assert not imp.startswith("parc.") or imp.startswith(("parc.grammar", "parc.errors")), (name, imp)


def test_passes_and_runtime_do_not_import_the_analysis():
    """What trains must not depend on what predicts: the cost model can change without touching a run."""
    for name, tree in _modules().items():
        if name.startswith(("parc.passes", "parc.runtime")):
            for imp in _imports(tree):
                assert not imp.startswith("parc.analysis"), (name, imp)
