"""The LoRA term's hand-written gradient equals autodiff's, alone and stacked over layers (vmap, as scan does)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import load_config
from jaxtune.models.layers import low_rank
from jaxtune.models.registry import init_params, init_trained
from jaxtune.models.resolve import model_config


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


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("head", ["lm", "score"])
def test_adapters_drawn_alone_equal_the_whole_models_compiled_init(family, head):
    """`init_trained` (LoRA's adapters, a reward model's head, op by op and without the base's draws: what a LoRA run
    starts from) gives the values the whole model's compiled initialisation gives them: the adapters bitwise (their
    draws are integer bit operations and one scale), a score head's normal draw to its last bit (1 ulp)."""
    over = [f"model.family={family}", "model.preset=tiny", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
            "model.n_kv_head=1", "model.d_ff=64", "model.lora.rank=4", "model.lora.targets=[q,k,v,o,gate,up,down]"]
    model_cfg = model_config(load_config(None, over).model, 300)
    if head == "score":
        model_cfg = dataclasses.replace(model_cfg, num_labels=1)
    drawn = jax.device_get(init_trained(model_cfg, 7))
    compiled = jax.device_get(jax.jit(lambda: init_params(model_cfg, 7)[0])())
    assert jax.tree.structure(drawn) == jax.tree.structure(compiled)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(compiled), jax.tree.leaves(drawn), strict=True):
        if "score" in jax.tree_util.keystr(path):
            np.testing.assert_array_max_ulp(a, b, maxulp=1)
        else:
            assert np.array_equal(a, b), jax.tree_util.keystr(path)
    assert sum(x.size for x in jax.tree.leaves(drawn)) < 0.5 * model_cfg.num_params()  # the base was not drawn
