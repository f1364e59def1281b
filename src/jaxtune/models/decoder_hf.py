"""How the Llama-style decoder (`jaxtune.models.decoder`) shared by Llama, Qwen, Mistral and Gemma 3 maps to
HuggingFace: its tensor names (`decoder_hf_map`) and its config.json both ways (`decoder_from_hf`, `decoder_to_hf`,
with the activation names)."""

from __future__ import annotations

from typing import Any

from jaxtune.models.family import Map
from jaxtune.models.hf_fields import (
    classifier_to_hf,
    layer_types_from_hf,
    layer_types_to_hf,
    rope_from_hf,
    rope_to_hf,
    sequence_labels,
    token_ids_from_hf,
)
from jaxtune.models.unsupported import TORCHAX_HINT, UnsupportedModelError

_L = "model.layers.{i}."


def decoder_hf_map(**renames: str) -> dict[str, Map]:
    """jaxtune `Decoder` param -> HF tensor, in the Llama naming; ``renames`` replaces the HF name of a param
    (Gemma 3 calls its pre-MLP norm ``pre_feedforward_layernorm``)."""
    m = {"embed.embedding": Map("model.embed_tokens.weight"), "norm.scale": Map("model.norm.weight"),
         "lm_head.embedding": Map("lm_head.weight"), "score.kernel": Map("score.weight", transpose=True),
         "layers.{i}.attn_norm.scale": Map(_L + "input_layernorm.weight"),
         "layers.{i}.mlp_norm.scale": Map(_L + "post_attention_layernorm.weight"),
         "layers.{i}.attn.q_norm.scale": Map(_L + "self_attn.q_norm.weight"),
         "layers.{i}.attn.k_norm.scale": Map(_L + "self_attn.k_norm.weight")}
    for ours, theirs in [("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
                         ("attn.o", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                         ("mlp.down", "mlp.down_proj")]:
        m[f"layers.{{i}}.{ours}.kernel"] = Map(f"{_L}{theirs}.weight", transpose=True)
        m[f"layers.{{i}}.{ours}.bias"] = Map(f"{_L}{theirs}.bias")
    for ours, theirs in renames.items():
        m[ours] = Map(_L + theirs if ours.startswith("layers.") else theirs, m[ours].transpose if ours in m else False)
    return m


ACT_FROM_HF = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}
ACT_TO_HF = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def decoder_from_hf(c: dict[str, Any], cls: type, family: str, act_key: str = "hidden_act", **diff: Any):
    """The fields every Llama-style config.json has; ``diff`` is what the family sets differently."""
    act = c.get(act_key, "silu")
    if act not in ACT_FROM_HF:
        raise UnsupportedModelError(f"config.json: {act_key}={act!r} is not supported natively; {TORCHAX_HINT}")
    n_layer = int(c["num_hidden_layers"])
    types = layer_types_from_hf(c, n_layer)
    window = c.get("sliding_window")
    if types is not None and "sliding" not in types:
        window = None
    fields = dict(
        family=family, vocab_size=int(c["vocab_size"]), max_seq_len=int(c.get("max_position_embeddings", 2048)),
        n_layer=n_layer, n_head=int(c["num_attention_heads"]),
        n_kv_head=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], d_model=int(c["hidden_size"]),
        d_ff=int(c["intermediate_size"]), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), mlp_act=ACT_FROM_HF[act],
        rope=rope_from_hf(c, "full_attention"), sliding_window=window,
        layer_types=types if window else None, **token_ids_from_hf(c))
    fields.update(diff)
    return cls(**fields, num_labels=sequence_labels(c))


def decoder_to_hf(cfg: Any, model_type: str, architecture: str, act_key: str = "hidden_act", **extra: Any):
    """A config.json in the transformers 4.x layout (``rope_theta``/``rope_scaling``), which 5.x also reads,
    plus ``layer_types``."""
    c = {"architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.hd,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, act_key: ACT_TO_HF[cfg.mlp_act],
         "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope.theta, "rope_scaling": rope_to_hf(cfg.rope),
         "sliding_window": cfg.sliding_window, "layer_types": layer_types_to_hf(cfg.types),
         "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id, "use_cache": True}
    c.update(extra)
    return classifier_to_hf(c, architecture) if cfg.num_labels else c
