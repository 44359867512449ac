"""Collectives actually issued at run time by a tensor-parallel step, counted by runtime/ops.record().

examples/gpt.py has 4 layers. Megatron's count per transformer layer is 2
all-reduces forward (g after attention and after the MLP) and 2 backward (f at
their inputs), or with sequence parallelism 2 all-gathers + 2 reduce-scatters
each way, and with SP the backward all-gathers each layer's two gathered inputs again
(runtime/parallel/sequence_regather.py). Outside the layers: the vocab-parallel embedding (1 forward), the lm
head's input (1 backward, or an all-gather each way with SP), the
vocab-parallel cross-entropy (2 forward: max, then [sum-exp, target logit]), and
per step the tp-aware grad-norm (1) and with SP the partial LayerNorm grads (1).
"""

from collections import Counter

import pytest

from helpers import compile_text
from parc.runtime.parallel import ops
from parc.runtime.launch import spawn
from parc.runtime.train import Trainer
from test_tensor_parallel import gpt_plan

L = 4


def _count_body(ctx, compiled: str):
    trainer = Trainer.load(compiled, 0)
    with ops.record() as log:
        trainer.step(0)
    return Counter(log)


@pytest.mark.parametrize("sp", [False, True])
def test_collectives_per_layer(tmp_path, sp):
    plan = gpt_plan(2, sp).replace("global=4", "global=2")  # one micro-batch: one forward, one backward
    counts = spawn(2, _count_body, str(compile_text(plan, tmp_path / "c").root))
    assert counts[0] == counts[1]
    c = {(kind, phase): n for (kind, axis, phase), n in counts[0].items()}
    assert {axis for (_, axis, _) in counts[0]} == {"tp"}
    if not sp:
        assert c == {("all_reduce", "fwd"): 2 * L + 1 + 2,   # g ×2 per layer, embedding, cross-entropy
                     ("all_reduce", "bwd"): 2 * L + 1,       # f ×2 per layer, lm head input
                     ("all_reduce", "step"): 1}              # grad norm
    else:
        assert c == {("all_gather", "fwd"): 2 * L + 1,        # before qkv and fc, lm head input
                     ("reduce_scatter", "fwd"): 2 * L + 1,    # after proj ×2, embedding
                     ("all_reduce", "fwd"): 2,                # cross-entropy
                     ("reduce_scatter", "bwd"): 2 * L + 1,
                     # the row layers' gradients (2 per layer), wpe's from its sequence slice, and each
                     # gathered input again for its layer's weight gradient, Megatron's way
                     # (runtime/parallel/sequence_regather.py): before qkv and fc, the lm head's input
                     ("all_gather", "bwd"): 2 * L + 1 + 1 + 2 * L + 1,
                     ("all_reduce", "step"): 2}               # partial LayerNorm grads, grad norm
