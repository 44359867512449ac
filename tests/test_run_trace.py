"""`torchrun -m parc.run --trace FILE` on a pp=2 plan writes Chrome-trace JSON of the last step:
one process per pp rank, an F and a B slice for every micro-batch of the rank's stage."""

import json
import os
import subprocess
import sys

from helpers import compile_text
from parc.runtime.launch import free_port


def test_trace_pp2_has_every_forward_and_backward(tmp_path):
    compiled = compile_text("mesh pp=2\nbatch global=8 micro=2\npipeline schedule=1f1b\n", tmp_path / "c").root
    trace = tmp_path / "trace.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "parc.run", str(compiled), "--steps", "2", "--trace", str(trace),
           "--metrics", str(tmp_path / "m.jsonl")]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"trace: {trace} (step 1" in proc.stdout and "measured bubble" in proc.stdout, proc.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"pp rank 0", "pp rank 1"}
    slices = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["args"]["step"] == 1 for e in slices)
    for pid in (0, 1):  # 4 micro-batches (8 / 2) through stage pid, each forward and backward exactly once
        compute = sorted(e["name"] for e in slices if e["pid"] == pid and e["tid"] == 0)
        assert compute == sorted(f"{k}(s{pid},m{j})" for k in "FB" for j in range(4)), compute
