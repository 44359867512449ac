"""The model's own init per shard (runtime/checkpoint/init_shards.py): a rank replays build_model() under the seed with
parameters on meta and keeps only its slices, which equal, bit for bit, the same slices of the full CPU
build; a build that reads a parameter's values is refused (`Unsupported`) so the runtime builds on CPU.
Trainer uses it for every run without --weights, so every parallel-vs-serial test also covers it."""

from __future__ import annotations

import textwrap

import pytest
import torch

from helpers import GPT, ROOT
from parc.runtime.checkpoint.init_shards import Unsupported, init_shards, own_init
from parc.runtime.checkpoint.state import build_reference, shard
from parc.trace import load_user_module

MODELS = ROOT / "tests" / "models"


def _specs(model: torch.nn.Module) -> dict[str, dict | None]:
    """Keep a quarter of the parameters whole, split a quarter by rows (as a fused qkv: 3 blocks, where that
    divides), a quarter by columns, and leave the rest out."""
    out = {}
    for i, (n, p) in enumerate(model.named_parameters()):
        if i % 4 == 0:
            out[n] = None
        elif i % 4 == 1 and p.shape[0] % 6 == 0:
            out[n] = {"dim": 0, "parts": 2, "index": 1, "blocks": 3}
        elif i % 4 == 2 and p.dim() == 2:
            out[n] = {"dim": 1, "parts": 2, "index": 0}
    return out


@pytest.mark.parametrize("path", [GPT, MODELS / "gpt_tied.py", MODELS / "llama_tiny.py", MODELS / "gpt2_tiny.py"])
def test_kept_slices_equal_the_full_build(path):
    user = load_user_module(path)
    full = build_reference(user, 5)
    keep = _specs(full)
    values, skeleton = init_shards(user, 5, keep)
    assert set(values) == set(keep)
    params = dict(full.named_parameters())
    for n, spec in keep.items():
        assert torch.equal(values[n], shard(params[n].detach(), spec)), n
    for n, b in full.named_buffers():  # real buffers, built under the seed
        assert torch.equal(dict(skeleton.named_buffers())[n], b), n
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    # only what was asked for is held: the shards' elements, no more
    assert sum(v.numel() for v in values.values()) == sum(shard(params[n], s).numel() for n, s in keep.items())


READS = """
    import torch
    from torch import nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            {line}

        def forward(self, x):
            return self.b(self.a(x))

    def build_model():
        return M()

    def get_batch(step, n):
        return (torch.randn(n, 8),)

    def loss_fn(model, x):
        return model(x).mean()
"""


@pytest.mark.parametrize("line", ["self.a.weight.data.mul_(self.a.weight.data.norm())",  # a value read
                                  "self.b.weight.data.copy_(self.a.weight.data)",  # one parameter into another
                                  "self.a.weight.data = torch.randn(8, 8)",        # storage swapped, no op
                                  "self.register_buffer('s', self.a.weight.sum(0))"])
def test_a_build_that_reads_parameters_is_refused(tmp_path, line):
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent(READS.format(line=line)))
    user = load_user_module(f)
    with pytest.raises(Unsupported):
        init_shards(user, 0, {"a.weight": None})
    entries = [{"name": "p0", "fqn": "a.weight", "kind": "param", "shape": [8, 8], "dtype": "float32",
                "requires_grad": True, "shard": None}]
    assert own_init(entries, user, 0, torch.device("cpu")) is None  # the runtime builds on CPU instead


@pytest.mark.parametrize("line", ["nn.init.trunc_normal_(self.a.weight, std=0.02)",  # rejection sampling
                                  "nn.init.orthogonal_(self.a.weight)"])              # QR of what it drew
def test_inits_that_skip_meta_tensors_are_replayed(tmp_path, line):
    """torch.nn.init.trunc_normal_ and orthogonal_ return at once on a meta tensor, drawing nothing: the
    parameters after them would silently get other numbers. Replayed whole, they draw as in the full build."""
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent(READS.format(line=line)))
    user = load_user_module(f)
    full = build_reference(user, 0)
    values, _ = init_shards(user, 0, {"a.weight": None, "b.weight": {"dim": 1, "parts": 2, "index": 1}})
    assert torch.equal(values["a.weight"], full.a.weight.detach())
    assert torch.equal(values["b.weight"], full.b.weight.detach()[:, 4:])
