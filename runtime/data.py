"""Where a step's samples come from: each rank loads only its own, deterministically and resumably.

Start here: `source_for(user, args)` picks one of three sources; the Trainer asks it for this rank's
rows of global batch `step` (`local(step, lo, n)`), --verify's serial reference for all of them
(`whole(step)`). Rows are laid out as before: dp rank d takes rows [d·G/dp, (d+1)·G/dp) of the
global batch, split into micro-batches in order, so the dropout keys (by global row) are unchanged.

  source                   what the model file / command line gives     a rank reads
  get_batch (the old one)  get_batch(step, batch_size) → the whole batch  the whole batch, then slices it
  get_samples              get_samples(indices) → rows for those samples  its rows only
  memmap                   parc.run --data FILE [--data-dtype uint16]     its rows only

Sample order (`Sampler`). Row j of global batch `step` is *position* p = consumed + (step − first)·G + j
in the sample stream: `consumed` is the number of samples the checkpoint the run resumed from had
used (0 for a fresh run), so a resume — even with another global batch — continues the stream where
it stopped. With a known number of samples N (memmap, or a model file's `num_samples`), position p is
sample perm_e[p mod N] of epoch e = p div N, perm_e a permutation drawn from (seed, e) alone; without
N, sample p. The order is a pure function of (seed, N, position): any rank computes any row.

memmap (nanoGPT's train.bin: a flat array of uint16/uint32 token ids): sample i is tokens
[i·T, i·T + T + 1), x = its first T tokens, y = its last T (targets shifted by one), both int64;
N = (len − 1) div T. T comes from the compiled program's inputs, which must be two (B, T) int64
tensors (a model file whose get_batch returns (x, y) token batches, as examples/gpt.py's does).
"""

from __future__ import annotations

from pathlib import Path

import torch

from parc.errors import LaunchError

DTYPES = ("uint16", "uint32")


class Sampler:
    """Position in the sample stream → sample index (see the module docstring)."""

    def __init__(self, n: int | None, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # a step spans at most two epochs: keep only recent ones
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=g)
        return self._perms[epoch]

    def indices(self, positions: torch.Tensor) -> torch.Tensor:
        if self.n is None:
            return positions
        epoch, within = positions // self.n, positions % self.n
        if not self.shuffle:
            return within
        out = torch.empty_like(positions)
        for e in epoch.unique().tolist():
            sel = epoch == e
            out[sel] = self._perm(e)[within[sel]]
        return out


class GetBatch:
    """The original convention: every rank asks for the whole global batch and keeps its rows."""

    kind = "get_batch"

    def __init__(self, fn, global_batch: int):
        self.fn, self.global_batch = fn, global_batch

    def whole(self, step: int):
        return self.fn(step, self.global_batch)

    def call(self, step: int, lo: int, n: int) -> str:
        return f"get_batch({step}, {self.global_batch})"

    def seek(self, step: int, consumed: int) -> None:
        """Nothing to do: the batch is a function of the step."""

    def consumed_at(self, step: int) -> int:
        return step * self.global_batch

    def describe(self) -> dict:
        return {"source": "get_batch"}


class Samples:
    """A rank asks `get(indices)` for its own rows: get_samples from the model file, or a memmap."""

    def __init__(self, get, n: int | None, seed: int, global_batch: int, what: dict, shuffle: bool = True):
        self.get, self.sampler, self.global_batch, self.what = get, Sampler(n, seed, shuffle), global_batch, what
        self.kind = what["source"]
        self.first, self.consumed = 0, 0  # the stream position of step `first`'s row 0

    def seek(self, step: int, consumed: int) -> None:
        """A resumed run starts at `step`, the checkpoint's samples used so far being `consumed`."""
        self.first, self.consumed = step, consumed

    def consumed_at(self, step: int) -> int:
        """Samples used by the steps before `step` (what a checkpoint after `step` steps records)."""
        return self.consumed + (step - self.first) * self.global_batch

    def positions(self, step: int, lo: int, n: int) -> torch.Tensor:
        start = self.consumed + (step - self.first) * self.global_batch + lo
        return torch.arange(start, start + n, dtype=torch.int64)

    def local(self, step: int, lo: int, n: int):
        """Rows [lo, lo + n) of global batch `step`, and only those, from the source."""
        return self.get(self.sampler.indices(self.positions(step, lo, n)))

    def whole(self, step: int):
        return self.local(step, 0, self.global_batch)

    def call(self, step: int, lo: int, n: int) -> str:
        return f"{self.kind}(<{n} sample indices of step {step}>)"

    def describe(self) -> dict:
        return {**self.what, "samples": self.sampler.n, "seed": self.sampler.seed}


class TokenFile:
    """A flat binary file of token ids, memory-mapped: rows of `T`+1 tokens, (x, y) int64 pairs."""

    def __init__(self, path: Path, dtype: str, tokens_per_sample: int, flag: str = "--data",
                 below: tuple[int, str] | None = None):
        import numpy as np

        if dtype not in DTYPES:
            raise LaunchError(f"{flag}-dtype {dtype}: token files hold uint16 or uint32 ids")
        if not Path(path).is_file():
            raise LaunchError(f"{flag} {path}: no such file")
        self.path, self.dtype, self.T = Path(path), dtype, tokens_per_sample
        size = self.path.stat().st_size
        width = np.dtype(dtype).itemsize
        if size % width:
            raise LaunchError(f"{flag} {path}: {size} bytes is not a whole number of {dtype} tokens ({width} bytes "
                              f"each); is --data-dtype right?")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        self.n = (len(self.tokens) - 1) // self.T
        if self.n < 1:
            raise LaunchError(f"{flag} {path}: {len(self.tokens)} tokens; one sample needs T + 1 = {self.T + 1}")
        self.flag, self.below = flag, below
        if below is not None:  # at start, a sample of the file: its head, its tail and a stride through it
            n, k = len(self.tokens), 1 << 16
            stride = max(1, n // (1 << 20))
            for lo, part in ((0, self.tokens[:k]), (max(0, n - k), self.tokens[-k:]), (0, self.tokens[::stride])):
                self._check(np.asarray(part), lo, stride if part.shape[0] > k else 1)

    def _check(self, ids, offset: int = 0, stride: int = 1) -> None:
        """Token ids at or past the bound the program indexes with (plan.json `below`): one line that names
        the likely cause, instead of an IndexError inside the embedding on every rank."""
        import numpy as np

        bound, what = self.below
        if ids.size and int(ids.max()) >= bound:
            at = int(np.argmax(ids >= bound))
            raise LaunchError(f"{self.flag} {self.path}: token id {int(ids.flat[at])} (token {offset + at * stride} of "
                              f"the file) ≥ {bound}, {what}: is --data-dtype right? (read as {self.dtype}; a file "
                              f"of uint8 bytes or of uint32 ids reads as ids like this)")

    def __call__(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np

        rows = np.stack([self.tokens[i * self.T:i * self.T + self.T + 1] for i in indices.tolist()])
        if self.below is not None:  # every batch too, cheaply: one max over the rows this rank reads
            if rows.size and int(rows.max()) >= self.below[0]:
                row = int(np.argmax((rows >= self.below[0]).any(axis=1)))
                self._check(rows[row], int(indices[row]) * self.T)
        t = torch.from_numpy(rows.astype(np.int64))  # (n, T + 1)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _token_length(inputs: list[dict], flag: str, path) -> int:
    """T from the compiled inputs, which must be (x, y) token batches."""
    shapes = ", ".join(f"{tuple(i['shape'])} {i['dtype']}" for i in inputs)
    ok = (len(inputs) == 2 and all(i["dtype"] == "int64" and len(i["shape"]) == 2 for i in inputs)
          and inputs[0]["shape"] == inputs[1]["shape"])
    if not ok:
        raise LaunchError(f"{flag} {path}: a token file gives (x, y) batches of (B, T) int64 token ids, but the "
                          f"program was compiled for inputs {shapes}",
                          hint="compile a model file whose get_batch returns (x, y) token batches, or define "
                               "get_samples(indices) in the model file instead")
    return inputs[0]["shape"][1]


def source_for(user, inputs: list[dict], global_batch: int, seed: int, data: Path | None,
               dtype: str = "uint16", val: bool = False):
    """The source of the run's batches (`val`: of the held-out split, for --eval-every), or None for a
    held-out split nobody gave."""
    flag = "--val-data" if val else "--data"
    if data is not None:
        below = [(i["below"], i["below_what"]) for i in inputs if "below" in i]
        f = TokenFile(data, dtype, _token_length(inputs, flag, data), flag, min(below, key=lambda b: b[0]) if below else None)
        what = {"source": "memmap", "file": str(data), "dtype": dtype}
        return Samples(f, f.n, seed, global_batch, what, shuffle=not val)
    if val:
        get = getattr(user.module, "get_val_samples", None)
        if callable(get):
            n = getattr(user.module, "num_val_samples", None)
            return Samples(get, n, seed, global_batch, {"source": "get_val_samples"}, shuffle=False)
        get = getattr(user.module, "get_val_batch", None)
        return GetBatch(get, global_batch) if callable(get) else None
    get = getattr(user.module, "get_samples", None)
    if callable(get):
        n = getattr(user.module, "num_samples", None)
        if n is not None and (not isinstance(n, int) or n < 1):
            raise LaunchError(f"num_samples = {n!r} in the model file: it must be a positive int (the samples "
                              f"get_samples can index), or absent for an endless stream")
        return Samples(get, n, seed, global_batch, {"source": "get_samples"})
    return GetBatch(user.get_batch, global_batch)
