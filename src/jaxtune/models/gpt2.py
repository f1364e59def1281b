"""GPT-2 (Radford et al. 2019) in Flax NNX: learned positions, pre-LayerNorm, GELU MLP, tied embeddings.

Shapes: B batch, T query length, S key length (cache), D d_model, N heads, H head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.family import Family, Map, RuntimeConfig
from jaxtune.models.hf_fields import classifier_to_hf, sequence_labels
from jaxtune.models.layers import (
    Dense,
    Embed,
    KVCache,
    LayerNorm,
    MaskSpec,
    ScoreHead,
    attention,
    attention_mask,
    cached_attention,
    constrain,
    dropout,
    head_scores,
    kv_cache,
    no_lm_head,
    residual_fence,
    run_layers,
    stack_layers,
    write_kv,
)
from jaxtune.models.unsupported import require


@dataclass(frozen=True)
class GPTConfig(RuntimeConfig):
    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: int | None = None  # default 4 * d_model
    ln_eps: float = 1e-5
    family: str = "gpt2"
    pad_id: int | None = None
    num_labels: int = 0  # 1: a score head instead of the tied LM head (GPT2ForSequenceClassification: a reward model)

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")

    def num_params(self, non_embedding: bool = False) -> int:
        d, f, L = self.d_model, self.ff, self.n_layer
        per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        total = L * per_layer + 2 * d + self.vocab_size * d + self.max_seq_len * d + d * self.num_labels
        return total - (self.vocab_size * d + self.max_seq_len * d if non_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (non-embedding + head matmul) + 12 L D T attention (PaLM appendix B)."""
        n = self.num_params(non_embedding=True) + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layer * self.d_model * seq_len


# Presets are code. Sizes from the GPT-2 paper; `tiny` is for tests (dims divide an 8-device mesh).
_GPT2 = partial(GPTConfig, vocab_size=50257, max_seq_len=1024)
PRESETS = {
    "tiny": partial(GPTConfig, vocab_size=512, max_seq_len=128, n_layer=2, n_head=4, d_model=64),
    # the seed 001 miniGPT (TinyStories): 8 layers, d=512, 8 heads, 256 context
    "minigpt": partial(GPTConfig, vocab_size=50257, max_seq_len=256, n_layer=8, n_head=8, d_model=512),
    "gpt2": partial(_GPT2, n_layer=12, n_head=12, d_model=768),
    "gpt2-124m": partial(_GPT2, n_layer=12, n_head=12, d_model=768),
    "gpt2-355m": partial(_GPT2, n_layer=24, n_head=16, d_model=1024),
    "gpt2-774m": partial(_GPT2, n_layer=36, n_head=20, d_model=1280),
    "gpt2-1.5b": partial(_GPT2, n_layer=48, n_head=25, d_model=1600),
}


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        d, n, h = cfg.d_model, cfg.n_head, cfg.head_dim
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)  # GPT-2: scale residual projections by depth
        self.ln_1 = LayerNorm(d, eps=cfg.ln_eps, param_dtype=pd, dtype=cd)
        # One fused q/k/v matmul; (D, 3, N*H) so tensor parallelism splits whole heads.
        self.qkv = nnx.Param(0.02 * jax.random.normal(rngs.params(), (d, 3, n * h), pd),
                             logical_axes=("embed", None, "heads"))
        self.qkv_bias = nnx.Param(jnp.zeros((3, n * h), pd), logical_axes=(None, "heads"))
        self.attn_out = Dense(n * h, d, ("heads", "embed"), rngs=rngs, std=resid_std, param_dtype=pd, dtype=cd,
                              formulation=cfg.formulation)
        self.ln_2 = LayerNorm(d, eps=cfg.ln_eps, param_dtype=pd, dtype=cd)
        self.fc = Dense(d, cfg.ff, ("embed", "mlp"), rngs=rngs, param_dtype=pd, dtype=cd, formulation=cfg.formulation)
        self.proj = Dense(cfg.ff, d, ("mlp", "embed"), rngs=rngs, std=resid_std, param_dtype=pd, dtype=cd,
                          formulation=cfg.formulation)
        self.cfg = cfg

    def __call__(self, x, mask, key=None, kv=None, index=None):
        """x: (B, T, D); mask: None (causal), (B|1, 1, T, S) or a `RegionMask`. kv: optional `LayerKV`, written at
        slot ``index``. Returns (x, kv)."""
        cfg, cd = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        b, t, _ = x.shape
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        x = residual_fence(x)
        y = self.ln_1(x)
        qkv = jnp.einsum("btd,dkf->btkf", y, self.qkv[...].astype(cd)) + self.qkv_bias[...].astype(cd)
        qkv = qkv.reshape(b, t, 3, cfg.n_head, cfg.head_dim)
        q, k, v = (constrain(qkv[:, :, i], ("batch", "seq", "act_heads", None)) for i in range(3))
        impl = None if cfg.attention == "auto" else cfg.attention
        if kv is not None:
            kv, k, v = write_kv(kv, k, v, index)
            y = cached_attention(q, k.astype(cd), v.astype(cd), mask, impl).reshape(b, t, cfg.d_model)
        else:
            y = attention(q, k.astype(cd), v.astype(cd), mask, impl,
                          formulation=cfg.formulation).reshape(b, t, cfg.d_model)
        y = dropout(self.attn_out(y), cfg.dropout, k_attn)
        x = residual_fence(constrain(x + y, ("batch", "seq", "act_embed")))
        y = self.fc(self.ln_2(x))
        y = constrain(jax.nn.gelu(y, approximate=True), ("batch", "seq", "act_mlp"))
        y = dropout(self.proj(y), cfg.dropout, k_mlp)
        x = constrain(x + y, ("batch", "seq", "act_embed"))
        return x, kv


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        pd, cd = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        self.cfg = cfg
        self.wte = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), rngs=rngs, param_dtype=pd, dtype=cd,
                         formulation=cfg.formulation)
        self.wpe = Embed(cfg.max_seq_len, cfg.d_model, (None, "embed"), rngs=rngs, std=0.01, param_dtype=pd, dtype=cd)
        self.blocks = stack_layers(lambda r, _: Block(cfg, rngs=r), cfg.n_layer, cfg.scan_layers, rngs)
        self.ln_f = LayerNorm(cfg.d_model, eps=cfg.ln_eps, param_dtype=pd, dtype=cd)
        if cfg.num_labels:
            self.score = ScoreHead(cfg.d_model, cfg.num_labels, rngs=rngs, std=0.02, param_dtype=pd, dtype=cd)

    def __call__(self, tokens, positions=None, key=None, cache=None, index=None, key_valid=None, segment_ids=None,
                 return_hidden=False, branch_ids=None, branch_slots=None):
        """tokens: (B, T) int -> logits (B, T, V) in float32.

        positions: (B, T), default 0..T-1. key: dropout PRNG key (None: deterministic).
        cache: a `KVCache` written at slot ``index``; when given, returns
        (logits, new_cache). key_valid: (B, S) which key slots hold real tokens (padding is False).
        segment_ids: (B, T) packed-sequence ids (no attention across segments).
        return_hidden: return the final normalised hidden states (B, T, D) instead of logits (see `logits`).
        branch_ids: (B, T) completions after a shared prompt; branch_slots: (B, G, C), rows in regions: a prompt,
        then G completions of C slots (`jaxtune.models.layers.MaskSpec`).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if positions is None and t > cfg.max_seq_len:  # the position table would yield NaN rows past its end
            raise ValueError(f"{t} tokens exceed the model's context (max_seq_len={cfg.max_seq_len})")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.wte(tokens) + self.wpe(positions)
        if key is not None:
            key, k_embed = jax.random.split(key)
            x = dropout(x, cfg.dropout, k_embed)
        x = constrain(x, ("batch", "seq", "act_embed"))
        mask = attention_mask(MaskSpec.of_forward(t, cache, index, key_valid=key_valid, segment_ids=segment_ids,
                                                  branch_ids=branch_ids, positions=positions,
                                                  branch_slots=branch_slots), cfg.attention == "splash")
        x, cache = run_layers(self.blocks, x, lambda blk, x, k, kv, _: blk(x, mask, k, kv, index),
                              n_layer=cfg.n_layer, scan=cfg.scan_layers, remat=cfg.remat, key=key, cache=cache)
        x = self.ln_f(x)
        out = x if return_hidden else self.logits(x)
        return (out, cache) if cache is not None else out

    def scores(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states (..., D) -> float32 scores (...,) of a reward model's head (``num_labels`` 1)."""
        return head_scores(self, hidden)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states (..., D) -> float32 logits (..., V) through the tied embedding."""
        no_lm_head(self.cfg)
        return constrain(self.wte.attend(hidden).astype(jnp.float32), ("batch", "seq", "act_vocab"))

    def init_cache(self, batch: int, length: int, dtype=None) -> KVCache:
        cfg = self.cfg
        return kv_cache(cfg.n_layer, batch, length, cfg.n_head, cfg.head_dim, dtype or jnp.dtype(cfg.compute_dtype))


# --- HuggingFace: GPT2LMHeadModel (Conv1D weights are already (in, out); c_attn's columns are q | k | v) ---

def _from_hf(c: dict[str, Any]) -> GPTConfig:
    for key, allowed in [("activation_function", ("gelu_new", "gelu_pytorch_tanh")), ("scale_attn_weights", (True,)),
                         ("scale_attn_by_inverse_layer_idx", (False,)), ("reorder_and_upcast_attn", (False,)),
                         ("tie_word_embeddings", (True,))]:
        require(c, key, allowed, "gpt2")
    return GPTConfig(vocab_size=int(c["vocab_size"]), max_seq_len=int(c.get("n_positions", 1024)),
                     n_layer=int(c["n_layer"]), n_head=int(c["n_head"]), d_model=int(c["n_embd"]),
                     d_ff=c.get("n_inner"), ln_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                     bos_id=c.get("bos_token_id"), eos_id=c.get("eos_token_id"), pad_id=c.get("pad_token_id"),
                     num_labels=sequence_labels(c))


def _to_hf(cfg: GPTConfig) -> dict[str, Any]:
    c = _lm_to_hf(cfg)
    return classifier_to_hf(c, "GPT2LMHeadModel") if cfg.num_labels else c


def _lm_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len, "n_embd": cfg.d_model, "n_layer": cfg.n_layer,
            "n_head": cfg.n_head, "n_inner": cfg.d_ff, "layer_norm_epsilon": cfg.ln_eps,
            "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0, "tie_word_embeddings": True, "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
            "pad_token_id": cfg.pad_id, "use_cache": True}


def _hf_map() -> dict[str, Map]:
    h = "transformer.h.{i}."
    m = {"wte.embedding": Map("transformer.wte.weight"), "wpe.embedding": Map("transformer.wpe.weight"),
         "ln_f.scale": Map("transformer.ln_f.weight"), "ln_f.bias": Map("transformer.ln_f.bias"),
         "blocks.{i}.qkv": Map(h + "attn.c_attn.weight", hf_ndim=2),
         "blocks.{i}.qkv_bias": Map(h + "attn.c_attn.bias", hf_ndim=1),
         "score.kernel": Map("score.weight", transpose=True)}
    for ours, theirs in [("ln_1", "ln_1"), ("ln_2", "ln_2")]:
        m[f"blocks.{{i}}.{ours}.scale"] = Map(f"{h}{theirs}.weight")
        m[f"blocks.{{i}}.{ours}.bias"] = Map(f"{h}{theirs}.bias")
    for ours, theirs in [("attn_out", "attn.c_proj"), ("fc", "mlp.c_fc"), ("proj", "mlp.c_proj")]:
        m[f"blocks.{{i}}.{ours}.kernel"] = Map(f"{h}{theirs}.weight")
        m[f"blocks.{{i}}.{ours}.bias"] = Map(f"{h}{theirs}.bias")
    return m


FAMILY = Family("gpt2", GPTConfig, GPT, PRESETS, ("gpt2",), _hf_map(), _from_hf, _to_hf,
                hf_ignore=(".attn.bias", ".attn.masked_bias", "lm_head.weight"))
