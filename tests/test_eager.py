"""Uncompiled programs (runtime/eager.py): each torch.ops callee bound once at load, parc ops through twins.

The twins must be the custom ops bit for bit, forward and backward, with and without autograd;
the binding must change what a program calls, not what it computes, and keep its line numbers.
The programs' proofs against the serial model (tests/test_moe.py, test_tensor_parallel.py, ...)
run through the twins too, since the Trainer loads `compile none` programs this way.
"""

import textwrap

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parc.codegen import load_program
from parc.runtime import dropout as D
from parc.runtime import eager
from parc.runtime.launch import spawn

SITE = D.site_id("blocks.0.attn", 0)


def _both(call, *inputs):
    """(outputs, input grads) of `call` through the custom op and through its twin, from equal leaves."""
    results = []
    for how in ("custom", "twin"):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = call(how, *leaves)
        first = out[0] if isinstance(out, tuple) else out
        w = torch.linspace(-1, 1, first.numel()).view_as(first)
        grads = torch.autograd.grad((first * w).sum(), [t for t in leaves if t.requires_grad])
        results.append((out, grads))
    return results


def _op(name, how):
    return getattr(torch.ops.parc, name).default if how == "custom" else eager.twin(f"parc::{name}")


def test_twins_are_the_custom_ops_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    with D.key_scope(0, 3, 0):
        (a, ga), (b, gb) = _both(lambda how, x: _op("keyed_dropout", how)(x, 0.25, SITE, [4, 6, 8], 48, []), x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(ga[0], gb[0])
    assert not b[1].requires_grad  # the mask: non-differentiable through the twin too

    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    with D.key_scope(0, 3, 0):  # p 0.2: the twin's forward and backward re-run draw the same keyed mask
        (a, ga), (b, gb) = _both(lambda how, q, k, v: _op("keyed_attention", how)(
            q, k, v, None, 0.2, True, None, False, SITE, [2, 4, 5, 5], 100, []), q, k, v)
    assert torch.equal(a, b) and all(torch.equal(s, t) for s, t in zip(ga, gb))


def test_twin_without_autograd_is_the_plain_function():
    x = torch.randn(4, 6, 8)
    twin = eager.twin("parc::keyed_dropout")
    with D.key_scope(0, 0, 0):
        y, keep = twin(x, 0.25, SITE, [4, 6, 8], 48, [])  # no input needs a gradient
        with torch.no_grad():
            z, _ = twin(x.requires_grad_(), 0.25, SITE, [4, 6, 8], 48, [])
    assert y.grad_fn is None and z.grad_fn is None and torch.equal(y, z)


def test_tensor_list_ops_keep_the_custom_op():
    import parc.runtime.parallel.zero  # noqa: F401 — registers parc::zero_unshard (params: list[Tensor])

    assert eager._has_tensor_list(torch.ops.parc.zero_unshard.default._schema)
    assert not eager._has_tensor_list(torch.ops.parc.keyed_dropout.default._schema)
    assert eager.twin("parc::zero_unshard") is None
    assert eager.twin("parc::alltoall_bwd") is None  # no backward of its own: called only inside one


PROGRAM = textwrap.dedent('''\
    import torch
    import parc.runtime.parallel.ops  # noqa: F401

    DEVICE = torch.device("cpu")

    def forward(x, y):
        add = torch.ops.aten.add.Tensor(x, y)
        if x.shape[0] == 2:
            raise ValueError("line 9")
        mul = torch.ops.aten.mul(add, 2)
        pair = torch.ops.parc.keyed_dropout.default(mul, 0.5, 7, [3, 4], 4, [])
        return (pair[0].sum(),)
    ''')


def test_bind_changes_the_callees_not_the_results():
    x, y = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    losses, grads = [], []
    for bound in (False, True):
        fwd = load_program(PROGRAM, torch.device("cpu"), "<test program>", eager=bound)
        with D.key_scope(1, 2, 0):
            (loss,) = fwd(x, y)
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, x)[0])
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])

    names = fwd.__globals__
    assert names["_parc_op_aten_add_Tensor"] is torch.ops.aten.add.Tensor._op
    assert names["_parc_op_parc_keyed_dropout_default"] is eager.twin("parc::keyed_dropout")
    walked = set(fwd.__code__.co_names)  # the attributes the function still looks up
    assert {"Tensor", "keyed_dropout", "default"}.isdisjoint(walked)  # add and keyed_dropout: bound names
    assert "mul" in walked and not any(n.startswith("_parc_op_aten_mul") for n in names)  # a packet stays

    try:  # tracebacks still point at the program's own lines
        fwd(torch.randn(2, 4), torch.randn(2, 4))
    except ValueError as e:
        assert e.__traceback__.tb_next.tb_lineno == 9
    else:
        raise AssertionError("the program did not raise")


def _all_to_all_body(ctx):
    import torch.distributed as dist

    from parc.runtime.parallel import expert_parallel, ops

    ops._GROUPS["ep"] = dist.group.WORLD
    x = torch.arange(4 * 3 * 2, dtype=torch.float32).view(4, 3, 2) * (ctx.rank + 1)
    (a, ga), (b, gb) = _both(lambda how, x: _op("alltoall_alltoall", how)(x, "ep"), x.requires_grad_())
    dispatched = {}
    for how in ("custom", "twin"):
        with expert_parallel.traffic() as log, _ParcOps() as seen:  # forward and backward
            _op("alltoall_alltoall", how)(x, "ep").sum().backward()
        dispatched[how] = (seen.ops, [phase for phase, _ in log])
    return torch.equal(a, b), torch.equal(ga[0], gb[0]), dispatched


class _ParcOps(TorchDispatchMode):
    """The parc ops that reach the dispatcher."""

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "parc":
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_all_to_all_twin_on_two_ranks():
    for same_out, same_grad, dispatched in spawn(2, _all_to_all_body):
        assert same_out and same_grad
        # both issue an all-to-all forward and one backward; the custom op dispatches both as parc ops,
        # the twin neither (its backward calls alltoall_bwd's function through eager.call)
        assert dispatched["custom"] == (["alltoall_alltoall.default", "alltoall_bwd.default"], ["fwd", "bwd"])
        assert dispatched["twin"] == ([], ["fwd", "bwd"])
