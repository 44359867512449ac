"""ZeRO-Offload in the cost model (`zero stage=N offload=cpu`): what it frees on the device, adds on the host.

Start at `apply(...)`, called by `parc.analysis.cost.estimate` for a plan with `zero … offload=cpu`. It
follows runtime/parallel/offload.py, per rank, with Ψ the parameters this rank holds (its pp stage's,
one tp rank's share) and K the ranks ZeRO cuts the state over:

  device memory    the optimizer state (8Ψ/K bytes for Adam) leaves the device; the fp32 master range
                   stays there (it holds the reduced gradient and is what the all-gather sends)
  host memory      the fp32 master range, a gradient buffer and the optimizer state: (4 + 4 + 8)Ψ/K
  host↔device      per step the reduced fp32 gradient range down and the updated range up: 4Ψ/K bytes
                   each way over PCIe (`Hardware.pcie_bw`, one direction), one after the other: the
                   host step needs every gradient and the all-gather needs the upload
  the update       moves from the device's memory bandwidth to the host's (`Hardware.host_mem_bw`, what
                   one rank's share of the host's DRAM reaches): the bytes of compute.step_seconds'
                   update (AdamW 28 a parameter, SGD 12)

The copies and the host step are priced on the step, not overlapped: the runtime starts the download
after clipping (which reads every gradient) and the step after it, so only the upload's tail can hide
under the next forward's first layers, which is left out (the estimate errs slow).
"""

from __future__ import annotations

UPDATE_BYTES = {"sgd": 12}   # per parameter: read param + grad, write param; AdamW/Adam: 28 (compute.py)


def update_bytes(optimizer: str) -> int:
    return UPDATE_BYTES.get(optimizer, 28)


def memory(row: dict, params: float, k: int, master_b: int, optimizer_b: int) -> dict:
    """`row` (a pp rank's memory, bytes) with the optimizer state moved to the host; adds `host` (bytes in host
    memory) and `offload_frees` (device bytes the offload frees)."""
    mine = params / k
    return dict(row, optimizer=0.0, total=row["total"] - row["optimizer"], offload_frees=row["optimizer"],
                host=mine * (master_b + 4 + optimizer_b))


def traffic(params: float, k: int, hw) -> tuple[float, float]:
    """(bytes each way per step, seconds of both copies) over PCIe; no seconds when the preset has no PCIe figure."""
    each = 4 * params / k
    return each, (2 * each / hw.pcie_bw if hw.pcie_bw else 0.0)


def host_step_seconds(params: float, k: int, optimizer: str, hw) -> tuple[float, float]:
    """(seconds of the update on the host, seconds of it no longer spent on the device)."""
    moved = params / k * update_bytes(optimizer)
    return (moved / hw.host_mem_bw if hw.host_mem_bw else 0.0), (moved / hw.mem_bw if hw.mem_bw else 0.0)


def apply(memory_rows: list[dict], params: float, k: int, optimizer: str, master_b: int, optimizer_b: int,
          hw) -> tuple[list[dict], float, list[tuple[str, float, float]], str]:
    """(memory rows, seconds added to the step, the two copies as (name, bytes, seconds), the report's note)."""

    rows = [memory(r, r["params_count"], k, master_b, optimizer_b) for r in memory_rows]
    each, copy_s = traffic(params, k, hw)
    host_s, device_s = host_step_seconds(params, k, optimizer, hw)
    added = copy_s + host_s - device_s
    copies = [(f"copy {what} (PCIe)", each, copy_s / 2) for what in ("device→host, gradients", "host→device, parameters")]
    note = (f"ZeRO-Offload: the optimizer state ({_gib(rows[0]['offload_frees'])} a rank) leaves the device; the "
            f"host holds {_gib(rows[0]['host'])} a rank (fp32 masters, gradient buffer, optimizer state); each step "
            f"copies {_gib(each)} of gradients down and {_gib(each)} of parameters up"
            + (f" at {hw.pcie_bw / 1e9:g} GB/s ({copy_s * 1e3:.3g} ms)" if hw.pcie_bw else " (no PCIe figure: unpriced)")
            + (f", and the update runs on the host at {hw.host_mem_bw / 1e9:g} GB/s ({host_s * 1e3:.3g} ms, against "
               f"{device_s * 1e3:.3g} ms on the device)" if hw.host_mem_bw else ", the host update unpriced"))
    return rows, added, copies, note


def _gib(b: float) -> str:
    """`b` bytes in the largest binary unit that keeps it ≥ 1."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"
