"""The op rules models write on sharded values, each trained one step against the serial model, and a
program traced on meta that runs on CPU ranks (passes/portable.py).

tests/models/tp_ops.py uses type_as, view_as, view_as_complex/real rotary, zeros_like, new_zeros,
eager attention with a per-head ALiBi bias, SDPA with a per-head mask, stack/unbind: every one on
head-sharded values. HF Gemma 3 writes its q/k norms with type_as. HF Llama with one kv head keeps k and v whole at tp 2 (`replicate`).
Under `column` rules with fewer kv heads than tp, each rank computes only the kv head its q heads use
(passes/tp_subset.py): HF Llama with one kv head at tp 2 and 4, with two at tp 4 (with sequence parallelism),
HF Qwen3 with one kv head, per-head k norm and eager attention at tp 2; with 2 kv heads at tp 3 (no rank's
q heads within one kv head) the pass keeps k and v whole (passes/tp_gqa.py).
tests/models/tp_norms.py normalizes over sharded widths (LayerNorm, RMSNorm) and per head through a split
(as HF StableLM's `qk_layernorm` does, trained too); tests/models/tp_channels.py concatenates sharded q, k, v,
convolves them depthwise and splits them back (Qwen3-Next's linear attention).
HF Phi-3 slices q, k, v out of one fused projection: equal blocks (MHA) and unequal ones (GQA). HF Qwen2-MoE, traced on meta,
counts tokens per expert with histc on int32, which no CPU kernel runs: compiled, it died at step 0
on CPU ranks. The check is test_tp_grads.py's: one SGD step with lr 1, per-tensor update error.
"""

from __future__ import annotations

import pytest

from helpers import ROOT, compile_text, llama_tp_rules, train_parallel
from parc.runtime.verify import train_serial
from parc.trace import load_user_module
from test_tp_grads import PARTIAL_RULES as OPS_RULES  # tp_ops.py names its layers alike
from test_tp_grads import TOL, _per_tensor, _plan

MODELS = ROOT / "tests" / "models"
ATTN_RULES = """tensor_parallel {
    "model.layers.*.self_attn.q_proj" : column
    "model.layers.*.self_attn.k_proj" : column
    "model.layers.*.self_attn.v_proj" : column
    "model.layers.*.self_attn.o_proj" : row
}
"""

MQA_RULES = llama_tp_rules().replace('k_proj" : column', 'k_proj" : replicate').replace(
    'v_proj" : column', 'v_proj" : replicate')

NO_VOCAB = llama_tp_rules().replace('    "model.embed_tokens"              : vocab\n', "").replace(
    '    "lm_head"                         : vocab\n', "")

INDEX_RULES = """tensor_parallel {
    "layers.*.up" : column
    "layers.*.down" : row
}
"""

GQA_RULES = """tensor_parallel {
    "layers.*.q" : column
    "layers.*.k" : column
    "layers.*.v" : column
    "layers.*.o" : row
}
"""

PHI3_RULES = """tensor_parallel {
    "model.layers.*.self_attn.qkv_proj" : column
    "model.layers.*.self_attn.o_proj" : row
    "model.layers.*.mlp.gate_up_proj" : column
    "model.layers.*.mlp.down_proj" : row
}
"""

CHANNEL_RULES = """tensor_parallel {
    "layers.*.qkv" : column
    "layers.*.z" : column
    "layers.*.q" : column
    "layers.*.k" : column
    "layers.*.v" : column
    "layers.*.o" : row
}
"""

CASES = {
    "ops_tp2": (MODELS / "tp_ops.py", OPS_RULES, False, "mesh tp=2"),
    "ops_tp2_sp": (MODELS / "tp_ops.py", OPS_RULES, True, "mesh tp=2"),
    "norms_tp2": (MODELS / "tp_norms.py", OPS_RULES, False, "mesh tp=2"),
    "norms_tp2_sp": (MODELS / "tp_norms.py", OPS_RULES, True, "mesh tp=2"),
    "stablelm_qk_layernorm_tp2": (MODELS / "stablelm_qk_ln.py", llama_tp_rules(), False, "mesh tp=2"),
    "channels_tp2": (MODELS / "tp_channels.py", CHANNEL_RULES, False, "mesh tp=2"),
    "channels_tp2_sp": (MODELS / "tp_channels.py", CHANNEL_RULES, True, "mesh tp=2"),
    "llama_mqa_tp2": (MODELS / "llama_mqa.py", MQA_RULES, False, "mesh tp=2"),
    # k/v `column` with fewer kv heads than tp, dividing it: each rank computes the kv head its q heads use,
    # the weights' gradients summed over tp once a step (Megatron's kv-subset form, passes/tp_subset.py)
    "llama_mqa_subset_tp2": (MODELS / "llama_mqa.py", llama_tp_rules(), False, "mesh tp=2"),
    "llama_mqa_subset_tp4": (MODELS / "llama_mqa.py", llama_tp_rules(), False, "mesh tp=4"),
    "llama_gqa2_subset_tp4_sp": (MODELS / "llama_tiny.py", llama_tp_rules(), True, "mesh tp=4"),
    "qwen3_mqa_eager_subset_tp2": (MODELS / "qwen3_mqa.py", llama_tp_rules(), False, "mesh tp=2"),
    # kv heads repeated by repeat_interleave and by HF's repeat_kv (kv-subset form); tiled (kept whole)
    "gqa_forms_subset_tp4": (MODELS / "gqa_forms.py", GQA_RULES, False, "mesh tp=4"),
    "gqa_tiled_whole_tp4": (MODELS / "gqa_tiled.py", GQA_RULES, False, "mesh tp=4"),
    # fewer kv heads than tp, not dividing it (2 kv heads, tp 3): k/v kept whole by the pass (passes/tp_gqa.py)
    "llama_gqa2_whole_tp3": (MODELS / "llama_gqa6.py", NO_VOCAB, False, "mesh tp=3"),  # vocab 256: not by 3
    "phi3_sliced_qkv_tp2": (MODELS / "phi3_tiny.py", PHI3_RULES, False, "mesh tp=2"),
    "phi3_gqa_sliced_qkv_tp2_sp": (MODELS / "phi3_gqa.py", PHI3_RULES, True, "mesh tp=2"),
    # index_select / select / gather along tokens of a features-sharded value, bmm contracting the features
    "index_tp2": (MODELS / "tp_index.py", INDEX_RULES, False, "mesh tp=2"),
    "gemma3_tp2": (MODELS / "gemma3_tiny.py", llama_tp_rules(), False, "mesh tp=2"),
    "qwen2_moe_dp2": (MODELS / "qwen2_moe_tiny.py", "", False, "mesh dp=2"),
    "qwen2_moe_tp2": (MODELS / "qwen2_moe_tiny.py", ATTN_RULES, False, "mesh tp=2"),
}


@pytest.mark.parametrize("name", CASES)
def test_one_step_equals_serial_per_tensor(tmp_path, name):
    model, rules, sp, mesh = CASES[name]
    text = _plan(rules, sp, mesh) if rules else f"{mesh}\nbatch global=4 micro=2\noptimizer sgd lr=1.0\n"
    art = compile_text(text, tmp_path / "c", model)
    _, state = train_parallel(art.root, steps=1)
    user = load_user_module(art.root / "model" / "model.py")
    _, before = train_serial(user, art.plan, 0, 0)
    _, serial = train_serial(user, art.plan, 0, 1)
    errors = _per_tensor({k: v for k, v in state.items()}, {k: v for k, v in serial.items() if k in state}, before)
    assert set(state) <= set(serial)  # a tied table is stored once, under one of its names
    worst = max(errors, key=errors.get)
    assert errors[worst] < TOL, f"{worst}: {errors[worst]:.2e} ({sorted(errors.items(), key=lambda kv: -kv[1])[:4]})"


def test_integer_histc_made_portable(tmp_path):
    """The program counts experts' tokens in float32 (exact for ids below 2**24) and casts the counts back."""
    art = compile_text("mesh dp=2\nbatch global=4 micro=2\n", tmp_path / "c", MODELS / "qwen2_moe_tiny.py")
    src = (art.root / "programs" / "stage0_tp0.py").read_text()
    lines = [x for x in src.splitlines() if "aten.histc.default(" in x]
    assert lines, "the model's routing counts tokens with histc"
    names = {x.split("aten.histc.default(")[1].split(",")[0] for x in lines}
    for name in names:
        (made,) = [x for x in src.splitlines() if x.strip().startswith(f"{name} = ")]
        assert "_to_copy" in made and "torch.float32" in made, made


PER_HEAD_SCALES = '''
import sys
import torch
sys.path.insert(0, {models!r})
import tp_norms
from tp_norms import get_batch, loss_fn  # noqa: F401


class Scaled(tp_norms.Block):
    def forward(self, x):  # each head of q scaled by its own constant: no per-rank rule for that
        B, T, _ = x.shape
        q = self.q(self.ln(x)).view(B, T, -1, tp_norms.HD).transpose(1, 2)
        q = torch.cat([h * (i + 1) for i, h in enumerate(torch.split(q, 1, dim=1))], dim=1)
        return x + self.o(q.transpose(1, 2).reshape(B, T, -1))


def build_model():
    model = tp_norms.Model()
    model.layers = torch.nn.ModuleList(Scaled() for _ in model.layers)
    return model
'''


def test_a_split_of_the_heads_that_is_not_per_head_norms_is_refused(tmp_path):
    """passes/tp_pieces.py rewrites only split → one norm per head → cat; any other use of one-head pieces of
    a head-sharded value has no per-rank layout parc knows, and is refused at the rule, naming the split."""
    from parc.errors import ParcError

    model = tmp_path / "scaled.py"
    model.write_text(PER_HEAD_SCALES.format(models=str(MODELS)))
    with pytest.raises(ParcError) as e:
        compile_text(_plan(OPS_RULES, False), tmp_path / "c", model)
    assert "split" in e.value.message and "splits sharded dim 1 into [1, 1, 1, 1]" in e.value.message
    assert "layers.0" in e.value.message
    assert '"layers.*.q" : column' in _plan(OPS_RULES, False).splitlines()[e.value.span.line - 1]


TENSOR_SPLIT = '''
import sys
import torch
sys.path.insert(0, {models!r})
import tp_norms
from tp_norms import get_batch, loss_fn  # noqa: F401


class Cut(tp_norms.Block):
    def forward(self, x):  # q cut in two by torch.tensor_split along dim {dim}, the second piece scaled
        B, T, _ = x.shape
        q = self.q(self.ln(x)).view(B, T, -1, tp_norms.HD).transpose(1, 2)  # (B, nh, T, hd)
        a, b = torch.tensor_split(q, [{cut}], dim={dim})
        q = torch.cat([a, 2 * b], dim={dim})
        return x + self.o(q.transpose(1, 2).reshape(B, T, -1))


def build_model():
    model = tp_norms.Model()
    model.layers = torch.nn.ModuleList(Cut() for _ in model.layers)
    return model
'''


def test_tensor_split_along_an_unsharded_dim_keeps_the_shard_and_along_the_sharded_one_is_refused(tmp_path):
    """Qwen3.5's linear attention cuts q, k, v along the sequence with `torch.tensor_split` (passes/tp_layouts.py
    `_tensor_split`): along the tokens (dim 2) of head-sharded q the pieces stay head-sharded and compile; along
    the heads (dim 1) each rank's cut would fall elsewhere in its slice, refused at the rule that sharded q.
    (Trained against serial in the zoo: tests/test_hf_zoo.py's qwen3_5_text with graph rules.)"""
    from parc.errors import ParcError

    along_tokens = tmp_path / "tokens.py"
    along_tokens.write_text(TENSOR_SPLIT.format(models=str(MODELS), dim=2, cut=5))
    compile_text(_plan(OPS_RULES, False), tmp_path / "c1", along_tokens)
    along_heads = tmp_path / "heads.py"
    along_heads.write_text(TENSOR_SPLIT.format(models=str(MODELS), dim=1, cut=1))
    with pytest.raises(ParcError) as e:
        compile_text(_plan(OPS_RULES, False), tmp_path / "c2", along_heads)
    assert "tensor_split" in e.value.message and "cuts sharded dim 1" in e.value.message, e.value.message
    assert '"layers.*.q" : column' in _plan(OPS_RULES, False).splitlines()[e.value.span.line - 1]


def test_kv_subset_sums_the_kv_weights_gradients_once_a_step(tmp_path):
    """The kv-subset form's gradients, as plan.json says them: each k/v weight (and Qwen3's per-head k norm)
    is a per-step sum over tp (`tp_partial_grads`), no activation gradient is all-gathered for them, and rank
    r computes kv head r // (tp / kv heads) (the slice of the weight rows). test_one_step_equals_serial_per_tensor
    (lr 1 SGD, so each update is the gradient) proves those sums make every gradient the serial one."""
    art = compile_text(_plan(llama_tp_rules(), False, "mesh tp=4"), tmp_path / "c", MODELS / "llama_tiny.py")
    for r in range(4):
        prog = art.plan["programs"][f"stage0_tp{r}"]
        kv = {f"p_model_model_layers_{i}_self_attn_{p}_proj_weight" for i in (0, 1) for p in "kv"}
        assert kv <= set(prog["tp_partial_grads"])
        assert not prog["tp_grad_gathers"]
        assert {(x["form"], x["heads"], x["heads_per_rank"]) for x in prog["tp_auto_replicated"]} == {("kv_subset", 2, 1)}
        src = (art.root / prog["file"]).read_text()
        head = r // 2  # 2 kv heads of 16 rows at tp 4: ranks 0, 1 use head 0; ranks 2, 3 head 1
        assert f"slice.Tensor(p_model_model_layers_0_self_attn_k_proj_weight, 0, {16 * head}, {16 * head + 16})" in src
