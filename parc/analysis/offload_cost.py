"""ZeRO-Offload in the cost model (`zero stage=N offload=cpu`): what it frees on the device, adds on the host.

Start at `apply(...)`, called by `parc.analysis.cost.estimate` for a plan with `zero … offload=cpu`. It
follows runtime/parallel/offload.py, per rank, with Ψ the parameters this rank holds (its pp stage's,
one tp rank's share) and K the ranks ZeRO cuts the state over:

  device memory    the optimizer state (8Ψ/K bytes for Adam) leaves the device; under bf16 the fp32
                   master range too (4Ψ/K), and stage 3 keeps its range in bf16 (2Ψ/K) for the gathers;
                   in fp32 the range stays (it is the weights: a view of the flat buffer, or stage 3's shard)
  host memory      the fp32 master range, a gradient buffer and the optimizer state: (4 + 4 + 8)Ψ/K
  host↔device      per step the reduced fp32 gradient range down (4Ψ/K bytes) and the updated range up,
                   in the compute dtype (bf16: 2Ψ/K, cast on the host) over PCIe (`Hardware.pcie_bw`, one
                   direction). The download of a bucket starts when its last reduce lands, during the last
                   micro-batch's backward, so it hides under the rest of that backward: exposed is
                   max(one bucket's share, download − backward). The upload is exposed: the host step
                   needs every gradient first, and the all-gather needs the upload
  the update       moves from the device's memory bandwidth to the host's (`Hardware.host_mem_bw`, what
                   one rank's share of the host's DRAM reaches): the bytes of compute.step_seconds'
                   update (AdamW 28 a parameter, SGD 12)

The host step and the upload are priced on the step; only the upload's tail could hide under the next
forward's first layers, which is left out (the estimate errs slow).
"""

from __future__ import annotations

UPDATE_BYTES = {"sgd": 12}   # per parameter: read param + grad, write param; AdamW/Adam: 28 (compute.py)


def update_bytes(optimizer: str) -> int:
    return UPDATE_BYTES.get(optimizer, 28)


def memory(row: dict, params: float, k: int, stage: int, master_b: int, compute_b: int, optimizer_b: int) -> dict:
    """`row` (a pp rank's memory, bytes) with the optimizer state (and, under a compute dtype, the fp32 masters)
    moved to the host; adds `host` (bytes in host memory) and `offload_frees` (device bytes the offload frees)."""
    mine = params / k
    device_params = row["params"]
    if compute_b:  # the whole compute copy stays at stages 1–2; stage 3 keeps its shard in the compute dtype
        device_params = params * compute_b / (k if stage >= 3 else 1)
    frees = row["optimizer"] + row["params"] - device_params
    return dict(row, params=device_params, optimizer=0.0, total=row["total"] - frees, offload_frees=frees,
                host=mine * (master_b + 4 + optimizer_b))


def traffic(params: float, k: int, up_b: int, hw) -> tuple[float, float, float, float]:
    """(bytes down, bytes up, seconds down, seconds up) per step over PCIe; no seconds without a PCIe figure."""
    down, up = 4 * params / k, up_b * params / k
    return down, up, (down / hw.pcie_bw if hw.pcie_bw else 0.0), (up / hw.pcie_bw if hw.pcie_bw else 0.0)


def host_step_seconds(params: float, k: int, optimizer: str, hw) -> tuple[float, float]:
    """(seconds of the update on the host, seconds of it no longer spent on the device)."""
    moved = params / k * update_bytes(optimizer)
    return (moved / hw.host_mem_bw if hw.host_mem_bw else 0.0), (moved / hw.mem_bw if hw.mem_bw else 0.0)


def apply(memory_rows: list[dict], params: float, k: int, stage: int, optimizer: str, master_b: int, compute_b: int,
          optimizer_b: int, hw, backward_s: float = 0.0,
          buckets: int = 1) -> tuple[list[dict], float, list[tuple[str, float, float]], str]:
    """(memory rows, seconds added to the step, the two copies as (name, bytes, seconds), the report's note).
    `backward_s`: the last micro-batch's backward on this rank, which the download of `buckets` buckets hides
    under (0: not overlapped)."""

    rows = [memory(r, r["params_count"], k, stage, master_b, compute_b, optimizer_b) for r in memory_rows]
    down, up, down_s, up_s = traffic(params, k, compute_b or master_b, hw)
    down_exposed = max(down_s / max(buckets, 1), down_s - backward_s) if backward_s else down_s
    copy_s = down_exposed + up_s
    host_s, device_s = host_step_seconds(params, k, optimizer, hw)
    added = copy_s + host_s - device_s
    copies = [("copy device→host, gradients (PCIe)", down, down_s), ("copy host→device, parameters (PCIe)", up, up_s)]
    note = (f"ZeRO-Offload: {_gib(rows[0]['offload_frees'])} a rank leaves the device (the optimizer state"
            + (", the fp32 masters" if compute_b else "") + f"); the host holds {_gib(rows[0]['host'])} a rank (fp32 "
            f"masters, gradient buffer, optimizer state); each step copies {_gib(down)} of gradients down and "
            f"{_gib(up)} of parameters up"
            + (f" at {hw.pcie_bw / 1e9:g} GB/s ({(down_s + up_s) * 1e3:.3g} ms, {copy_s * 1e3:.3g} ms of it exposed: "
               "the download runs under the last backward)" if hw.pcie_bw else " (no PCIe figure: unpriced)")
            + (f", and the update runs on the host at {hw.host_mem_bw / 1e9:g} GB/s ({host_s * 1e3:.3g} ms, against "
               f"{device_s * 1e3:.3g} ms on the device)" if hw.host_mem_bw else ", the host update unpriced"))
    return rows, added, copies, note


def _gib(b: float) -> str:
    """`b` bytes in the largest binary unit that keeps it ≥ 1."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"
