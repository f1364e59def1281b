"""Log-probabilities of given tokens from logits, whole or a chunk of sequence positions at a time.

Every objective reads the model through these: cross-entropy is minus their (masked) sum, DPO's and GRPO's
sequence log-probs are their sums over a completion.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

LOGITS_BUDGET = 1 << 30  # bytes of float32 logits the auto policy materialises at once (1 GiB)
CHUNK_BUDGET = 1 << 28  # bytes per chunk when it does chunk (256 MiB)


def loss_chunk_size(batch: int, seq: int, vocab: int, requested: int = 0, split: tuple[int, int, int] = (1, 1, 1)
                    ) -> int:
    """Sequence positions per log-prob chunk: ``requested`` when set (> 0), else ``seq`` (no chunking) while the
    full float32 logits fit LOGITS_BUDGET, else the largest divisor of ``seq`` within CHUNK_BUDGET.

    The budgets are a device's: ``split`` is how many ways the mesh splits the rows, the positions (the context
    axis) and the vocabulary (the tensor axis), so a device holds 1/(rows x positions x vocabulary) of the logits.
    A chunk spans a multiple of the positions' split, so that every chunk is spread over the context group."""
    if requested > 0:
        if seq % requested and requested < seq:
            raise ValueError(f"train.loss_chunk={requested} does not divide the sequence length {seq}")
        return min(requested, seq)
    rows, positions, vocabulary = split
    per_device = -(-batch // rows) * -(-vocab // vocabulary) * 4  # bytes a position of a chunk costs a device

    def held(c: int) -> int:
        return per_device * -(-c // positions)

    if held(seq) <= LOGITS_BUDGET:
        return seq
    fits = [c for c in range(positions, seq + 1, positions) if seq % c == 0 and held(c) <= CHUNK_BUDGET]
    return max(fits or [positions if seq % positions == 0 else 1])


def tempered(logits: jax.Array, temperature: float) -> jax.Array:
    """``logits / temperature`` (the same array at temperature 1, so the usual programs are unchanged)."""
    return logits if temperature == 1.0 else logits / temperature


def token_logps(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """logits (B, T, V) float32, targets (B, T) int32 -> (B, T) log p(targets)."""
    return -optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def token_logps_and_entropy(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits (B, T, V) float32, targets (B, T) int32 -> (B, T) log p(targets) and (B, T) entropy (nats) of
    softmax(logits): log Z - sum_v p_v z_v, from the same logits."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    probs = jnp.exp(logits - log_z[..., None])
    return token_logps(logits, targets), log_z - jnp.sum(probs * logits, axis=-1)


def chunked_token_logps(head: Callable[[jax.Array], jax.Array], hidden: jax.Array, targets: jax.Array,
                        chunk: int, entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`token_logps` of ``head(hidden)`` computed ``chunk`` sequence positions at a time (``entropy``: with each
    position's entropy, `token_logps_and_entropy`, from the same chunk of logits).

    hidden (B, T, D) -> head -> (B, chunk, V) float32 logits per chunk, rematerialised in the backward pass, so
    at most one chunk of logits is alive: a 262k vocabulary never holds (B, T, V) floats. Returns (B, T) (a pair).
    """
    b, t, d = hidden.shape
    n = t // chunk
    xs = (hidden.reshape(b, n, chunk, d).swapaxes(0, 1), targets.reshape(b, n, chunk).swapaxes(0, 1))
    per_chunk = token_logps_and_entropy if entropy else token_logps
    one = jax.checkpoint(lambda h, tgt: per_chunk(head(h), tgt))
    _, ys = jax.lax.scan(lambda carry, x: (carry, one(*x)), None, xs)  # (n, B, chunk) each
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(b, t), ys)
