"""tests/gpu/: parc on real GPUs under NCCL. Collected everywhere, skipped without CUDA.

`pytest tests/gpu` on a machine with a GPU runs every example plan plus a bf16
pipeline, the other pipeline schedules and ZeRO-3 under NCCL with --verify, with
`parc.run --oversubscribe` where the plan has more ranks than the machine has GPUs,
and prints one line per plan (verify figures, wall time) at the end. CI has no GPU:
there every test here is skipped with the reason below (the one skip the suite allows).

Needs parc installed (`pip install -e .`, with lark and graphviz wheels where the image lacks
them). PARC_GPU_SUITE_ON_CPU=1 runs the same jobs on CPU with gloo: a dry run of the harness.
"""

from __future__ import annotations

import os

import pytest
import torch

from gpu_results import RESULTS


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() or os.environ.get("PARC_GPU_SUITE_ON_CPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: the GPU suite (NCCL, --verify) runs only where one is")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("parc on GPU")
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        terminalreporter.write_line(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL {nccl}")
    else:
        terminalreporter.write_line(f"no GPU (PARC_GPU_SUITE_ON_CPU dry run), torch {torch.__version__}, gloo")
    for plan, ranks, verdict, wall in RESULTS:
        terminalreporter.write_line(f"{plan:<22} {ranks} ranks {wall:6.1f} s  {verdict}")
