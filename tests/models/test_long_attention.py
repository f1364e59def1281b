"""Attention over long sequences a chunk of queries at a time (`layers.query_chunks`): when a device's float32 scores
would pass `layers.SCORES_BUDGET` (1 GiB), its queries are scored in chunks, each rematerialised in the backward
pass, so one chunk's scores are alive instead of the (T, S) matrix. Every query's softmax still runs over all its
keys, so outputs and gradients are the one-pass ones (float32: 1e-6 of the largest entry; measured ~1e-7). The
budget is lowered here so that 128-256 positions chunk; `test_context_parallel.py` runs it under the context axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.models import layers
from jaxtune.models.layers import attention, query_chunks


def _qkv(t: int, heads: int = 4, kv_heads: int = 2, h: int = 16, b: int = 2):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((b, t, n, h)).astype(np.float32)) for n in (heads, kv_heads, kv_heads)]


def _masks(t: int) -> dict:
    causal = np.tril(np.ones((t, t), bool))
    segments = np.repeat(np.arange(4), t // 4)[None].repeat(2, 0)  # packed rows: four documents each
    packed = causal[None] & (segments[:, :, None] == segments[:, None, :])
    window = causal & (np.arange(t)[:, None] - np.arange(t)[None, :] < 40)  # a sliding window of 40
    return {"causal": None, "packed": jnp.asarray(packed[:, None]), "window": jnp.asarray(window[None, None])}


@pytest.mark.parametrize("kind,softcap", [("causal", None), ("packed", None), ("window", 30.0)])
def test_chunked_queries_equal_one_pass(monkeypatch, kind, softcap):
    t = 256
    q, k, v = _qkv(t)
    mask = _masks(t)[kind]

    def loss(q, k, v):
        out = attention(q, k, v, mask, None, softcap=softcap)
        return jnp.sum(out * jnp.cos(out)), out

    def run():
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    whole, g_whole = run()
    monkeypatch.setattr(layers, "SCORES_BUDGET", 2 * 4 * 64 * t * 4)  # 64 queries' scores: 4 chunks
    monkeypatch.setattr(layers, "MIN_QUERY_CHUNK", 32)
    assert query_chunks(2, t, 4, t) == 4
    chunked, g_chunked = run()
    assert np.abs(np.asarray(chunked) - np.asarray(whole)).max() <= 1e-6 * np.abs(np.asarray(whole)).max()
    for a, b in zip(g_chunked, g_whole, strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-6 * np.abs(np.asarray(b)).max()


def test_chunks_hold_a_chunk_of_scores_and_the_default_budget_is_a_devices_gib(monkeypatch):
    """The compiled gradient of causal attention over 2,048 positions holds under a third of the one-pass
    temporaries in 8 chunks. With the default budget 8 rows of 1,024 positions and 9 heads (SmolLM2's) are scored
    in one pass (288 MiB); a 32k-position row of 28 heads (Qwen 2.5 7B's) in 128 chunks (its 112 GiB of scores)."""
    t = 2048
    q, k, v = _qkv(t, b=1)

    def temp():
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, None, None) ** 2), argnums=(0, 1, 2)))
        return grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    assert query_chunks(1, t, 4, t) == 1
    whole = temp()
    monkeypatch.setattr(layers, "SCORES_BUDGET", 4 * 256 * t * 4)
    assert query_chunks(1, t, 4, t) == 8
    assert temp() * 3 < whole
    monkeypatch.undo()
    assert query_chunks(8, 1024, 9, 1024) == 1 and query_chunks(1, 32768, 28, 32768) == 128
