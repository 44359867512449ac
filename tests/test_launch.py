import torch
import torch.distributed as dist

from parc.runtime.launch import spawn


def _sum_body(ctx, base):
    t = torch.tensor([float(ctx.rank + base)])
    dist.all_reduce(t)
    return t.item()


def test_spawn_runs_a_collective_on_every_rank():
    # 0+1+2 plus base 10 on each of 3 ranks: exact in fp32
    assert spawn(3, _sum_body, 10) == [33.0, 33.0, 33.0]
