"""The zoo's families: every `transformers` family whose config declares a tensor-parallel plan
(`base_model_tp_plan`) and that has a `…ForCausalLM` class, plus one encoder (EuroBERT, masked LM) and
one vision classifier (ViT), each built from a tiny random config.

Start here: `families()` lists them, `build(name)` builds one, `model_file(name, dir)` writes the parc model
file (docs/model-convention.md) that `parc compile` traces. Nothing is downloaded.

A tiny config is the family's own default config with these fields replaced wherever the config has them:
2 layers, hidden 64, 4 heads of 16, 2 kv heads (GQA where the family has kv heads), intermediate 128, vocab
256, 4 experts of 2 per token (MoE), every dropout 0, and `layer_types` cut to 2 layers that keep one layer of
each kind (a hybrid's attention and state-space layers, a sliding and a full attention). `OVERRIDES` holds what a
family needs on top, with why. A family whose tiny config does not build says why in `Family.error`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 256, 16
IMAGE, PATCH, CLASSES = 32, 8, 10

TINY = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64,
    # MoE: few small experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "expert_intermediate_size": 64,
    "moe_num_experts": 4, "moe_k": 2, "moe_topk": 2, "top_k": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "n_shared_experts": 1,
    # MLA (DeepSeek-V2/V3, MiniCPM3): ranks and head dims that fit hidden 64
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # state-space layers (Mamba/Jamba/Bamba/…): small state, heads that divide the inner width
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "ssm_state_size": 16,
    "mamba_expand": 2, "mamba_d_conv": 4, "conv_kernel": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_experts_per_token": 2, "num_dense_layers": 1, "num_expert_group": 1, "linear_head_dim": 16,
    "linear_num_heads": 4, "layer_group_size": 2,
    # GPT-2-style names (CodeGen, …)
    "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "n_ctx": 64, "n_inner": 128, "rotary_dim": 8,
    "d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 128,
    "sliding_window": 8, "attention_chunk_size": 8, "pad_token_id": 0,
}

# family → fields on top of TINY, with why
OVERRIDES: dict[str, dict] = {
    # Falcon's "new decoder architecture" (Falcon-40B/180B): grouped fused qkv, whose keys and values are
    # selected by list indexing, `qkv[..., [-2], :]`, a constant torch's indexing makes from Python data
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    # Kolibri 1.1: its indexer scores keys with at most the query heads of one kv head (4 // 2 = 2, the default
    # 12 does not validate); its dense MLP layers have their own width (3,584 by default); and its sparse path's
    # local, sink, top-k and pool sizes are set under the 16 tokens so that the selection of keys is run
    "kolibri1_1": {"index_num_heads": 2, "mlp_only_intermediate_size": 128, "index_num_local_tokens": 4,
                   "index_num_sink_tokens": 2, "index_topk": 4, "index_pool_size": 8, "index_compression": 2},
}

# families whose config declares no tensor-parallel plan, kept for what their code exercises:
# model_type → (config class, …ForCausalLM class)
EXTRA = {"falcon": ("FalconConfig", "FalconForCausalLM")}

ENCODER, VISION = "eurobert", "vit"


@dataclass
class Family:
    name: str            # model_type, e.g. "llama"
    config_class: type
    model_class: type    # …ForCausalLM (…ForMaskedLM, …ForImageClassification for the two extras)
    kind: str            # "causal", "masked", "image"
    error: str | None = None  # why its tiny config does not build (then it is not run)


@functools.cache
def families() -> dict[str, Family]:
    """model_type → Family, in the order of transformers' config mapping, then the encoder and the classifier.
    Imports every family's config module and the chosen ones' model modules (~2.5 s); `family(name)` imports
    only one family's."""
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = {}
    for mt in CONFIG_MAPPING_NAMES:
        if mt in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and _tp_plan(mt) is True:
            out[mt] = family(mt)
    for mt in [*EXTRA, ENCODER, VISION]:
        out[mt] = family(mt)
    return out


def held_out() -> list[str]:
    """The causal LMs the zoo leaves out: every family of transformers' causal-LM mapping whose config declares no
    tensor-parallel plan (GPT-2, OPT, BLOOM, BERT as a decoder, Mamba…), in the mapping's order. Their tp rules can
    only come from the graph (`--sources graph`): `python -m bench.zoo.sweep --held-out`."""
    from transformers.models.auto import modeling_auto

    return [mt for mt in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if mt not in EXTRA and _tp_plan(mt) is False]


def _tp_plan(mt: str) -> bool | None:
    """Whether family `mt`'s config declares a tensor-parallel plan (`base_model_tp_plan`); None when this
    transformers has no config class for it."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = getattr(transformers, CONFIG_MAPPING_NAMES.get(mt, ""), None)
    return None if config_class is None else bool(getattr(config_class, "base_model_tp_plan", None))


@functools.cache
def family(name: str) -> Family:
    """One family of `families()`, importing only its own modules: each rank of a zoo run loads the model file,
    which needs one family, and `families()` there cost ~2.5 s a rank (15 s of an 8-rank run's 17 on 2 cores)."""
    import transformers
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if name == ENCODER:
        return Family(ENCODER, transformers.EuroBertConfig, transformers.EuroBertForMaskedLM, "masked")
    if name == VISION:
        return Family(VISION, transformers.ViTConfig, transformers.ViTForImageClassification, "image")
    if name in EXTRA:
        config_name, lm = EXTRA[name]
        return Family(name, getattr(transformers, config_name), getattr(transformers, lm), "causal")
    model_class = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])
    # Llama-4's causal LM is built from its text config, not the composite one the mapping names
    config_class = getattr(model_class, "config_class", None) or getattr(transformers, CONFIG_MAPPING_NAMES[name])
    return Family(name, config_class, model_class, "causal")


def _layer_types(default: list) -> list:
    """Two layers that keep one of each kind, in the order they first appear."""
    kinds = list(dict.fromkeys(default))
    return (kinds + kinds[:1])[:2] if len(kinds) < 2 else kinds[:2]


def tiny_config(name: str):
    fam = family(name)
    if fam.kind == "image":
        return fam.config_class(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                image_size=IMAGE, patch_size=PATCH, num_labels=CLASSES, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    default = fam.config_class()
    have = set(default.to_dict()) | set(vars(default))
    kw = {k: v for k, v in {**TINY, **OVERRIDES.get(name, {})}.items() if k in have}
    for k in have:  # every dropout off: the comparison is exact without keyed masks
        if (k.endswith("dropout") or k.endswith("_pdrop") or k.endswith("dropout_prob")) and \
                isinstance(getattr(default, k, None), float):
            kw[k] = 0.0
    for k in have:  # layer_types, mlp_layer_types, …: two layers, one of each kind
        lt = getattr(default, k, None)
        if k.endswith("layer_types") and isinstance(lt, (list, tuple)) and lt:
            kw[k] = _layer_types(list(lt))
    if "head_dim" in have and "head_dim" not in OVERRIDES.get(name, {}):
        # MLA families (DeepSeek-V3, …) rotate head_dim = qk_rope_head_dim dims
        kw["head_dim"] = kw.get("qk_rope_head_dim", TINY["hidden_size"] // TINY["num_attention_heads"])
    if "qk_rope_head_dim" in kw and "num_key_value_heads" in kw:
        # MLA expands its latent keys and values to every query head: a grouped kv count below the heads
        # is not a configuration these models run with (their meta trace fails on it, their eager CPU
        # forward does not use it), so the tiny config keeps kv heads = heads
        kw["num_key_value_heads"] = kw.get("num_attention_heads", TINY["num_attention_heads"])
    while True:
        try:
            cfg = fam.config_class(**kw)
            break
        except AttributeError as e:  # a derived field (a property without setter): the config computes it
            prop = next((k for k in kw if f"'{k}'" in str(e)), None)
            if prop is None:
                raise
            del kw[prop]
    cfg.tie_word_embeddings = getattr(default, "tie_word_embeddings", False)
    return cfg


MAX_PARAMS = 2_000_000  # a tiny config has ~0.2M; more means a size field under a name TINY does not know


def build(name: str) -> nn.Module:
    """The family's tiny model (on the current default device), sdpa attention where the family has it."""
    fam = family(name)
    cfg = tiny_config(name)
    with torch.device("meta"):  # the size first: a config TINY does not shrink would fill the memory
        try:
            cfg._attn_implementation = "sdpa"
            n = sum(p.numel() for p in fam.model_class(cfg).parameters())
        except (ValueError, NotImplementedError):  # a family without sdpa: eager attention
            cfg._attn_implementation = "eager"
            n = sum(p.numel() for p in fam.model_class(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"the tiny config of {name} still has {n:,} parameters > {MAX_PARAMS:,}: "
                         "its size fields have names bench/zoo/families.py's TINY does not set")
    return fam.model_class(cfg)


def check(name: str) -> str | None:
    """Why the family's tiny model does not build and run one forward on CPU, or None."""
    try:
        torch.manual_seed(0)
        loss = loss_fn(name)(build(name), *get_batch(name)(0, 2))
        if not torch.isfinite(loss):
            return f"loss {loss.item()} on the tiny config"
    except Exception as e:  # noqa: BLE001 — a family that cannot be built is reported, not raised
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return None


# ---------------------------------------------------------------- batches and losses, per kind


def get_batch(name: str):
    kind = family(name).kind

    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(step)
        if kind == "image":
            return (torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g),   # (B, 3, H, W)
                    torch.randint(0, CLASSES, (batch_size,), generator=g))   # (B,)
        seq = torch.randint(1, VOCAB, (batch_size, SEQ + 1), generator=g)   # (B, T+1); 0 is padding
        if kind == "masked":  # every 4th token masked (id 1): predict the original tokens everywhere
            x = seq[:, :-1].clone()
            x[:, ::4] = 1
            return x, seq[:, :-1].contiguous()
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()            # (B, T), (B, T)
    return batch


def loss_fn(name: str):
    fam = family(name)
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(fam.model_class.forward).parameters else {}

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if fam.kind == "image":
            return F.cross_entropy(model(pixel_values=x).logits.float(), y)
        # CE from logits rather than `labels=`: HF shifts labels itself for causal LMs and its loss helper's
        # reduction is not a plain mean over this batch's tokens
        logits = model(input_ids=x, **kwargs).logits  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    return loss


MODEL_FILE = '''"""parc model file for the zoo family `{name}`: bench/zoo/families.py builds it (docs/model-convention.md)."""
import sys
from pathlib import Path

import parc

sys.path.insert(0, str(Path(parc.__file__).resolve().parents[1]))
from bench.zoo import families  # noqa: E402

get_batch = families.get_batch({name!r})
loss_fn = families.loss_fn({name!r})


def build_model():
    return families.build({name!r})
'''


def model_file(name: str, directory: Path) -> Path:
    """Write the family's model file into `directory`; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.py"
    path.write_text(MODEL_FILE.format(name=name))
    return path
