"""A mixture-of-experts MLP: a linear router picks ``top_k`` of ``E`` gated-MLP experts per token, and the chosen
experts' outputs are summed, weighted by the router's probabilities (Qwen3-MoE's sparse block).

Dropless: every token reaches every expert it chose (no capacity factor), so the output is transformers' exactly.
The tokens' copies are sorted by expert and each expert's rows multiplied by its weights in grouped products
(`grouped_matmul`: `jax.lax.ragged_dot` on TPU and GPU, blocks of one expert's rows on a CPU), where transformers
loops over the experts in Python.

Shapes: T tokens, D d_model, E experts, K experts per token, F an expert's d_ff.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtune import sharding
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


def grouped_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows (N, D), sorted by group, each group's ``sizes[g]`` rows times its weights ``w[g]`` (G, D, F) -> (N, F).

    `jax.lax.ragged_dot` where the platform has a grouped product (TPU, GPU); on a CPU, whose ragged_dot multiplies
    every row by every group's weights (G times the work and a (G, N, D) copy), `blocked_matmul`."""
    mesh = sharding.active_mesh()
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if platform == "cpu":
        return blocked_matmul(rows, w, sizes, _block(rows.shape[0], w.shape[0]))
    return jax.lax.ragged_dot(rows, w, sizes)


def _block(n_rows: int, groups: int) -> int:
    """Rows a block of `blocked_matmul`: about a group's share of the rows, a power of two from 8 to 128 (its padding,
    under a block a group, stays below a group's share)."""
    share = max(1, n_rows // groups)
    return int(min(128, max(8, 1 << (share.bit_length() - 1))))


def _blocks(sizes: jax.Array, n_rows: int, block: int) -> tuple[jax.Array, jax.Array, int]:
    """Each group's rows padded to whole blocks: (each row's place in the padded rows (N,), each block's group
    (n_blocks,), n_blocks); the blocks past the last group's belong to the last group and hold zeros."""
    groups = sizes.shape[0]
    n_blocks = -(-n_rows // block) + groups
    padded = (sizes + block - 1) // block * block
    ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=n_rows)
    place = (ends - padded)[group] + jnp.arange(n_rows) - (jnp.cumsum(sizes) - sizes)[group]
    owner = jnp.minimum(jnp.searchsorted(ends, jnp.arange(n_blocks) * block, side="right"), groups - 1)
    return place, owner, n_blocks


def _padded(rows: jax.Array, place: jax.Array, n_blocks: int, block: int) -> jax.Array:
    return jnp.zeros((n_blocks * block, rows.shape[-1]), rows.dtype).at[place].set(rows).reshape(n_blocks, block, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blocked_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array, block: int) -> jax.Array:
    """`grouped_matmul` as a loop over blocks of ``block`` rows of one group each (each group's rows padded to whole
    blocks): one (block, D) x (D, F) product a block, so the work is the rows' and their padding's, never G times."""
    return _blocked_forward(rows, w, sizes, block)[0]


def _blocked_forward(rows, w, sizes, block):
    place, owner, n_blocks = _blocks(sizes, rows.shape[0], block)
    xp = _padded(rows, place, n_blocks, block)
    y = jax.lax.map(lambda a: a[0] @ w[a[1]], (xp, owner))
    return y.reshape(-1, w.shape[-1])[place], (xp, w, place, owner)


def _blocked_fwd(rows, w, sizes, block):
    return _blocked_forward(rows, w, sizes, block)


def _blocked_bwd(block, res, dy):
    xp, w, place, owner = res
    dyp = _padded(dy, place, xp.shape[0], block)
    d_rows = jax.lax.map(lambda a: a[0] @ w[a[1]].T, (dyp, owner)).reshape(-1, w.shape[1])[place]

    def add(i, dw):
        return dw.at[owner[i]].add((xp[i].T @ dyp[i]).astype(dw.dtype))

    dw = jax.lax.fori_loop(0, xp.shape[0], add, jnp.zeros_like(w))
    return d_rows, dw, None


blocked_matmul.defvjp(_blocked_fwd, _blocked_bwd)


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
    f = gate.shape[-1]
    gate_up = grouped_matmul(rows, jnp.concatenate([gate, up], axis=-1), sizes)
    h = act(gate_up[:, :f]) * gate_up[:, f:]
    y = grouped_matmul(h, down, sizes)
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
        """``key``: unused (the experts carry no LoRA dropout).

        Under a mesh each device routes and multiplies its own rows (`jax.shard_map` over the batch and context
        axes, the experts' weights gathered whole as a dense layer's are): sorting every device's tokens together
        would gather them all onto each device. A routing is per token, so the result is the same."""
        x = x.astype(self.dtype)
        logits = self.router(x)
        weights = [w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)]

        def local(x, logits, gate, up, down):
            b, t, d = x.shape
            routing = route(logits.reshape(b * t, -1), self.top_k, self.norm_topk)
            return dropless(x.reshape(b * t, d), routing, gate, up, down, self.act).reshape(b, t, d)

        mesh = sharding.active_mesh()
        if mesh is None:
            return local(x, logits, *weights)
        rows = _rows_spec(mesh, x.shape)
        return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, P(), P(), P()), out_specs=rows,
                             check_vma=False)(x, logits, *weights)


def _rows_spec(mesh: Any, shape: tuple[int, ...]) -> P:
    """(B, T, ...) activations split over the batch axes and the context axis where they divide B and T."""
    names = sharding.spec(("batch", "seq"), mesh, shape[:2])
    out = []
    for n, size in zip(names, shape[:2]):
        axes = (n,) if isinstance(n, str) else tuple(n or ())
        ways = math.prod(mesh.shape[a] for a in axes)
        out.append(n if axes and size % ways == 0 else None)
    return P(*out, *([None] * (len(shape) - 2)))

