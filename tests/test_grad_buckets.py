"""Gradient buckets: assigned at compile time in backward-ready order, all-reduced during backward."""

import torch
import torch.distributed as dist

from helpers import GPT
from parc.passes import grad_buckets
from parc.runtime.parallel.data_parallel import GradBuckets
from parc.runtime.launch import spawn
from parc.trace import load_user_module, trace


def _traced():
    return trace(load_user_module(GPT), 2)


def test_buckets_follow_backward_order_and_cap():
    traced = _traced()
    params = [s for s in traced.state if s.kind == "param"]
    cap = 64 * 1024  # bytes: forces several buckets on the example GPT
    buckets = grad_buckets.assign(traced.gm, traced.state, cap_bytes=cap)
    flat = [name for b in buckets for name in b]
    assert sorted(flat) == sorted(p.name for p in params)  # every parameter exactly once
    by_name = {p.name: p for p in params}
    for b in buckets:
        size = sum(torch.Size(by_name[n].shape).numel() * 4 for n in b)  # fp32
        assert len(b) == 1 or size <= cap
    # the lm head is used last in forward, so its gradient is ready first
    assert flat[0] == "p_model_lm_head_weight"
    assert flat.index("p_model_blocks_3_mlp_proj_weight") < flat.index("p_model_blocks_0_attn_qkv_weight")


def test_one_bucket_when_everything_fits():
    traced = _traced()
    assert len(grad_buckets.assign(traced.gm, traced.state)) == 1  # the example is ~0.2M params, cap 25 MiB


def _overlap_body(ctx):
    traced = _traced()
    torch.manual_seed(0)
    user = load_user_module(GPT)
    model = user.build_model()
    state = {s.name: p for s, p in zip(traced.state, [dict(model.named_parameters())[s.fqn] for s in traced.state])}
    buckets = grad_buckets.assign(traced.gm, traced.state, cap_bytes=64 * 1024)
    calls = []
    real = dist.all_reduce

    def recording(tensor, *a, **k):
        calls.append(torch._C._current_graph_task_id() != -1)  # True: called from inside backward
        return real(tensor, *a, **k)

    dist.all_reduce = recording
    gb = GradBuckets(state, buckets, None, ctx.world_size)
    gb.start_micro_batch(sync=False)
    user.loss_fn(model, *user.get_batch(0, 2)).backward()
    assert calls == []  # no communication on a non-final micro-batch
    gb.start_micro_batch(sync=True)
    user.loss_fn(model, *user.get_batch(1, 2)).backward()
    gb.finish()
    dist.all_reduce = real
    return {"calls": calls, "buckets": len(buckets)}


def test_all_reduce_overlaps_backward():
    out = spawn(2, _overlap_body)[0]
    assert len(out["calls"]) == out["buckets"] > 1  # one collective per bucket, not per parameter
    assert all(out["calls"])  # every bucket launched from inside backward, none after it


def test_dp1_keeps_autograds_gradients_and_zeros_the_unused():
    """dp 1, nothing to reduce (runtime/parallel/data_parallel.py): no buffers, no hooks. Each step's gradients are
    autograd's own, bit for bit a plain backward's; a parameter without one gets zeros, as a bucket gave it;
    the last step's gradients stay held until the next step starts."""
    traced = _traced()
    torch.manual_seed(0)
    user = load_user_module(GPT)
    model = user.build_model()
    named = dict(model.named_parameters())
    state = {s.name: named[s.fqn] for s in traced.state}
    unused = torch.nn.Parameter(torch.ones(3))  # in a bucket, never in the loss
    state["unused"] = unused
    buckets = grad_buckets.assign(traced.gm, traced.state)
    buckets[-1].append("unused")
    gb = GradBuckets(state, buckets, None, 1)
    assert gb.local and gb.flat == [] and all(p.grad is None for p in state.values())
    assert not any(p._post_accumulate_grad_hooks for p in state.values())  # no Python per gradient
    batch = user.get_batch(0, 2)
    want = torch.autograd.grad(user.loss_fn(model, *batch), list(named.values()))
    for step in range(2):  # the second step drops the first's gradients, not adds to them
        gb.start_micro_batch(sync=True)
        assert all(p.grad is None for p in state.values())
        user.loss_fn(model, *batch).backward()
        gb.finish()
        for p, g in zip(named.values(), want):
            assert torch.equal(p.grad, g)
        assert torch.equal(unused.grad, torch.zeros(3))
        gb.zero()
        assert all(p.grad is not None for p in state.values())  # held after the step (memory.held_state)
