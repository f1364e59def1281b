"""Gemma 3 text (Gemma3ForCausalLM: 270M, 1B) on the shared `Decoder`. How it differs from Llama:
embeddings times sqrt(d_model); RMSNorm scales by (1 + w); norms before *and after* attention and the MLP;
RMSNorm over each head's q and k; GeGLU (tanh GELU); attention scale query_pre_attn_scalar^-1/2 with head_dim
set apart from d_model; five sliding-window layers (RoPE base 10k) to one global layer (base 1M, optionally
linearly scaled); a 262k vocabulary with a tied head.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtune.models.decoder import Decoder, DecoderConfig
from jaxtune.models.decoder_hf import decoder_from_hf, decoder_hf_map, decoder_to_hf
from jaxtune.models.family import Family
from jaxtune.models.hf_fields import rope_from_hf
from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import TORCHAX_HINT, UnsupportedModelError, require

_GEMMA3 = partial(DecoderConfig, family="gemma3", norm_eps=1e-6, norm_offset=1.0, qk_norm=True, sandwich_norm=True,
                  mlp_act="gelu_tanh", embed_scale=True, rope=Rope(theta=1e6), local_rope=Rope(theta=10000.0),
                  head_dim=256, query_scale=256 ** -0.5, bos_id=2, eos_id=1, pad_id=0)


def _pattern(n_layer: int, every: int = 6) -> tuple[str, ...]:
    """Five sliding-window layers, then one global, repeated."""
    return tuple("sliding" if (i + 1) % every else "full" for i in range(n_layer))


PRESETS = {
    # tests: one sliding layer (window 16) then one global, decoupled head_dim, GQA
    "tiny": partial(_GEMMA3, vocab_size=512, max_seq_len=128, n_layer=2, n_head=4, n_kv_head=2, d_model=64,
                    head_dim=32, d_ff=128, sliding_window=16, layer_types=("sliding", "full"),
                    query_scale=32 ** -0.5, bos_id=None, eos_id=None, pad_id=None),
    "gemma3-270m": partial(_GEMMA3, vocab_size=262144, max_seq_len=32768, n_layer=18, n_head=4, n_kv_head=1,
                           d_model=640, d_ff=2048, sliding_window=512, layer_types=_pattern(18)),
    "gemma3-1b": partial(_GEMMA3, vocab_size=262144, max_seq_len=32768, n_layer=26, n_head=4, n_kv_head=1,
                         d_model=1152, d_ff=6912, sliding_window=512, layer_types=_pattern(26)),
}


def from_hf(c: dict[str, Any]) -> DecoderConfig:
    if c.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"config.json: use_bidirectional_attention=true (an embedding model) is not a "
                                    f"causal LM; {TORCHAX_HINT}")
    require(c, "hidden_activation", ("gelu_pytorch_tanh",), "gemma3")
    c = {**c, "sliding_window_pattern": c.get("sliding_window_pattern", 6)} if "layer_types" not in c else c
    return decoder_from_hf(
        c, DecoderConfig, "gemma3", act_key="hidden_activation", norm_offset=1.0, qk_norm=True, sandwich_norm=True,
        embed_scale=True, query_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope=rope_from_hf(c, "sliding_attention", default_theta=10000.0),
        rope=rope_from_hf(c, "full_attention", default_theta=1e6),
        # Gemma 3 in transformers keeps attn_logit_softcapping in its config but never applies it (Gemma 2 did):
        # the checkpoint's model is the one without it.
        attn_softcap=None, final_softcap=c.get("final_logit_softcapping"))


def to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if cfg.attn_softcap is not None:
        raise ValueError("Gemma 3 in transformers does not apply an attention logit soft-cap; this model has one")
    scalar = cfg.query_scale ** -2 if cfg.query_scale else cfg.hd
    extra: dict[str, Any] = {}
    types = cfg.types
    if "full" in types:  # 4.x readers want the pattern: the distance between global layers
        every = types.index("full") + 1
        if types == _pattern(cfg.n_layer, every):
            extra["sliding_window_pattern"] = every
    local = cfg.local_rope or cfg.rope
    if local.kind != "default":
        raise ValueError("Gemma 3 config.json has no scaling for the sliding layers' RoPE")
    return decoder_to_hf(cfg, "gemma3_text", "Gemma3ForCausalLM", act_key="hidden_activation",
                         query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                         rope_local_base_freq=local.theta, attn_logit_softcapping=None,
                         final_logit_softcapping=cfg.final_softcap, **extra)


FAMILY = Family("gemma3", DecoderConfig, Decoder, PRESETS, ("gemma3_text",),
                decoder_hf_map(**{"layers.{i}.mlp_norm.scale": "pre_feedforward_layernorm.weight",
                                  "layers.{i}.post_attn_norm.scale": "post_attention_layernorm.weight",
                                  "layers.{i}.post_mlp_norm.scale": "post_feedforward_layernorm.weight"}),
                from_hf, to_hf, hf_ignore=("rotary_emb.inv_freq", "rotary_emb_local.inv_freq"))
