"""Token ids checked against what the program indexes with (issue 29: a uint8 file read as uint16 gave
120 lines of IndexError from the embedding on 4 ranks). The compiler records, for each integer input,
the bound its ids must stay under (parc/traced.py `index_bounds`, plan.json `below`); a token file is
checked against it on a sample at start and on every batch a rank reads (runtime/data.py)."""

import numpy as np
import pytest
import torch

from helpers import GPT
from parc.errors import LaunchError
from parc.runtime.data import TokenFile
from parc.trace import load_user_module, trace
from parc.traced import index_bounds


def test_the_compiler_finds_what_each_input_indexes():
    bounds = index_bounds(trace(load_user_module(GPT), 2))
    assert bounds == {"batch_0": (256, "the rows of wte.weight"), "batch_1": (256, "the classes of the loss")}


def test_bytes_read_as_uint16_are_refused_at_start(tmp_path):
    data = tmp_path / "raw.bin"
    np.random.default_rng(0).integers(0, 256, 20000, dtype=np.uint8).tofile(data)  # bytes, not uint16 ids
    with pytest.raises(LaunchError, match=r"token id \d+ \(token \d+ of the file\) ≥ 256, the rows of wte.weight: "
                                          r"is --data-dtype right\? \(read as uint16"):
        TokenFile(data, "uint16", 32, below=(256, "the rows of wte.weight"))
    f = TokenFile(data, "uint16", 32)  # no bound known (a program without an embedding): read as before
    assert f.n > 0


def test_a_bad_id_the_start_sample_misses_is_caught_in_the_batch(tmp_path):
    data = tmp_path / "tokens.bin"
    tokens = np.random.default_rng(0).integers(0, 256, 3_000_000).astype(np.uint16)
    tokens[1_000_001] = 9999  # an odd position: the start sample strides by 2 over a file this long
    tokens.tofile(data)
    f = TokenFile(data, "uint16", 32, below=(256, "the rows of wte.weight"))
    x, y = f(torch.tensor([0, 1, 2]))
    assert int(x.max()) < 256
    with pytest.raises(LaunchError, match=r"token id 9999 \(token 1000001 of the file\)"):
        f(torch.tensor([3, 1_000_001 // 32]))
