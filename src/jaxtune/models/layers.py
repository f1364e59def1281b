"""Building blocks shared by every model family: math only.

Parameters carry *logical* axis names (``logical_axes=("embed", "mlp")``); `jaxtune.train.sharding` maps them
to mesh axes with one rule table. Activations are constrained at block boundaries with the same names.
"""

from __future__ import annotations

import math

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
    (decoding with a KV cache). ``implementation="cudnn"`` goes through `jax.nn.dot_product_attention` (cuDNN
    flash attention on GPUs). Otherwise (``None``/``"xla"``) this is the math of that function's XLA path,
    written out, because on CPU (a small GPT-2 train step) two changes pay: no grouped-query vmap (its layout
    copies of the scores cost ~3%), and causal queries in blocks that skip the all-masked keys (~5%).
    """
    if implementation == "cudnn":
        if mask is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    if mask is not None:
        return _attend(q, k, v, mask)
    # Causal: query block i needs keys [0, end of block i] only. Four blocks skip 3/8 of the score matrix;
    # the skipped scores would have been masked to exp(-huge) = 0, so the result is the same.
    t = q.shape[1]
    n = 4 if t % 4 == 0 and t >= 4 * 64 else 1
    size = t // n
    outs = []
    for i in range(n):
        lo, hi = i * size, (i + 1) * size
        s = min(hi, k.shape[1])  # keys past the block's last query are all masked (query i sees keys <= i)
        causal = jnp.arange(s)[None, :] <= jnp.arange(lo, hi)[:, None]  # (size, s)
        outs.append(_attend(q[:, lo:hi], k[:, :s], v[:, :s], causal[None, None]))
    return jnp.concatenate(outs, axis=1) if n > 1 else outs[0]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention of (B, T, N, H) queries over (B, S, N, H) keys where ``mask`` (.., T, S) allows."""
    # bf16 inputs: bf16 products, f32 accumulation, as jax.nn.dot_product_attention does.
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=precision, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / math.sqrt(q.shape[-1]))
    logits = jnp.where(mask, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))  # (B, N, T, S)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@jax.custom_vjp
def residual_fence(x: jax.Array) -> jax.Array:
    """Identity on a residual-stream activation; its gradient is computed once instead of in every consumer.

    The gradient of the residual stream at block ``l`` is a sum over the LayerNorm backward of every later block.
    XLA:CPU fuses that elementwise sum into each of its consumers (weight-gradient transposes, the next sum), so
    block 0 recomputes the whole chain: O(n_layer²) work, ~15% of a small GPT-2 train step on CPU. A conditional
    is a boundary fusion never crosses, so on CPU the backward routes the cotangent through one whose predicate
    is always true but unknown to the compiler. Other platforms keep the plain identity; values never change.
    """
    return x


def _fence_cpu(g: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(g.reshape(-1)[0], jnp.dtype(f"uint{8 * g.dtype.itemsize}"))
    always = (bits | 1) != 0  # true for every bit pattern; the never-taken branch only has to differ from identity
    return jax.lax.cond(always, lambda v: v, jnp.negative, g)


residual_fence.defvjp(
    lambda x: (x, None),
    lambda _, g: (jax.lax.platform_dependent(g, cpu=_fence_cpu, default=lambda v: v),),
)


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


__all__ = ["Dense", "Embed", "LayerNorm", "attention", "cache_mask", "constrain", "dropout", "residual_fence",
           "update_cache"]
