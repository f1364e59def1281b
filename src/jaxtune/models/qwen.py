"""Qwen 2.5 and Qwen 3 on the shared `Decoder`. Qwen 2.5: bias on the q/k/v projections (not o).
Qwen 3: no biases, RMSNorm over each head's q and k before RoPE, head_dim set apart from d_model."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtune.models.decoder import Decoder, DecoderConfig
from jaxtune.models.decoder_hf import decoder_from_hf, decoder_hf_map, decoder_to_hf
from jaxtune.models.family import Family
from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import require

# What every released checkpoint of a generation shares; a preset adds its sizes.
_Q25 = partial(DecoderConfig, family="qwen2", qkv_bias=True, norm_eps=1e-6, rope=Rope(theta=1e6), vocab_size=151936,
               max_seq_len=32768, bos_id=151643, eos_id=151645)
_Q3 = partial(DecoderConfig, family="qwen3", qk_norm=True, norm_eps=1e-6, rope=Rope(theta=1e6), head_dim=128,
              vocab_size=151936, max_seq_len=40960, bos_id=151643, eos_id=151645)
_TINY = {"vocab_size": 512, "max_seq_len": 128, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "d_ff": 128,
         "bos_id": None, "eos_id": None}  # tests: GQA, dims that divide an 8-device mesh

QWEN2_PRESETS = {
    "tiny": partial(_Q25, **_TINY),
    "qwen2.5-0.5b": partial(_Q25, n_layer=24, n_head=14, n_kv_head=2, d_model=896, d_ff=4864),
    "qwen2.5-1.5b": partial(_Q25, n_layer=28, n_head=12, n_kv_head=2, d_model=1536, d_ff=8960),
    "qwen2.5-7b": partial(_Q25, n_layer=28, n_head=28, n_kv_head=4, d_model=3584, d_ff=18944, vocab_size=152064,
                          tie_embeddings=False),
}
QWEN3_PRESETS = {
    "tiny": partial(_Q3, **_TINY, head_dim=32),
    "qwen3-0.6b": partial(_Q3, n_layer=28, n_head=16, n_kv_head=8, d_model=1024, d_ff=3072),
    "qwen3-1.7b": partial(_Q3, n_layer=28, n_head=16, n_kv_head=8, d_model=2048, d_ff=6144),
    "qwen3-8b": partial(_Q3, n_layer=36, n_head=32, n_kv_head=8, d_model=4096, d_ff=12288, tie_embeddings=False),
}


def qwen2_from_hf(c: dict[str, Any]) -> DecoderConfig:
    require(c, "hidden_act", ("silu",), "qwen2")
    return decoder_from_hf(c, DecoderConfig, "qwen2", qkv_bias=True)


def qwen3_from_hf(c: dict[str, Any]) -> DecoderConfig:
    require(c, "hidden_act", ("silu",), "qwen3")
    bias = bool(c.get("attention_bias", False))
    return decoder_from_hf(c, DecoderConfig, "qwen3", qk_norm=True, qkv_bias=bias, o_bias=bias)


def sliding_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """Qwen's 4.x sliding-window fields: layers from ``max_window_layers`` on use the window."""
    types = cfg.types
    first = types.index("sliding") if "sliding" in types else cfg.n_layer
    return {"use_sliding_window": "sliding" in types, "max_window_layers": first}


def qwen2_to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if not cfg.qkv_bias or cfg.o_bias or cfg.qk_norm:
        raise ValueError("a Qwen2 config.json has q/k/v bias, no o bias and no q/k norm")
    return decoder_to_hf(cfg, "qwen2", "Qwen2ForCausalLM", **sliding_fields(cfg))


def qwen3_to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if not cfg.qk_norm or cfg.qkv_bias != cfg.o_bias:
        raise ValueError("a Qwen3 config.json has q/k norm and the same bias on q/k/v/o")
    return decoder_to_hf(cfg, "qwen3", "Qwen3ForCausalLM", attention_bias=cfg.qkv_bias, **sliding_fields(cfg))


QWEN2 = Family("qwen2", DecoderConfig, Decoder, QWEN2_PRESETS, ("qwen2",), decoder_hf_map(), qwen2_from_hf,
               qwen2_to_hf, hf_ignore=("rotary_emb.inv_freq",))
QWEN3 = Family("qwen3", DecoderConfig, Decoder, QWEN3_PRESETS, ("qwen3",), decoder_hf_map(), qwen3_from_hf,
               qwen3_to_hf, hf_ignore=("rotary_emb.inv_freq",))
