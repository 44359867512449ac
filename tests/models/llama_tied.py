"""tests/models/llama_tiny.py with `tie_word_embeddings=True`: `lm_head.weight` is `model.embed_tokens.weight`.

Start here: `build_model`. The traced graph has one placeholder for the shared table,
read by the embedding lookup and by the lm head; a `vocab` rule on either shards it
once for both (docs/tensor-parallel.md, "Tied embeddings"). The Llama file is found next
to the installed `parc` package, so a compiled copy of this file finds it too.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch.nn as nn
from transformers import LlamaForCausalLM

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1] / "tests" / "models"))
from llama_tiny import CONFIG as TINY  # noqa: E402
from llama_tiny import get_batch, loss_fn  # noqa: E402,F401  (the convention's other two functions)

CONFIG = copy.deepcopy(TINY)
CONFIG.tie_word_embeddings = True


def build_model() -> nn.Module:
    return LlamaForCausalLM(CONFIG)
