"""Llama 3.x: the reference `Decoder` (RMSNorm, RoPE with llama3 frequency scaling, GQA, SwiGLU), tied head in
the 1B/3B models, untied in 8B. Nothing here differs from decoder.py; this file holds the presets and HF glue."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtune.models.decoder import Decoder, DecoderConfig
from jaxtune.models.decoder_hf import decoder_from_hf, decoder_hf_map, decoder_to_hf
from jaxtune.models.family import Family
from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import require

_LLAMA3_ROPE = {"theta": 500000.0, "kind": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_len": 8192}

PRESETS = {
    # tests: GQA (4 query heads on 2 key/value heads), dims divide an 8-device mesh
    "tiny": partial(DecoderConfig, family="llama", vocab_size=512, max_seq_len=128, n_layer=2, n_head=4, n_kv_head=2,
                    d_model=64, d_ff=128, rope=Rope(theta=500000.0)),
    "llama3.2-1b": partial(DecoderConfig, family="llama", vocab_size=128256, max_seq_len=131072, n_layer=16,
                           n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, rope=Rope(factor=32.0, **_LLAMA3_ROPE),
                           bos_id=128000, eos_id=128001),
    "llama3.2-3b": partial(DecoderConfig, family="llama", vocab_size=128256, max_seq_len=131072, n_layer=28,
                           n_head=24, n_kv_head=8, d_model=3072, d_ff=8192, rope=Rope(factor=32.0, **_LLAMA3_ROPE),
                           bos_id=128000, eos_id=128001),
    "llama3.1-8b": partial(DecoderConfig, family="llama", vocab_size=128256, max_seq_len=131072, n_layer=32,
                           n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, tie_embeddings=False,
                           rope=Rope(factor=8.0, **_LLAMA3_ROPE), bos_id=128000, eos_id=128001),
}


def from_hf(c: dict[str, Any]) -> DecoderConfig:
    require(c, "hidden_act", ("silu",), "llama")
    bias = bool(c.get("attention_bias", False))
    return decoder_from_hf(c, DecoderConfig, "llama", qkv_bias=bias, o_bias=bias, mlp_bias=bool(c.get("mlp_bias")))


def to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if cfg.qkv_bias != cfg.o_bias or cfg.qk_norm or cfg.sliding_window:
        raise ValueError("this model has features a Llama config.json cannot express (q/k norm, sliding window, "
                         "q/k/v bias without o bias)")
    return decoder_to_hf(cfg, "llama", "LlamaForCausalLM", attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)


FAMILY = Family("llama", DecoderConfig, Decoder, PRESETS, ("llama",), decoder_hf_map(), from_hf, to_hf,
                hf_ignore=("rotary_emb.inv_freq",))
