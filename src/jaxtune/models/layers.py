"""Building blocks shared by every model family: math only.

Parameters carry *logical* axis names (``logical_axes=("embed", "mlp")``); `jaxtune.train.sharding` maps them
to mesh axes with one rule table. Activations are constrained at block boundaries with the same names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.train.sharding import constrain

Axes = tuple[str | None, ...]


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


class Dense(nnx.Module):
    """y = x @ W (+ b). ``W`` is (in, out) with logical axes ``axes``; computed in ``dtype``."""

    def __init__(self, d_in: int, d_out: int, axes: Axes, *, rngs: nnx.Rngs, std: float = 0.02,
                 bias: bool = True, param_dtype=jnp.float32, dtype=jnp.float32):
        self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (d_in, d_out), param_dtype),
                                logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype), logical_axes=axes[-1:]) if bias else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(self.dtype) @ self.kernel[...].astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embed(nnx.Module):
    """Token (or position) table (num, dim); ``attend`` reuses it as a tied output head."""

    def __init__(self, num: int, dim: int, axes: Axes, *, rngs: nnx.Rngs, std: float = 0.02,
                 param_dtype=jnp.float32, dtype=jnp.float32):
        self.embedding = nnx.Param(std * jax.random.normal(rngs.params(), (num, dim), param_dtype),
                                   logical_axes=axes)
        self.dtype = dtype

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """(B, T, D) -> (B, T, num) logits against the table."""
        return x.astype(self.dtype) @ self.embedding[...].astype(self.dtype).T


class LayerNorm(nnx.Module):
    """LayerNorm computed in float32 whatever the compute dtype (bf16 variance is too coarse)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, dtype=jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``key`` is None (evaluation) or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, implementation: str | None):
    """Scaled dot-product attention, (B, T, N, H) x (B, S, N, H) -> (B, T, N, H).

    ``mask`` None means plain causal (training); otherwise a boolean (B, 1, T, S) of allowed pairs
    (decoding with a KV cache). Goes through `jax.nn.dot_product_attention`, so GPUs can use cuDNN flash
    attention (``implementation="cudnn"``) while CPUs and TPUs take the XLA path.
    """
    if mask is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)


def cache_mask(key_valid: jax.Array, index: jax.Array, t: int) -> jax.Array:
    """Attention mask for ``t`` new queries written at cache slots ``index .. index+t-1``.

    key_valid: (B, S) which cache slots hold real tokens (left padding is False). Returns (B, 1, t, S):
    query i may attend slot s when the slot is valid and s <= index + i (causal within the cache).
    """
    s = jnp.arange(key_valid.shape[1])
    causal = s[None, :] <= index + jnp.arange(t)[:, None]  # (t, S)
    return (key_valid[:, None, None, :] & causal[None, None]).astype(bool)


def update_cache(cache: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
    """Write (B, t, N, H) ``new`` into (B, S, N, H) ``cache`` at slot ``index``."""
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), index, axis=1)


__all__ = ["Dense", "Embed", "LayerNorm", "attention", "cache_mask", "constrain", "dropout", "update_cache"]
