"""The pure train step ``(state, batch) -> (state, metrics)`` and the eval step.

Feature choices (gradient accumulation, NaN policy) are made when the step is *built*, not inside it.
A batch is a dict of (B, T) arrays: ``inputs`` and ``targets`` (int32), optionally ``positions`` (int32) and
``loss_mask`` (float32, 0 for tokens that do not count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxtune.models.registry import merge


class TrainState(NamedTuple):
    step: jax.Array  # int32 (): optimizer steps taken
    params: Any  # pure dict of arrays (the model's nnx.Param state)
    opt_state: Any
    key: jax.Array  # uint32 key data: the run's base key; step keys are fold_in(key, step)
    nan_streak: jax.Array  # int32 (): consecutive non-finite steps (on_nan=skip)
    nan_skipped: jax.Array  # int32 (): non-finite steps skipped in total


def init_state(params: Any, tx: optax.GradientTransformation, seed: int) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=tx.init(params),
        key=jax.random.key_data(jax.random.key(seed)),
        nan_streak=jnp.zeros((), jnp.int32),
        nan_skipped=jnp.zeros((), jnp.int32),
    )


LOGITS_BUDGET = 1 << 30  # bytes of float32 logits the auto policy materialises at once (1 GiB)
CHUNK_BUDGET = 1 << 28  # bytes per chunk when it does chunk (256 MiB)


def loss_chunk_size(batch: int, seq: int, vocab: int, requested: int = 0) -> int:
    """Sequence positions per cross-entropy chunk: ``requested`` when set (> 0), else ``seq`` (no chunking)
    while the full float32 logits fit LOGITS_BUDGET, else the largest divisor of ``seq`` within CHUNK_BUDGET."""
    if requested > 0:
        if seq % requested and requested < seq:
            raise ValueError(f"train.loss_chunk={requested} does not divide the sequence length {seq}")
        return min(requested, seq)
    if batch * seq * vocab * 4 <= LOGITS_BUDGET:
        return seq
    fits = [c for c in range(1, seq + 1) if seq % c == 0 and batch * c * vocab * 4 <= CHUNK_BUDGET]
    return max(fits or [1])


def chunked_cross_entropy(head, hidden: jax.Array, targets: jax.Array, weights: jax.Array, chunk: int) -> jax.Array:
    """sum(weights * CE(head(hidden), targets)) computed ``chunk`` sequence positions at a time.

    hidden (B, T, D) -> head -> (B, chunk, V) float32 logits per chunk, rematerialised in the backward pass, so
    at most one chunk of logits is alive: a 262k vocabulary never holds (B, T, V) floats.
    """
    b, t, d = hidden.shape
    n = t // chunk
    xs = (hidden.reshape(b, n, chunk, d).swapaxes(0, 1), targets.reshape(b, n, chunk).swapaxes(0, 1),
          weights.reshape(b, n, chunk).swapaxes(0, 1))

    @jax.checkpoint
    def one(h, tgt, w):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(head(h), tgt) * w)

    total, _ = jax.lax.scan(lambda acc, x: (acc + one(*x), None), jnp.zeros((), jnp.float32), xs)
    return total


def weighted_cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """sum(weights * CE): logits (B, T, V) float32, targets (B, T) int32, weights (B, T) float32."""
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)


def token_loss(graphdef: nnx.GraphDef, params: Any, batch: dict[str, jax.Array], key: jax.Array | None,
               loss_chunk: int = 0, frozen: tuple = ()):
    """Summed cross-entropy over counted tokens, and the number of counted tokens (both float32 scalars).

    ``loss_chunk``: sequence positions per cross-entropy chunk (0: auto, see `loss_chunk_size`). ``frozen``:
    the parameters that do not train (a LoRA model's base), merged with ``params`` into the model."""
    model = merge(graphdef, (params, *frozen) if frozen else params)
    tokens, targets = batch["inputs"], batch["targets"]
    weights = batch.get("loss_mask", jnp.ones(targets.shape, jnp.float32))
    kw = dict(positions=batch.get("positions"), segment_ids=batch.get("segment_ids"), key=key)
    b, t = tokens.shape
    chunk = loss_chunk_size(b, t, model.cfg.vocab_size, loss_chunk)
    if chunk >= t:
        loss_sum = weighted_cross_entropy(model(tokens, **kw), targets, weights)  # (B, T, V) float32 logits
    else:
        loss_sum = chunked_cross_entropy(model.logits, model(tokens, return_hidden=True, **kw), targets, weights,
                                         chunk)
    return loss_sum, jnp.sum(weights)


LossFn = Callable[[Any, dict[str, jax.Array], jax.Array | None, tuple], tuple[jax.Array, jax.Array]]


def native_loss(graphdef: nnx.GraphDef, loss_chunk: int = 0) -> LossFn:
    """``(params, batch, key, frozen) -> (summed loss, counted tokens)`` for a native model graph."""
    return lambda p, b, k, f: token_loss(graphdef, p, b, k, loss_chunk, f)


def _split_micro(batch: dict[str, jax.Array], n: int) -> dict[str, jax.Array]:
    """(B, ...) -> (n, B/n, ...) taking every n-th row, so each micro-batch stays spread over the
    data-parallel devices (a contiguous split would put micro-batch i on a subset of them)."""
    return {k: v.reshape(v.shape[0] // n, n, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, *,
                    micro_batches: int = 1, skip_nonfinite: bool = False, use_dropout: bool = True):
    """Build the step around ``loss_fn(params, batch, key, frozen) -> (summed loss, counted tokens)`` (a native
    model's `native_loss`, or a torchax model's). The loss is token-weighted over the whole batch: gradients of
    summed losses are accumulated over micro-batches and divided once by the total token count (not a mean of
    means)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array], frozen: tuple = ()):
        """``frozen``: parameters that do not train (a LoRA base): read, never updated, no optimizer state."""
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step) if use_dropout else None
        if micro_batches == 1:
            (loss_sum, tokens), grads = grad_fn(state.params, batch, step_key, frozen)
        else:
            def micro(carry, xs):
                i, mb = xs
                key = None if step_key is None else jax.random.fold_in(step_key, i)
                (l, n), g = grad_fn(state.params, mb, key, frozen)
                acc_g, acc_l, acc_n = carry
                return (jax.tree.map(jnp.add, acc_g, g), acc_l + l, acc_n + n), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            carry = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
            xs = (jnp.arange(micro_batches), _split_micro(batch, micro_batches))
            (grads, loss_sum, tokens), _ = jax.lax.scan(micro, carry, xs)
        denom = jnp.maximum(tokens, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        loss = loss_sum / denom
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        new_state = TrainState(
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            key=state.key,
            nan_streak=jnp.where(finite, 0, state.nan_streak + 1),
            nan_skipped=state.nan_skipped + jnp.where(finite, 0, 1),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step), "tokens": tokens,
                   "finite": finite, "nan_streak": new_state.nan_streak}
        return new_state, metrics

    return train_step


def make_eval_step(loss_fn: LossFn):
    """(params, batch, frozen=()) -> (summed loss, token count); deterministic (no dropout)."""

    def eval_step(params, batch, frozen=()):
        return loss_fn(params, batch, None, frozen)

    return eval_step
