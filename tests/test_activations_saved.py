"""What the backward keeps (issue 27, item 1, memory): ops whose backward saves nothing are not counted as
keeping their inputs (export's `_assert_tensor_metadata` checks, dtype casts, stack, repeat_interleave), a
product keeps an operand only for a gradient that is needed (rotary positions times a constant table keep
the table, not the projection), and an explicit `.float()` is held in fp32 under bf16. Traces
bench/llama_sized.py at a toy size on meta (well under a second)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parc.analysis import activations as A

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def graph(monkeypatch):
    from parc.trace import load_user_module, trace

    monkeypatch.setenv("PARC_BENCH_LLAMA", "1,64,4,2,128,100,16")
    traced = trace(load_user_module(ROOT / "bench" / "llama_sized.py"), 1)
    return traced.gm, [n for n in traced.gm.graph.nodes if n.op == "call_function"]


def _saved(n) -> bool:
    return any(c.op != "output" and A._saves(c, n) for c in A._consumers(n))


def test_metadata_checks_and_casts_keep_nothing(graph):
    _, nodes = graph
    checks = [n for n in nodes if "_assert_tensor_metadata" in str(n.target)]
    assert checks, "the traced Llama casts (x.float()), so export inserts its dtype checks"
    for c in checks:
        assert not any(A._saves(c, a) for a in c.all_input_nodes)
    for n in nodes:
        if any(k in str(n.target) for k in ("aten.stack.", "aten.type_as.", "aten.to.", "repeat_interleave")):
            assert not any(A._saves(n, a) for a in n.all_input_nodes), n.target


def test_rotary_products_keep_the_table_not_the_projection(graph):
    """q = wq(x) only flows into x1·cos − x2·sin and x1·sin + x2·cos: cos and sin need no gradient, so the
    products save cos and sin for q's gradient and q itself is kept by nothing."""
    _, nodes = graph
    linears = [n for n in nodes if "aten.linear." in str(n.target)]
    wq, wk = linears[0], linears[1]
    assert not _saved(wq) and not _saved(wk)
    tables = [n for n in nodes if str(n.target).startswith(("aten.cos.", "aten.sin."))]
    assert tables and all(_saved(t) for t in tables)
    assert not any(A._grad(t) for t in tables) and A._grad(wq)


def test_an_explicit_float_is_fp32_under_bf16(graph):
    gm, nodes = graph
    size = A._dtype_sizes(gm, nodes, bf16=True)
    casts = [n for n in nodes if str(n.target).startswith("aten.to.") and "float32" in str(n.args)]
    assert casts and all(size[n] == 4 for n in casts)
    lin = next(n for n in nodes if "aten.linear." in str(n.target))
    assert size[lin] == 2
