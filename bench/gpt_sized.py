"""examples/gpt.py's GPT at a size from PARC_BENCH_GPT="layers,hidden,heads,vocab,seq": for bench/published.py.

A 6th field `tied` ties the output layer to the token embedding (GPTConfig.tie_weights), as MosaicML's MPT does
(llm-foundry's MPTForCausalLM has no lm_head: its logits are F.linear(x, wte.weight)). The logits' matmul is the
same; what changes is the parameters: one vocab × hidden matrix fewer to all-gather, reduce-scatter and step
under FSDP (MPT 1B: 103M of its 1.32B).

Only ever traced on meta, so the batches are random token ids.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402,F401  (the convention's third function)

_SPEC = os.environ.get("PARC_BENCH_GPT", "96,12288,96,51200,2048").split(",")
_L, _H, _NH, _V, _T = (int(x) for x in _SPEC[:5])
_TIED = _SPEC[5:] == ["tied"]
CONFIG = GPTConfig(vocab_size=_V, block_size=_T, n_layer=_L, n_head=_NH, n_embd=_H, tie_weights=_TIED)


def build_model():
    return GPT(CONFIG)


def get_batch(step, batch_size):
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
