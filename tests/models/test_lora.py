"""The LoRA term's hand-written gradient equals autodiff's, alone and stacked over layers (vmap, as scan does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.models.layers import low_rank


def test_low_rank_gradient_equals_autodiff():
    k = jax.random.split(jax.random.key(0), 4)
    x, a = jax.random.normal(k[0], (2, 5, 16)), jax.random.normal(k[1], (16, 4))
    b, dy = jax.random.normal(k[2], (4, 12)), jax.random.normal(k[3], (2, 5, 12))
    ref = jax.grad(lambda x, a, b: jnp.sum(((x @ a) @ b * 2.0) * dy), (0, 1, 2))(x, a, b)
    ours = jax.grad(lambda x, a, b: jnp.sum(low_rank(x, a, b, 2.0) * dy), (0, 1, 2))(x, a, b)
    for r, o in zip(ref, ours):
        assert r.shape == o.shape
        np.testing.assert_allclose(o, r, rtol=0, atol=1e-6 * float(jnp.abs(r).max()))  # fp32 summation order
    np.testing.assert_allclose(low_rank(x, a, b, 2.0), (x @ a) @ b * 2.0, rtol=1e-6, atol=1e-6)

    stacked = lambda f: jax.grad(lambda A, B: jnp.sum(jax.vmap(f)(jnp.stack([x, -x]), A, B) ** 2), (0, 1))
    args = (jnp.stack([a, 2 * a]), jnp.stack([b, b / 2]))
    for r, o in zip(stacked(lambda x, a, b: (x @ a) @ b * 0.5)(*args),
                    stacked(lambda x, a, b: low_rank(x, a, b, 0.5))(*args)):
        np.testing.assert_allclose(o, r, rtol=0, atol=1e-6 * float(jnp.abs(r).max()))
