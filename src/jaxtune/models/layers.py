"""Building blocks shared by every model family: math only.

Parameters carry *logical* axis names (``logical_axes=("embed", "mlp")``); `jaxtune.sharding` maps them
to mesh axes with one rule table. Activations are constrained at block boundaries with the same names.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtune.models.kernels import BlockMask, kernel_takes, splash_attention
from jaxtune.models.quantize import dequantize, is_quantized
from jaxtune.sharding import constrain, sharded

Axes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on the projections named in ``targets`` (PEFT's LoRA): ``y = W x + s B A drop(x)``
    with ``s = alpha / rank``, A (in, rank) uniform(±1/sqrt(in)) like PEFT's kaiming init, B (rank, out) zeros."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def on(self, name: str) -> LoraSpec | None:
        """This spec for projection ``name`` when it is a target, else None."""
        return self if name in self.targets else None


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix. With adapters, these are the only parameters that train."""


_FROZEN_AS_SHAPES = contextvars.ContextVar("frozen_as_shapes", default=False)


@contextlib.contextmanager
def frozen_as_shapes() -> Iterator[None]:
    """Models built inside give their frozen kernels and tables (`nnx.Param`, drawn at random) as shapes only, each
    key still drawn in turn: the trained group (LoRA's adapters, a score head) gets the values a full build gives
    it, without the base's draws (`jaxtune.models.registry.init_trained`)."""
    token = _FROZEN_AS_SHAPES.set(True)
    try:
        yield
    finally:
        _FROZEN_AS_SHAPES.reset(token)


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float, dtype) -> jax.Array | jax.ShapeDtypeStruct:
    """``std`` x a standard normal draw of ``shape``, for a frozen-when-adapted weight (a shape only inside
    `frozen_as_shapes`)."""
    if _FROZEN_AS_SHAPES.get():
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    return std * jax.random.normal(key, shape, dtype)


class ScoreHead(nnx.Module):
    """HF's ``score`` of a *ForSequenceClassification model: (D, labels), no bias. Its weight is a `LoRAParam`, so a
    LoRA run trains it with the adapters (PEFT's ``modules_to_save``: a fresh head cannot stay frozen)."""

    def __init__(self, d_model: int, labels: int, *, rngs: nnx.Rngs, std: float, param_dtype, dtype):
        self.kernel = LoRAParam(std * jax.random.normal(rngs.params(), (d_model, labels), param_dtype),
                                logical_axes=("embed", None))
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return (x.astype(self.dtype) @ self.kernel[...].astype(self.dtype)).astype(jnp.float32)


def head_scores(model: nnx.Module, hidden: jax.Array) -> jax.Array:
    """A family model's ``scores``: final hidden states (..., D) -> float32 scores (...,) of its score head."""
    if not model.cfg.num_labels:
        raise ValueError("this model has a language-model head, not a score head (num_labels=0)")
    return model.score(hidden)[..., 0]


def no_lm_head(cfg) -> None:
    """A family model's ``logits`` refuse a reward model (``num_labels`` 1): it has a score head instead."""
    if cfg.num_labels:
        raise ValueError("a reward model (a score head, num_labels=1) has no language-model head: it scores "
                         "sequences, it does not predict tokens")


class Dense(nnx.Module):
    """y = x @ W (+ b) (+ LoRA). ``W`` is (in, out) with logical axes ``axes``; computed in ``dtype``.

    ``lora``: adapters ``lora_a`` (in, r) and ``lora_b`` (r, out), float32 whatever ``param_dtype``, sharded
    along ``W``'s in and out axes so they sit with their base weight."""

    def __init__(self, d_in: int, d_out: int, axes: Axes, *, rngs: nnx.Rngs, std: float = 0.02,
                 bias: bool = True, param_dtype=jnp.float32, dtype=jnp.float32, lora: LoraSpec | None = None,
                 formulation: int = 1):
        self.formulation = formulation  # 1, 2: `matmul`'s gradients; 0: autodiff's (model.formulation)
        self.kernel = nnx.Param(normal_init(rngs.params(), (d_in, d_out), std, param_dtype), logical_axes=axes)
        self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype), logical_axes=axes[-1:]) if bias else None
        self.dtype = dtype
        self.lora = lora
        if lora is not None:
            bound = 1.0 / math.sqrt(d_in)
            self.lora_a = LoRAParam(jax.random.uniform(rngs.params(), (d_in, lora.rank), jnp.float32, -bound, bound),
                                    logical_axes=(axes[0], "lora_rank"))
            self.lora_b = LoRAParam(jnp.zeros((lora.rank, d_out), jnp.float32), logical_axes=("lora_rank", axes[-1]))

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``key``: LoRA dropout (None: none)."""
        kernel = self.kernel.get_value()  # an array, or QLoRA's quantized kernel (`jaxtune.models.quantize`)
        weight = dequantize(kernel, self.dtype) if is_quantized(kernel) else kernel.astype(self.dtype)
        x = x.astype(self.dtype)
        y = matmul(x, weight, self.formulation) if self.formulation >= 1 else x @ weight
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + low_rank(dropout(x, self.lora.dropout, key).astype(self.dtype), self.lora_a[...].astype(self.dtype),
                             self.lora_b[...].astype(self.dtype), self.lora.scale)
        return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x: jax.Array, w: jax.Array, formulation: int = 1) -> jax.Array:
    """x @ w for x (..., in) and w (in, out), the product of every `Dense` and of a tied or untied output head
    (``model.formulation`` 1 and 2).

    The same products as autodiff's gradient, with the weight's written so that XLA:CPU transposes the smaller
    operand, alone. Its dots read the left operand with the contracted (token) axis last, so whichever of x and dy
    is written first gets transposed, and XLA fuses that transpose into the elementwise work computing it, which
    then writes with a stride (9-37 ms for 5-8 MB of floats against ~1 ms for the transpose alone). Autodiff
    computes (out, in) = dyᵀ x and transposes that. Formulation 1: dW = xᵀ dy (in, out) directly, the activation
    transposed: an MLP's forward and backward at SmolLM2-135M's shapes (784 tokens) went from 90 to 63 ms on 2 Zen
    4 cores (PyTorch eager: 72). Formulation 2: that, unless the output is narrower than the input (an MLP's down
    projection, GPT-2's 1024 -> 256; a tied head's transposed table): then dW = (dyᵀ x)ᵀ, the narrow gradient
    transposed instead of the wide activation (and of the logits' gradient for a head). GPT-2's step at
    `benchmarks/cpu_step.py`'s shapes: 626 -> 572 ms (benchmarks/RESULTS.md)."""
    return x @ w


def _matmul_bwd(formulation, res, dy):
    x, w = res
    lead = tuple(range(x.ndim - 1))  # every token axis, contracted
    if formulation >= 2 and dy.shape[-1] < x.shape[-1]:
        dw = jax.lax.dot_general(dy, x, ((lead, lead), ((), ()))).T
    else:
        dw = jax.lax.dot_general(x, dy, ((lead, lead), ((), ())))
    return dy @ w.T.astype(dy.dtype), dw.astype(w.dtype)


matmul.defvjp(lambda x, w, formulation: (x @ w, (x, w)), _matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale * (x @ a) @ b: x (..., in), a (in, r), b (r, out) -> (..., out). The gradient is written out so
    that only the rank-r operands are transposed: left to autodiff, XLA:CPU transposes the (tokens, out)
    output gradient for dB, about 15% of a LoRA step (benchmarks/RESULTS.md)."""
    return (x @ a) @ b * jnp.asarray(scale, x.dtype)


def _low_rank_fwd(x, a, b, scale):
    h = x @ a
    return h @ b * jnp.asarray(scale, x.dtype), (x, a, b, h)


def _low_rank_bwd(scale, res, dy):
    x, a, b, h = res
    x2, h2 = x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1]) * jnp.asarray(scale, dy.dtype)
    db = h2.T @ dy2  # (r, out)
    dh = dy2 @ b.T  # (N, r)
    da = (dh.T @ x2).T  # (in, r)
    dx = (dh @ a.T).reshape(x.shape)
    return dx, da.astype(a.dtype), db.astype(b.dtype)


low_rank.defvjp(_low_rank_fwd, _low_rank_bwd)


class Embed(nnx.Module):
    """Token (or position) table (num, dim); ``attend`` reuses it as an output head (tied or not), whose gradient
    is `matmul`'s from ``formulation`` 2 (the hidden states transposed, not the logits' gradient)."""

    def __init__(self, num: int, dim: int, axes: Axes, *, rngs: nnx.Rngs, std: float = 0.02,
                 param_dtype=jnp.float32, dtype=jnp.float32, formulation: int = 1):
        self.embedding = nnx.Param(normal_init(rngs.params(), (num, dim), std, param_dtype), logical_axes=axes)
        self.dtype = dtype
        self.formulation = formulation

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """(B, T, D) -> (B, T, num) logits against the table."""
        x, table = x.astype(self.dtype), self.embedding[...].astype(self.dtype).T
        return matmul(x, table, self.formulation) if self.formulation >= 2 else x @ table


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


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + w), computed in float32. Llama/Qwen/Mistral: offset 0, w initialised to 1;
    Gemma: offset 1, w initialised to 0 (its checkpoints store w, and apply 1 + w)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, offset: float = 0.0, param_dtype=jnp.float32,
                 dtype=jnp.float32):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype), logical_axes=("norm",))
        self.eps, self.offset, self.dtype = eps, offset, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), -1, keepdims=True) + self.eps)
        return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding frequencies. ``kind``: ``default``; ``linear`` (positions / factor);
    ``llama3`` (Llama 3.1 band-wise scaling of low frequencies, with ``original_max_len``)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192

    KINDS = ("default", "linear", "llama3")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"rope kind {self.kind!r} is not supported natively (supported: {', '.join(self.KINDS)})")

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """(head_dim/2,) float32 inverse frequencies, computed in float32 as transformers does."""
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        inv = (np.float32(1.0) / np.power(np.float32(self.theta), exponent)).astype(np.float32)
        if self.kind == "linear":
            inv = inv / np.float32(self.factor)
        elif self.kind == "llama3":
            low_wavelen = self.original_max_len / self.low_freq_factor
            high_wavelen = self.original_max_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_len / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        return inv.astype(np.float32)

    def sincos(self, positions: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
        """positions (B, T) -> (cos, sin), each (B, T, 1, head_dim) float32 (half-split layout)."""
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(self.inv_freq(head_dim))
        emb = jnp.concatenate([freqs, freqs], -1)[:, :, None, :]
        return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate (B, T, N, H) ``x`` by position: x cos + rotate_half(x) sin (the half-split convention of HF)."""
    h = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., h:], x[..., :h]], -1)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Which constraints a forward pass's attention obeys, one field each (None: it does not apply);
    `attention_mask` turns it into the mask. ``queries`` new tokens sit at key slots ``index`` .. index + queries - 1
    of ``keys`` (a KV cache's slots; without one, the queries' own), and a query sees the keys

    - at or before its own slot (causal, always);
    - within ``window`` of it (query - key < window, the transformers convention), in slots, or with branches in
      ``positions`` (B, T), which continue the prompt's in every branch;
    - that hold real tokens (``key_valid`` (B, S));
    - of its own packed sequence (``segment_ids`` (B, T), T = S);
    - of the shared prompt (branch 0) or of its own branch (``branch_ids`` (B, T): rows whose sequences share a
      prompt, `jaxtune.config.kinds.BatchKind.shares_prompt`).

    ``branch_slots`` (B, G, C): rows in regions, a prompt then G completions of C slots (a `RegionMask`).
    Plain causal attention is None, the attention's fast path, unless ``explicit``."""

    queries: int
    keys: int
    index: jax.Array | int = 0
    window: int | None = None
    key_valid: jax.Array | None = None
    segment_ids: jax.Array | None = None
    branch_ids: jax.Array | None = None
    positions: jax.Array | None = None
    branch_slots: jax.Array | None = None
    explicit: bool = False

    @classmethod
    def of_forward(cls, t: int, cache: KVCache | None, index, *, key_valid=None, segment_ids=None, branch_ids=None,
                   positions=None, branch_slots=None) -> MaskSpec:
        """The constraints of a model's forward pass over ``t`` new tokens, from its arguments. With a ``cache``,
        the queries are written at slot ``index`` of its S slots and the mask is explicit (no branches: a cache
        holds one sequence per row, or with ``segment_ids`` a packed prefill of the whole cache at once)."""
        if cache is None:
            return cls(t, t, key_valid=key_valid, segment_ids=segment_ids, branch_ids=branch_ids, positions=positions,
                       branch_slots=branch_slots)
        return cls(t, cache.slots, index, key_valid=key_valid, segment_ids=segment_ids, explicit=True)


class RegionMask(NamedTuple):
    """The attention of a row laid out in regions (`jaxtune.rollout.rollout.region_rows`): a prompt of P slots, then
    G completions of C slots each, every completion after the same prompt. A prompt query sees the prompt's earlier
    keys; a completion's query sees the prompt's keys and its own completion's earlier ones, never another
    completion's. So the attention is computed per region, (P x P) + G x (C x (P + C)) scores, where a dense mask over
    the row would compute (P + G C)^2 and throw most away. ``prompt`` (B, 1, P, P) and ``branches`` (B, G, 1, 1, C,
    P + C) are the allowed pairs (padding, windows); the shapes carry P, G and C."""

    prompt: jax.Array
    branches: jax.Array


def attention_mask(spec: MaskSpec, blocks: bool = False) -> jax.Array | RegionMask | BlockMask | None:
    """The mask of ``spec``: None for plain causal attention (not ``explicit``), a `RegionMask` for rows in regions,
    with ``blocks`` a `BlockMask` (a kernel's: `jaxtune.models.kernels`) where the mask is causal, packed and
    windowed only over a length the kernel takes, else a boolean (B|1, 1, T, S) of allowed (query, key) pairs."""
    if spec.branch_slots is not None:
        return _region_mask(spec)
    if blocks and not spec.explicit and spec.key_valid is None and spec.branch_ids is None \
            and kernel_takes(spec.queries):
        return BlockMask(spec.segment_ids, spec.window)
    if not spec.explicit and spec.window is None and spec.key_valid is None and spec.segment_ids is None \
            and spec.branch_ids is None:
        return None
    q_slots, k_slots = spec.index + jnp.arange(spec.queries), jnp.arange(spec.keys)
    window, branches = spec.window, spec.branch_ids
    mask = k_slots[None, :] <= q_slots[:, None]
    if window is not None and branches is None:
        mask = mask & (q_slots[:, None] - k_slots[None, :] < window)
    mask = mask[None, None]
    if spec.key_valid is not None:
        mask = mask & spec.key_valid[:, None, None, :]
    if spec.segment_ids is not None:
        mask = mask & (spec.segment_ids[:, None, :, None] == spec.segment_ids[:, None, None, :])
    if branches is not None:
        q, k = branches[:, None, :, None], branches[:, None, None, :]
        mask = mask & ((k == 0) | (k == q))
        if window is not None:
            mask = mask & (spec.positions[:, None, :, None] - spec.positions[:, None, None, :] < window)
    return mask


def _region_mask(spec: MaskSpec) -> RegionMask:
    """The `RegionMask` of rows of T = P + G C slots: ``branch_slots`` (B, G, C) > 0 where a completion's slot holds
    a real token, ``segment_ids`` (B, T) > 0 where any slot does (the prompt's), ``positions`` (B, T) each slot's
    position (a completion's continue its prompt's), which a sliding ``window`` is measured in."""
    segment_ids, positions, window = spec.segment_ids, spec.positions, spec.window
    b, g, c = spec.branch_slots.shape
    p = segment_ids.shape[1] - g * c
    prompt_valid, real = segment_ids[:, :p] > 0, spec.branch_slots > 0
    prompt = attention_mask(MaskSpec(p, p, window=window, key_valid=prompt_valid))
    own = (jnp.arange(c)[None, :] <= jnp.arange(c)[:, None])[None, None] & real[:, :, None, :]  # (B, G, C, C)
    branches = jnp.concatenate([jnp.broadcast_to(prompt_valid[:, None, None, :], (b, g, c, p)), own], -1)
    if window is not None:
        at = positions[:, p:].reshape(b, g, c)
        keys = jnp.concatenate([jnp.broadcast_to(positions[:, None, :p], (b, g, p)), at], -1)  # (B, G, P + C)
        branches = branches & (at[..., :, None] - keys[..., None, :] < window)
    return RegionMask(prompt, branches[:, :, None, None])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, implementation: str | None, *,
              scale: float | None = None, softcap: float | None = None, formulation: int = 1):
    """Scaled dot-product attention, (B, T, N, H) x (B, S, K, H) -> (B, T, N, H); K divides N (grouped-query).

    ``mask`` None means plain causal (training); otherwise a boolean (B|1, 1, T, S) of allowed pairs (windows,
    padding, packed segments, a KV cache). A fully masked query row gets a uniform average, never NaN.
    ``scale`` defaults to 1/sqrt(H); ``softcap`` applies cap * tanh(logits / cap) (Gemma 2 style).
    Under a context axis (``mesh.context``: queries sharded along the sequence) the keys and values are gathered
    whole, so each device computes its queries' rows of the scores; the result is the unsharded one.
    ``implementation="cudnn"`` goes through `jax.nn.dot_product_attention` (cuDNN flash attention on GPUs); a
    `BlockMask` (``model.attention: splash``) through the Pallas TPU kernel (`jaxtune.models.kernels`).
    Otherwise (``None``/``"xla"``) this is the math of that function's XLA path, written out, because on CPU (a
    small GPT-2 train step) two changes pay: no grouped-query vmap (its layout copies of the scores cost ~3%),
    and causal queries in blocks that skip the all-masked keys (~5%). ``formulation`` 1 (``model.formulation``) lays
    the heads out before the positions (`_attend`); 0 is the earlier layout (`_attend_positions_first`), the same
    math to float rounding, kept so that a run saved before it resumes bitwise.
    """
    attend = _attend if formulation >= 1 else _attend_positions_first
    if isinstance(mask, BlockMask):
        return splash_attention(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, softcap)
    ways = sharded("seq")
    split = ways > 1 and q.shape[1] % ways == 0  # a decoding step's one query is not split: its keys stay split
    if split:  # context parallelism: each device's queries attend over the whole sequence's keys and values
        k, v = (constrain(x, ("batch", None, "act_kv_heads", None)) for x in (k, v))
    if isinstance(mask, RegionMask):
        return _attend_regions(q, k, v, mask, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, softcap,
                               attend)
    if implementation == "cudnn" and softcap is None:
        if mask is None:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=implementation)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=implementation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    chunks = query_chunks(q.shape[0], q.shape[1] // (ways if split else 1), q.shape[2], k.shape[1])
    if chunks > 1:  # long sequences: a chunk of the queries' scores at a time
        return _attend_in_chunks(q, k, v, mask, scale, softcap, ways if split else 1, chunks, attend)
    if mask is not None:
        return attend(q, k, v, mask, scale, softcap)
    # Causal: query block i needs keys [0, end of block i] only. Four blocks skip 3/8 of the score matrix;
    # the skipped scores would have been masked to exp(-huge) = 0, so the result is the same.
    t = q.shape[1]
    n = 4 if t % 4 == 0 and t >= 4 * 64 and not split else 1  # blocks would cut across the context shards
    size = t // n
    outs = []
    for i in range(n):
        lo, hi = i * size, (i + 1) * size
        s = min(hi, k.shape[1])  # keys past the block's last query are all masked (query i sees keys <= i)
        causal = jnp.arange(s)[None, :] <= jnp.arange(lo, hi)[:, None]  # (size, s)
        outs.append(attend(q[:, lo:hi], k[:, :s], v[:, :s], causal[None, None], scale, softcap))
    return jnp.concatenate(outs, axis=1) if n > 1 else outs[0]


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> jax.Array:
    """Softmax attention of (B, T, N, H) queries over (B, S, K, H) keys where ``mask`` (.., 1, T, S) allows.

    Computed head-major: queries as (B, K, T G, H) (a key/value head's G query heads, grouped-query), keys and
    values as (B, K, S, H), so every product of the forward and of its gradient is a batched matrix product over
    the leading (B, K) with the scores (B, K, T G, S) in the layout each one reads. Only the small operands are
    transposed. With the heads after the positions, XLA:CPU transposed the (B, K, G T, S) scores and their
    gradient for the backward's products: on 2 Zen 4 cores one layer's forward and backward at SmolLM2-135M's heads
    (4 rows of 260) took 37 ms, head-major 19 (PyTorch's sdpa 17; benchmarks/RESULTS.md)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    # bf16 inputs: bf16 products, f32 accumulation, as jax.nn.dot_product_attention does.
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    g = n // kh
    # (B, K, T G, H): a position's G query heads side by side, so that a sequence split over devices (the context
    # axis, on T) stays split over the merged axis
    qg = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, S, H)
    logits = jnp.einsum("bkqh,bksh->bkqs", qg, k, precision=precision, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    fill = jnp.float32(-0.7 * jnp.finfo(jnp.float32).max)
    logits = jnp.where(jnp.repeat(mask, g, axis=2), logits, fill)  # a query's mask row for each of its G heads
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v)
    return out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _attend_positions_first(q, k, v, mask, scale: float, softcap: float | None) -> jax.Array:
    """`_attend` as it was before ``model.formulation`` 1: the products read the heads after the positions
    (slower on CPU, the same values to float rounding), for runs saved before then."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    if kh == n:
        logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=precision, preferred_element_type=jnp.float32)
    else:  # grouped: (B, T, K, G, H) queries share each key/value head
        qg = q.reshape(b, t, kh, n // kh, h)
        logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=precision, preferred_element_type=jnp.float32)
        logits = logits.reshape(b, n, t, k.shape[1])
    logits = logits * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))  # (B, N, T, S)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    if kh == n:
        return jnp.einsum("bnts,bsnh->btnh", probs, v)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.reshape(b, kh, n // kh, t, -1), v)
    return out.reshape(b, t, n, h)


SCORES_BUDGET = 1 << 30  # bytes of float32 attention scores a device holds at once (1 GiB)
MIN_QUERY_CHUNK = 128  # the fewest queries a chunk holds


def query_chunks(batch: int, queries: int, heads: int, keys: int) -> int:
    """How many chunks a device scores its ``queries`` in: 1 while its float32 scores (its share of ``batch`` rows
    and of ``heads`` as the mesh splits them, x queries x keys) fit SCORES_BUDGET, else the fewest halvings that fit
    (chunks of at least MIN_QUERY_CHUNK queries that divide them)."""
    rows, heads = -(-batch // sharded("batch")), -(-heads // sharded("act_heads"))
    n = 1
    while (rows * heads * queries * keys * 4 > SCORES_BUDGET * n and queries % (2 * n) == 0
           and queries // (2 * n) >= MIN_QUERY_CHUNK):
        n *= 2
    return n


def _attend_in_chunks(q, k, v, mask: jax.Array | None, scale: float, softcap: float | None, ways: int,
                      n: int, attend=None) -> jax.Array:
    """`_attend` ``n`` chunks of queries at a time (`jax.lax.map`, each chunk rematerialised in the backward pass),
    so that one chunk's (rows, heads, queries / n, keys) scores are alive, never the whole (T, S) matrix; each
    query's softmax is over all its keys, so the result is the one-pass one. ``ways``: how many devices the
    queries are split over (the context axis): each device's own queries are chunked (a chunk takes the j-th of
    every device's), so nothing moves between devices. ``mask`` None is causal, made per chunk from positions."""
    b, t, heads, h = q.shape
    s, local = k.shape[1], t // ways
    c = local // n
    qs = jnp.moveaxis(q.reshape(b, ways, n, c, heads, h), 2, 0)  # (n, B, ways, C, N, H)
    ms = None if mask is None else jnp.moveaxis(mask.reshape(*mask.shape[:2], ways, n, c, s), 3, 0)

    def chunk(j, qj, mj):
        qj = constrain(qj.reshape(b, ways * c, heads, h), ("batch", "seq", "act_heads", None))
        if mj is None:  # causal: the chunk's queries are, on device w, positions w * local + j * c + [0, c)
            at = (jnp.arange(ways)[:, None] * local + j * c + jnp.arange(c)[None, :]).reshape(-1)
            mj = (jnp.arange(s)[None, :] <= at[:, None])[None, None]
        else:
            mj = mj.reshape(*mj.shape[:2], ways * c, s)
        return (attend or _attend)(qj, k, v, mj, scale, softcap)

    body = jax.checkpoint(lambda args: chunk(*args))
    out = jax.lax.map(body, (jnp.arange(n), qs, ms))  # (n, B, ways * C, N, H)
    return jnp.moveaxis(out.reshape(n, b, ways, c, heads, h), 0, 2).reshape(b, t, heads, h)


def _attend_regions(q, k, v, mask: RegionMask, scale: float, softcap: float | None, attend=None) -> jax.Array:
    """`_attend` over a row in regions (`RegionMask`): the prompt's queries over its keys, then each completion's
    queries over the prompt's keys (not copied per completion) and its own, under one softmax."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g, c = mask.branches.shape[1], mask.branches.shape[-2]
    p = t - g * c
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)
    qc = q[:, p:].reshape(b, g, c, kh, n // kh, h)
    kp, vp = k[:, :p], v[:, :p]
    kc, vc = (x[:, p:].reshape(b, g, c, kh, h) for x in (k, v))
    logits = jnp.concatenate([dot("bgckrh,bpkh->bgkrcp", qc, kp), dot("bgckrh,bgskh->bgkrcs", qc, kc)], -1)
    logits = logits * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask.branches, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # (B, G, K, R, C, P + C)
    out = jnp.einsum("bgkrcp,bpkh->bgckrh", probs[..., :p], vp) + jnp.einsum("bgkrcs,bgskh->bgckrh",
                                                                             probs[..., p:], vc)
    out = out.reshape(b, g * c, n, h)
    if p == 0:
        return out
    return jnp.concatenate([(attend or _attend)(q[:, :p], kp, vp, mask.prompt, scale, softcap), out], axis=1)


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


class KVCache(NamedTuple):
    """A model's KV cache, every layer's (`run_layers` hands each layer the whole stack as a `LayerKV`): the keys
    ``k`` (L, B, K, H, S) with the slots last and the values ``v`` (L, B, K, S, H). In that layout a decode step's
    attention is two plain products per row and kv head, (G T x H)(H x S) and (G T x S)(S x H), with no operand
    transposed: on 2 Zen 4 cores a 135M model's step over 512 slots took 6.0 ms a layer in the (L, B, S, K, H)
    layout, 2.3 ms in this one (benchmarks/RESULTS.md)."""

    k: jax.Array
    v: jax.Array

    @property
    def slots(self) -> int:
        return self.v.shape[3]

    def by_slot(self) -> tuple[jax.Array, jax.Array]:
        """Keys and values both (L, B, S, K, H): one row per slot, for code that moves slots about."""
        return jnp.transpose(self.k, (0, 1, 4, 2, 3)), jnp.transpose(self.v, (0, 1, 3, 2, 4))

    @classmethod
    def of_slots(cls, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache of (L, B, S, K, H) keys and values (`by_slot`'s inverse)."""
        return cls(jnp.transpose(k, (0, 1, 3, 4, 2)), jnp.transpose(v, (0, 1, 3, 2, 4)))

    def grown(self, slots: int) -> KVCache:
        """This cache with ``slots`` slots, the empty ones added at the end."""
        pad = lambda c, axis: jnp.pad(c, [(0, slots - self.slots if a == axis else 0) for a in range(c.ndim)])
        return KVCache(pad(self.k, 4), pad(self.v, 3))


class LayerKV(NamedTuple):
    """What one layer of a stack is handed of the KV cache: the whole stack's ``cache`` and its own index ``layer``
    in it, so that it writes its new slots into the stack's buffers in place (`write_kv`): a decode step then never
    copies a layer's slice out and back."""

    cache: KVCache
    layer: jax.Array | int


def write_kv(kv: LayerKV, k: jax.Array, v: jax.Array, index: jax.Array) -> tuple[LayerKV, jax.Array, jax.Array]:
    """A layer's new keys and values (B, t, N, H) written into the stack's cache at slot ``index``: (the `LayerKV`
    as it is passed on, the layer's keys (B, N, H, S), its values (B, N, S, H)), in the cache's dtype."""
    (ck, cv), layer = kv
    k, v = jnp.transpose(k, (0, 2, 3, 1))[None].astype(ck.dtype), jnp.transpose(v, (0, 2, 1, 3))[None].astype(cv.dtype)
    ck = jax.lax.dynamic_update_slice(ck, k, (layer, 0, 0, 0, index))
    cv = jax.lax.dynamic_update_slice(cv, v, (layer, 0, 0, index, 0))
    return LayerKV(KVCache(ck, cv), layer), ck[layer], cv[layer]


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, implementation: str | None, *,
                     scale: float | None = None, softcap: float | None = None) -> jax.Array:
    """`attention` of (B, T, N, H) queries over a KV cache's keys (B, K, H, S) and values (B, K, S, H)
    (`write_kv`), under ``mask`` (B|1, 1, T, S). Each row and kv head's G query heads and T positions go through
    one (G T x H)(H x S) product and one (G T x S)(S x H): a decode step (T = 1) is then a matrix product, not a
    batch of (G x H)(H x S) ones with the keys transposed, which XLA:CPU computes several times slower."""
    b, t, n, h = q.shape
    kh = k.shape[1]
    if implementation == "cudnn" or sharded("seq") > 1 and t % sharded("seq") == 0:  # the slots-second layout
        return attention(q, jnp.transpose(k, (0, 3, 1, 2)), jnp.transpose(v, (0, 2, 1, 3)), mask, implementation,
                         scale=scale, softcap=softcap)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32 if q.dtype == jnp.bfloat16 else None
    g = n // kh
    qg = jnp.transpose(q.reshape(b, t, kh, g, h), (0, 2, 1, 3, 4)).reshape(b, kh, t * g, h)  # rows (t, g)
    logits = jnp.einsum("bkmh,bkhs->bkms", qg, k, precision=precision, preferred_element_type=jnp.float32)
    logits = jnp.swapaxes(logits.reshape(b, kh, t, g, -1), 2, 3).reshape(b, n, t, -1) * jnp.float32(scale)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    logits = jnp.where(mask, logits, jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))  # (B, N, T, S)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = jnp.swapaxes(probs.reshape(b, kh, g, t, -1), 2, 3).reshape(b, kh, t * g, -1)
    out = jnp.einsum("bkms,bksh->bkmh", probs, v).reshape(b, kh, t, g, h)
    return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, n, h)


def kv_cache(n_layer: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    """An empty `KVCache`: keys (L, B, K, H, S), values (L, B, K, S, H)."""
    keys, values = (n_layer, batch, kv_heads, head_dim, length), (n_layer, batch, kv_heads, length, head_dim)
    # under a context axis its slots are split too
    return KVCache(constrain(jnp.zeros(keys, dtype), ("layers", "batch", "act_kv_heads", None, "seq")),
                   constrain(jnp.zeros(values, dtype), ("layers", "batch", "act_kv_heads", "seq", None)))


LAYER_INPUT = "layer_input"  # each layer's input (`run_layers` names it): what the `offload` policy moves to host
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # as "full", but every layer's input, which "full" keeps in device memory for the backward pass, is kept in the
    # host's (pinned) memory instead and brought back when its layer is recomputed
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,), offload_src="device",
        offload_dst="pinned_host"),
}


class KeyStream:
    """The keys ``nnx.Rngs(params=seed).params()`` draws, the n-th being ``fold_in(key(seed), n)``, counted in a
    Python int: what a model built layer by layer (not scanned) draws its weights with. ``nnx.Rngs`` keeps the count
    in an array that each draw replaces; under `nnx.eval_shape` (a model's layout) that replacement asks the traced
    count for its sharding, and JAX answers with an error message that walks every operation traced so far: ~2 s of
    a 135M model's layout on a Zen 4 core, quadratic in the layers."""

    def __init__(self, seed: int):
        self.key = jax.random.key(seed)
        self.count = 0

    def params(self) -> jax.Array:
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        return key


def stack_layers(make_layer, n_layer: int, scan: bool, rngs: nnx.Rngs):
    """``n_layer`` layers, ``make_layer(rngs, index)`` each: an `nnx.List`, or one module whose params are stacked on a
    leading axis (``scan``: the layers are alike, and each is made as the first)."""
    if not scan:
        return nnx.List([make_layer(rngs, i) for i in range(n_layer)])

    @nnx.split_rngs(splits=n_layer)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
        return make_layer(r, 0)

    return make(rngs)


def run_layers(layers, x, body, *, n_layer: int, scan: bool, remat: str, key: jax.Array | None,
               cache: KVCache | None, layer_args: list | None = None):
    """Apply ``body(layer, x, layer_key, kv, arg) -> (x, kv)`` through the stack; returns (x, cache).

    ``cache``: the `KVCache`: every layer is passed the whole stack and its index, a `LayerKV`, which the layer writes
    into (`write_kv`): a loop passes it along, a scanned stack carries the cache (the layer index scanned), so a
    decode step updates the cache in place under either (a scan over per-layer slices would copy the whole cache out
    and back every step).
    ``layer_args``: one value per layer (e.g. "sliding"/"full"): a Python value in the loop (so the layer is
    specialised), an array stacked over layers under ``scan``. ``remat`` names a policy in REMAT_POLICIES.
    """
    keys = None if key is None else jax.random.split(key, n_layer)
    args = layer_args if layer_args is not None else [None] * n_layer

    def wrap(fn):
        if remat == "none":
            return fn
        return nnx.remat(lambda lyr, x, *rest: fn(lyr, checkpoint_name(x, LAYER_INPUT), *rest),
                         policy=REMAT_POLICIES[remat])

    if scan:
        scanned_args = None if layer_args is None else jnp.asarray(args)
        run = wrap(body)
        if cache is None:
            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def scan_fn(layer, x, layer_key, arg):
                return run(layer, x, layer_key, None, arg)[0]

            x = scan_fn(layers, x, keys, scanned_args)
        else:
            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0, 0), out_axes=nnx.Carry)
            def scan_cached(layer, carry, layer_key, arg, i):
                x, kv = run(layer, carry[0], layer_key, LayerKV(carry[1], i), arg)
                return x, kv.cache

            x, cache = scan_cached(layers, (x, cache), keys, scanned_args, jnp.arange(n_layer))
    else:
        def bound(arg):  # a closure, not a default argument: remat would treat a default as a traced input
            return lambda lyr, x, k, kv: body(lyr, x, k, kv, arg)

        for i, layer in enumerate(layers):
            run = wrap(bound(args[i]))
            # each layer writes its slots into the whole stack's cache (`write_kv`): no slice copied out and back
            x, kv = run(layer, x, None if keys is None else keys[i], None if cache is None else LayerKV(cache, i))
            if cache is not None:
                cache = kv.cache
    return x, cache


__all__ = ["LAYER_INPUT", "REMAT_POLICIES", "Dense", "Embed", "KVCache", "LayerKV", "LayerNorm", "MaskSpec", "RMSNorm",
           "RegionMask", "Rope", "apply_rope", "attention", "attention_mask", "cached_attention", "constrain",
           "dropout", "kv_cache", "residual_fence", "run_layers", "stack_layers", "write_kv"]
