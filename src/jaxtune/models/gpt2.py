"""GPT-2 (Radford et al. 2019) in Flax NNX: learned positions, pre-LayerNorm, GELU MLP, tied embeddings.

Shapes: B batch, T query length, S key length (cache), D d_model, N heads, H head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.layers import (Dense, Embed, LayerNorm, attention, cache_mask, constrain, dropout, residual_fence,
                                   update_cache)

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    max_seq_len: int = 1024
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    d_ff: int | None = None  # default 4 * d_model
    dropout: float = 0.0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    attention: str = "auto"  # auto | xla | cudnn
    ln_eps: float = 1e-5

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")

    # Presets are code. Sizes from the GPT-2 paper; `tiny` is for tests (dims divide an 8-device mesh).
    @classmethod
    def tiny(cls, **kw) -> GPTConfig:
        return cls(**{"vocab_size": 512, "max_seq_len": 128, "n_layer": 2, "n_head": 4, "d_model": 64, **kw})

    @classmethod
    def minigpt(cls, **kw) -> GPTConfig:
        """The seed 001 miniGPT (TinyStories): 8 layers, d=512, 8 heads, 256 context."""
        return cls(**{"vocab_size": 50257, "max_seq_len": 256, "n_layer": 8, "n_head": 8, "d_model": 512, **kw})

    @classmethod
    def gpt2_124m(cls, **kw) -> GPTConfig:
        return cls(**{"n_layer": 12, "n_head": 12, "d_model": 768, **kw})

    @classmethod
    def gpt2_355m(cls, **kw) -> GPTConfig:
        return cls(**{"n_layer": 24, "n_head": 16, "d_model": 1024, **kw})

    @classmethod
    def gpt2_774m(cls, **kw) -> GPTConfig:
        return cls(**{"n_layer": 36, "n_head": 20, "d_model": 1280, **kw})

    @classmethod
    def gpt2_1558m(cls, **kw) -> GPTConfig:
        return cls(**{"n_layer": 48, "n_head": 25, "d_model": 1600, **kw})

    def replace(self, **kw) -> GPTConfig:
        return dataclasses.replace(self, **kw)

    def num_params(self, non_embedding: bool = False) -> int:
        d, f, L = self.d_model, self.ff, self.n_layer
        per_layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        total = L * per_layer + 2 * d + self.vocab_size * d + self.max_seq_len * d
        return total - (self.vocab_size * d + self.max_seq_len * d if non_embedding else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (non-embedding + head matmul) + 12 L D T attention (PaLM appendix B)."""
        n = self.num_params(non_embedding=True) + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layer * self.d_model * seq_len


PRESETS = {
    "tiny": GPTConfig.tiny,
    "minigpt": GPTConfig.minigpt,
    "gpt2": GPTConfig.gpt2_124m,
    "gpt2-124m": GPTConfig.gpt2_124m,
    "gpt2-355m": GPTConfig.gpt2_355m,
    "gpt2-774m": GPTConfig.gpt2_774m,
    "gpt2-1.5b": GPTConfig.gpt2_1558m,
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
        self.attn_out = Dense(n * h, d, ("heads", "embed"), rngs=rngs, std=resid_std, param_dtype=pd, dtype=cd)
        self.ln_2 = LayerNorm(d, eps=cfg.ln_eps, param_dtype=pd, dtype=cd)
        self.fc = Dense(d, cfg.ff, ("embed", "mlp"), rngs=rngs, param_dtype=pd, dtype=cd)
        self.proj = Dense(cfg.ff, d, ("mlp", "embed"), rngs=rngs, std=resid_std, param_dtype=pd, dtype=cd)
        self.cfg = cfg

    def __call__(self, x, key=None, kv=None, index=None, key_valid=None):
        """x: (B, T, D). kv: optional (k, v) caches (B, S, N, H) written at ``index``. Returns (x, kv)."""
        cfg, cd = self.cfg, jnp.dtype(self.cfg.compute_dtype)
        b, t, _ = x.shape
        k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
        x = residual_fence(x)
        y = self.ln_1(x)
        qkv = jnp.einsum("btd,dkf->btkf", y, self.qkv[...].astype(cd)) + self.qkv_bias[...].astype(cd)
        qkv = qkv.reshape(b, t, 3, cfg.n_head, cfg.head_dim)
        q, k, v = (constrain(qkv[:, :, i], ("batch", "seq", "act_heads", None)) for i in range(3))
        mask = None
        if kv is not None:
            kv = (update_cache(kv[0], k, index), update_cache(kv[1], v, index))
            k, v = kv
            mask = cache_mask(key_valid, index, t)
        impl = None if cfg.attention == "auto" else cfg.attention
        y = attention(q, k.astype(cd), v.astype(cd), mask, impl).reshape(b, t, cfg.d_model)
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
        self.wte = Embed(cfg.vocab_size, cfg.d_model, ("vocab", "embed"), rngs=rngs, param_dtype=pd, dtype=cd)
        self.wpe = Embed(cfg.max_seq_len, cfg.d_model, (None, "embed"), rngs=rngs, std=0.01, param_dtype=pd, dtype=cd)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.n_layer)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r):
                return Block(cfg, rngs=r)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = LayerNorm(cfg.d_model, eps=cfg.ln_eps, param_dtype=pd, dtype=cd)

    def __call__(self, tokens, positions=None, key=None, cache=None, index=None, key_valid=None):
        """tokens: (B, T) int -> logits (B, T, V) in float32.

        positions: (B, T), default 0..T-1. key: dropout PRNG key (None: deterministic).
        cache: {"k", "v"}: (L, B, S, N, H) KV cache written at slot ``index`` with ``key_valid`` (B, S);
        when given, returns (logits, new_cache).
        """
        cfg = self.cfg
        b, t = tokens.shape
        if t > cfg.max_seq_len:  # the position table would silently yield NaN rows past its end
            raise ValueError(f"{t} tokens exceed the model's context (max_seq_len={cfg.max_seq_len})")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        x = self.wte(tokens) + self.wpe(positions)
        if key is not None:
            key, k_embed = jax.random.split(key)
            x = dropout(x, cfg.dropout, k_embed)
        x = constrain(x, ("batch", "seq", "act_embed"))

        policy = REMAT_POLICIES[cfg.remat]

        def run_block(block, x, layer_key, kv):
            return block(x, layer_key, kv, index, key_valid)

        if cfg.remat != "none":
            run_block = nnx.remat(run_block, policy=policy)

        layer_keys = None if key is None else jax.random.split(key, cfg.n_layer)
        kvs = None if cache is None else (cache["k"], cache["v"])
        if cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def scan_fn(block, x, layer_key, kv):
                return run_block(block, x, layer_key, kv)

            x, kvs = scan_fn(self.blocks, x, layer_keys, kvs)
        else:
            for i, block in enumerate(self.blocks):
                x, kv = run_block(block, x, None if key is None else layer_keys[i],
                                  None if kvs is None else (kvs[0][i], kvs[1][i]))
                if kvs is not None:  # write the layer back in place (the cache is donated while decoding)
                    kvs = (kvs[0].at[i].set(kv[0]), kvs[1].at[i].set(kv[1]))
        logits = self.wte.attend(self.ln_f(x)).astype(jnp.float32)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
        if cache is not None:
            return logits, {"k": kvs[0], "v": kvs[1]}
        return logits

    def init_cache(self, batch: int, length: int, dtype=None) -> dict[str, jax.Array]:
        cfg = self.cfg
        shape = (cfg.n_layer, batch, length, cfg.n_head, cfg.head_dim)
        dtype = dtype or jnp.dtype(cfg.compute_dtype)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
