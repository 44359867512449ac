"""A 2-node job on one machine: two torchrun agents on localhost meet through c10d rendezvous and
train a plan whose topology is 2 nodes × 2 GPUs, under --verify (parallel equals serial); a launch
that puts more ranks on a node than the topology states is refused at once, on both nodes, with one
line naming the plan's topology line and what torchrun reported. runtime/placement.py holds the rules."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import compile_text, gpt_tp_rules
from parc.errors import LaunchError
from parc.runtime import placement
from parc.runtime.launch import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# dp 2 × tp 2, tp innermost: each tp group is the two ranks of one node
PLAN = "mesh dp=2 tp=2\ntopology nodes=2 gpus_per_node=2   # two hosts\nbatch global=4 micro=2\n" + gpt_tp_rules()


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    return compile_text(PLAN, tmp_path_factory.mktemp("multinode") / "c")


def _agents(compiled, tmp, nodes: int, per_node: int, *extra: str, timeout: float = 120) -> list:
    """One torchrun agent per node, all on localhost, joined by c10d rendezvous; their (rc, output)."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node",
               str(per_node), "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", f"parc-{port}", "-m", "parc.run", str(compiled),
               "--metrics", str(tmp / f"m{node}.jsonl"), *extra]
        procs.append(subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        return [(p.returncode, out) for p in procs for out, _ in [p.communicate(timeout=timeout)]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_two_nodes_train_as_serial(two_by_two, tmp_path):
    (rc0, out0), (rc1, out1) = _agents(two_by_two.root, tmp_path, 2, 2, "--steps", "2", "--verify")
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    both = out0 + out1
    assert both.count("verify PASS") == 1, both  # rank 0 (on whichever agent rendezvous made node 0)
    assert "warning" not in both, both  # the launch is the topology; tp groups stay on their node


def test_more_ranks_per_node_than_the_topology_fails_fast_in_one_line(two_by_two, tmp_path):
    (rc, out), = _agents(two_by_two.root, tmp_path, 1, 4, "--steps", "1", timeout=60)
    line = ("error: torchrun started 1 node × 4 ranks (WORLD_SIZE 4, LOCAL_WORLD_SIZE 4, GROUP_WORLD_SIZE 1), "
            "but test.par:2 says `topology nodes=2 gpus_per_node=2`: 4 ranks on a node > gpus_per_node 2; "
            "launch with --nnodes 2 --nproc-per-node 2 (two agents may share one host), or change the "
            "topology line")
    assert rc != 0 and line in out, out
    assert "exitcode  : 2" in out, out
    assert not re.search(r'File "[^"]*/(parc|runtime|passes|grammar)/', out), out  # torchrun's own only


def _env(world: int, local: int) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "GROUP_WORLD_SIZE": str(world // local)}


def _plan(source: str, tp_groups: list[list[int]]) -> dict:
    return {"plan": {"source": source, "file": "p.par"}, "groups": {"tp": tp_groups}}


def test_a_stated_topology_bounds_nodes_and_ranks_per_node(two_by_two):
    plan = two_by_two.plan
    assert placement.check(plan, _env(4, 2)) == []
    with pytest.raises(LaunchError, match=r"4 nodes > nodes 2; launch it on at most 2 nodes"):
        placement.check(plan, _env(4, 1))
    with pytest.raises(LaunchError, match=r"4 ranks on a node > gpus_per_node 2"):
        placement.check(plan, _env(4, 4))
    assert placement.check(plan, _env(4, 4), oversubscribe=True) == []  # ranks share GPUs on purpose
    assert placement.check(plan, {"WORLD_SIZE": "4"}) == []  # not torchrun: where ranks run is unknown
    # the topology is the cluster: a launch may use fewer of its devices (review.py's rule)
    assert placement.check(_plan("mesh dp=2\ntopology nodes=2 gpus_per_node=8\n", [[0], [1]]), _env(2, 1)) == []
    with pytest.raises(LaunchError, match=r"2 × 2 ≠ 6; parc needs the same --nproc-per-node on every node"):
        placement.check(plan, {"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"})


def test_a_default_topology_refuses_nothing():
    """No `topology nodes=`/`gpus_per_node=` written: the defaults (1 × 8) are the cost model's guess, not a claim."""
    for source in ("mesh dp=4\n", "mesh dp=4\ntopology preset=h100\n"):
        assert placement.check(_plan(source, [[0], [1], [2], [3]]), _env(4, 4)) == []
        said = placement.check(_plan(source, [[0], [1], [2], [3]]), _env(4, 2))
        assert said == ["launched on 2 nodes × 2 ranks, but the plan states no topology: parc report costed it as "
                        "one node of 8 GPUs; state `topology nodes=2 gpus_per_node=2`"]


def test_a_tp_group_across_nodes_of_the_launch_is_a_warning():
    said = placement.check(_plan("mesh dp=2 tp=2 order=dp,pp,tp\ntopology nodes=2 gpus_per_node=2\n",
                                 [[0, 2], [1, 3]]), _env(4, 2))
    assert said == ["tp group [0, 2] spans nodes [0, 1] of this launch (2 ranks per node): its all-reduces cross "
                    "the network; put tp innermost (mesh order=tp,pp,dp) and keep tp ≤ 2"]
