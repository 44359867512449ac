"""The parallel context of one rank: who it is on the mesh and its process groups.

Built once from plan.json and passed explicitly to everything that communicates
(STYLE.md rule 3: no process-group singletons). `ParallelContext.create` must run
on every rank in the same order, since `new_group` is collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parc.errors import LaunchError


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    coord: dict[str, int]           # {"dp": i, "pp": j, "tp": k}
    degree: dict[str, int]          # {"dp": 2, "pp": 1, "tp": 1}
    groups: dict[str, object]       # axis → ProcessGroup (None when the axis has degree 1)
    group_ranks: dict[str, list[int]]
    device: torch.device
    backend: str

    def gradient_group(self) -> tuple[object, int]:
        """(group, size) a dense gradient is summed over: dp, or dp × cp under context parallelism, whose cp
        ranks hold parts of each sample's gradient (the mean still divides by dp)."""
        cp = self.degree.get("cp", 1)
        return self.groups["dp_cp" if cp > 1 else "dp"], self.degree["dp"] * cp

    @classmethod
    def create(cls, plan_json: dict) -> "ParallelContext":
        mesh = plan_json["mesh"]
        world = dist.get_world_size()
        if world != mesh["world_size"]:
            raise LaunchError(f"launched with {world} processes but the plan's mesh is dp {mesh['dp']} × pp "
                              f"{mesh['pp']} × tp {mesh['tp']} = {mesh['world_size']}; run torchrun "
                              f"--nproc-per-node {mesh['world_size']} (or recompile for {world})")
        rank = dist.get_rank()
        me = plan_json["ranks"][rank]
        groups, group_ranks = {}, {}
        # ep and edp (expert parallelism, runtime/parallel/expert_parallel.py) only in plans with mesh ep > 1
        # zero_shard and zero_replicate (HSDP, runtime/parallel/zero.py) only in plans with zero shard < dp
        # cp and dp_cp (context parallelism, runtime/parallel/ring_attention.py) only in plans with mesh cp > 1
        for axis in ("dp", "pp", "tp", *(a for a in ("ep", "edp", "zero_shard", "zero_replicate", "cp", "dp_cp")
                                         if a in plan_json["groups"])):
            for ranks in plan_json["groups"][axis]:
                # every rank creates every group, in the same order: new_group is collective
                pg = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[axis], group_ranks[axis] = pg, ranks
        axes = ("dp", "pp", "tp", "cp") if "cp" in mesh else ("dp", "pp", "tp")
        return cls(rank, world, {a: me[a] for a in axes},
                   {a: mesh[a] for a in axes}, groups, group_ranks, current_device(),
                   dist.get_backend())


def current_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(timeout_s: float | None = None) -> None:
    """NCCL with each rank on its LOCAL_RANK GPU when CUDA is there, gloo on CPU otherwise."""
    if dist.is_initialized():
        return
    import datetime

    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    if (store := _attempt_store(kwargs.get("timeout"))) is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=current_device(), **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def _attempt_store(timeout):
    """torchrun's key-value store with this attempt's keys apart from the attempts before it, or None.

    Why: when torchrun restarts its workers (`--max-restarts`), the new ones join the store its agent
    hosts, which still holds the keys the previous workers wrote: gloo's and NCCL's per-rank addresses
    among them. A new rank can read a dead peer's address before the live one overwrites it, and the
    group fails to connect ("Gloo connectFullMesh failed … Connection refused", pytorch/pytorch#135712),
    every restart alike. So the group's keys are prefixed with torchrun's restart count, which every
    agent of a job advances together. (Without torchrun's shared store, env:// is left as it is.)
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import datetime

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout or datetime.timedelta(minutes=30))
    return dist.PrefixStore(f"/parc/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
