"""`precision fp16` is refused at compile time.

`precision bf16` (bf16 copies of fp32 masters, fp32 gradients; DP, ZeRO-2/3, TP + SP, PP against the
serial bf16 model, the dtypes the matmuls run in, what autograd saves) is tests/test_bf16_layout.py.
"""


import pytest

from helpers import GPT
from parc.compiler import compile_model
from parc.errors import ParcError
from parc.grammar.parser import parse


def test_fp16_is_refused_at_the_precision_statement(tmp_path):
    text = "mesh dp=2\nbatch global=8 micro=2\nprecision fp16\n"
    plan = parse(text, file=str(tmp_path / "fp16.par"))
    with pytest.raises(ParcError) as err:
        compile_model(GPT, plan, tmp_path / "out")
    assert "loss scaling" in err.value.message and "precision bf16" in err.value.diagnostics[0].hint
    assert (err.value.span.line, err.value.span.col) == (3, 11)  # the `fp16` token
    assert not (tmp_path / "out").exists()  # refused before anything is written
