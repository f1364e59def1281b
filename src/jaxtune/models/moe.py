"""A mixture-of-experts MLP: a linear router picks ``top_k`` of ``E`` gated-MLP experts per token, and the chosen
experts' outputs are summed, weighted by the router's probabilities (Qwen3-MoE's sparse block).

Dropless: every token reaches every expert it chose (no capacity factor), so the output is transformers' exactly.
The tokens' copies are sorted by expert and each expert's rows multiplied by its weights in one grouped product
(`jax.lax.ragged_dot`), where transformers loops over the experts in Python.

Shapes: T tokens, D d_model, E experts, K experts per token, F an expert's d_ff.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.layers import Dense, normal_init


class Routing(NamedTuple):
    """Each token's chosen experts ``experts`` (T, K) int32 and their weights ``weights`` (T, K), from the router's
    ``logits`` (T, E) float32."""

    logits: jax.Array
    experts: jax.Array
    weights: jax.Array


def route(logits: jax.Array, top_k: int, norm_topk: bool) -> Routing:
    """Softmax over the experts in float32, the ``top_k`` most probable kept (renormalised to sum to 1 when
    ``norm_topk``), as transformers' Qwen3-MoE router does."""
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(logits, experts.astype(jnp.int32), weights)


def dropless(x: jax.Array, routing: Routing, gate: jax.Array, up: jax.Array, down: jax.Array,
             act: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """sum_k weight_k * down_e(act(gate_e x) * up_e x) over each token's chosen experts e = experts[:, k].

    x: (T, D); gate, up: (E, D, F); down: (E, F, D). The T*K (token, expert) pairs are sorted by expert (stable,
    so each expert's rows keep the tokens' order), multiplied in three grouped products, weighted and added back
    to their tokens."""
    t, k = routing.experts.shape
    n_experts = gate.shape[0]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    rows = x[token]
    h = act(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    y = jax.lax.ragged_dot(h, down, sizes)
    y = y * routing.weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((t, x.shape[-1]), y.dtype).at[token].add(y)


class MoE(nnx.Module):
    """The router (``router``: D -> E, no bias) and ``n_experts`` experts stacked on a leading axis: ``gate`` and
    ``up`` (E, D, F), ``down`` (E, F, D). Called on (B, T, D), it returns (B, T, D)."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, norm_topk: bool, *, rngs: nnx.Rngs,
                 act: Callable[[jax.Array], jax.Array], std: float, out_std: float, param_dtype, dtype,
                 formulation: int):
        self.router = Dense(d_model, n_experts, ("embed", None), rngs=rngs, std=std, bias=False,
                            param_dtype=param_dtype, dtype=dtype, formulation=formulation)
        axes_in, axes_out = ("experts", "embed", "mlp"), ("experts", "mlp", "embed")
        self.gate = nnx.Param(normal_init(rngs.params(), (n_experts, d_model, d_ff), std, param_dtype),
                              logical_axes=axes_in)
        self.up = nnx.Param(normal_init(rngs.params(), (n_experts, d_model, d_ff), std, param_dtype),
                            logical_axes=axes_in)
        self.down = nnx.Param(normal_init(rngs.params(), (n_experts, d_ff, d_model), out_std, param_dtype),
                              logical_axes=axes_out)
        self.top_k, self.norm_topk, self.act, self.dtype = top_k, norm_topk, act, dtype

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """``key``: unused (the experts carry no LoRA dropout)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d).astype(self.dtype)
        routing = route(self.router(flat), self.top_k, self.norm_topk)
        weights = [w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)]
        return dropless(flat, routing, *weights, self.act).reshape(b, t, d)

