"""Mistral on the shared `Decoder`: Llama's layout with GQA and, when the config sets one, a sliding attention
window on every layer (v0.1: 4096 tokens; v0.3 drops it)."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtune.models.decoder import Decoder, DecoderConfig
from jaxtune.models.decoder_hf import decoder_from_hf, decoder_hf_map, decoder_to_hf
from jaxtune.models.family import Family
from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import require

PRESETS = {
    "tiny": partial(DecoderConfig, family="mistral", vocab_size=512, max_seq_len=128, n_layer=2, n_head=4,
                    n_kv_head=2, d_model=64, d_ff=128, sliding_window=16, tie_embeddings=False),
    "mistral-7b-v0.1": partial(DecoderConfig, family="mistral", vocab_size=32000, max_seq_len=32768, n_layer=32,
                               n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, sliding_window=4096,
                               tie_embeddings=False, bos_id=1, eos_id=2),
    "mistral-7b-v0.3": partial(DecoderConfig, family="mistral", vocab_size=32768, max_seq_len=32768, n_layer=32,
                               n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, rope=Rope(theta=1e6),
                               tie_embeddings=False, bos_id=1, eos_id=2),
}


def from_hf(c: dict[str, Any]) -> DecoderConfig:
    require(c, "hidden_act", ("silu",), "mistral")
    return decoder_from_hf(c, DecoderConfig, "mistral")


def to_hf(cfg: DecoderConfig) -> dict[str, Any]:
    if cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or "full" in cfg.types and cfg.sliding_window:
        raise ValueError("a Mistral config.json has no biases, no q/k norm, and one window for every layer")
    c = decoder_to_hf(cfg, "mistral", "MistralForCausalLM")
    del c["layer_types"]  # transformers 5 reads mistral + layer_types as Ministral; sliding_window says it all
    return c


FAMILY = Family("mistral", DecoderConfig, Decoder, PRESETS, ("mistral",), decoder_hf_map(), from_hf, to_hf,
                hf_ignore=("rotary_emb.inv_freq",))
