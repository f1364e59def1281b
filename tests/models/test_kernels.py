"""The splash attention kernel (``model.attention: splash``, `jaxtune.models.kernels`) against the XLA path, on CPU
in Pallas's interpret mode: attention outputs and their gradients for plain causal, packed, sliding-window and
softcapped masks with grouped-query heads; whole models (Llama, Gemma 3 with its sliding layers) over packed rows;
the same under an 8-device mesh (the kernel per device through `jax.shard_map`). The refusals are one line each.

Tolerances (float32): 1e-5 absolute on outputs and gradients of O(1) (the kernel accumulates its softmax block by
block, the XLA path over the whole row: measured differences are ~1e-6); logits 1e-5; parameter gradients 1e-5 of
each leaf's largest entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.backends import backend_of
from jaxtune.config import ConfigError, load_config
from jaxtune.loop import train
from jaxtune.models import kernels, layers


def _packed(b: int, t: int) -> np.ndarray:
    seg = np.ones((b, t), np.int32)
    seg[0, 100:] = 2  # two documents
    seg[1, 200:] = 0  # padding at the end
    return seg


@pytest.mark.parametrize("window,softcap,packed", [(None, None, False), (None, None, True), (48, None, True),
                                                   (None, 30.0, True)], ids=["causal", "packed", "window", "softcap"])
def test_kernel_equals_the_xla_attention_and_its_gradients(window, softcap, packed):
    rng = np.random.default_rng(0)
    b, t, n, kh, h = 2, 256, 4, 2, 32
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((b, t, n, h), (b, t, kh, h), (b, t, kh, h)))
    spec = layers.MaskSpec(t, t, window=window, segment_ids=jnp.asarray(_packed(b, t)) if packed else None)
    with kernels.interpreted():
        mask = layers.attention_mask(spec, blocks=True)
        assert isinstance(mask, kernels.BlockMask)
        out, pull = jax.vjp(lambda q, k, v: layers.attention(q, k, v, mask, "splash", softcap=softcap), q, k, v)
        grads = pull(jnp.ones_like(out))
    ref, ref_pull = jax.vjp(lambda q, k, v: layers.attention(q, k, v, layers.attention_mask(spec), None,
                                                             softcap=softcap), q, k, v)
    # float32, summed over 256 keys in another block order: 1e-5 absolute, and 2e-6 relative for the softcapped
    # gradients (|g| ~ 11, 1e-5 apart on an AVX-512 CI machine: 9e-7 relative). A wrong mask or a missing softcap
    # moves them by 1e-2 or more.
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=2e-6)
    for g, r in zip(grads, ref_pull(jnp.ones_like(ref)), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=2e-6)


def test_the_kernel_is_not_taken_where_it_does_not_apply():
    """Lengths its 128-position tiles do not divide, padded keys (the sampler's prefill), and any mask off TPU
    outside interpret mode (a TPU run evaluated on a CPU host) keep the XLA path."""
    assert layers.attention_mask(layers.MaskSpec(256, 256), blocks=True) is None  # CPU, not interpreted: XLA's
    with kernels.interpreted():
        assert isinstance(layers.attention_mask(layers.MaskSpec(256, 256), blocks=True), kernels.BlockMask)
        assert layers.attention_mask(layers.MaskSpec(96, 96), blocks=True) is None
        padded = layers.MaskSpec(256, 256, key_valid=jnp.ones((1, 256), bool))
        assert isinstance(layers.attention_mask(padded, blocks=True), jax.Array)


MODEL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config
    from jaxtune.models import kernels

    T = 128
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 256, (4, T)).astype(np.int32)  # 4 rows: one per data x fsdp shard of the mesh
    seg, pos = np.ones((4, T), np.int32), np.tile(np.arange(T, dtype=np.int32), (4, 1))
    seg[0, 50:], pos[0, 50:] = 2, np.arange(T - 50)
    seg[3, 90:], pos[3, 90:] = 0, 0
    targets = np.roll(inputs, -1, 1)
    batch = {"inputs": inputs, "targets": targets, "positions": pos, "segment_ids": seg}

    def run(family, attention, shape):
        cfg = load_config(None, [f"model.family={family}", "model.preset=tiny", "model.n_layer=2", "model.d_model=64",
                                 "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128", "model.vocab_size=256",
                                 f"model.max_seq_len={T}", f"model.attention={attention}"])
        d, f, t = shape
        mesh = sharding.make_mesh(d, f, t, jax.devices()[:d * f * t])
        spec = make_state_spec(cfg, 256, mesh)
        params, frozen = spec.init(0).params, spec.load_frozen(0)
        fwd = spec.forward()
        b = jax.device_put(batch, sharding.batch_sharding(mesh))
        loss = lambda p, b: -jnp.mean(fwd.token_logps(spec.weights(p, frozen), b))
        with sharding.use_mesh(mesh), kernels.interpreted():
            logits, grads = jax.jit(lambda p, b: (fwd.logits(spec.weights(p, frozen), b), jax.grad(loss)(p, b)))(
                params, b)
        return {"logits": np.asarray(logits).tolist(), "grads": [np.asarray(g).ravel().tolist()
                                                                 for g in jax.tree.leaves(grads)]}

    runs = [("auto", (1, 1, 1)), ("splash", (1, 1, 1)), ("splash", (2, 2, 2))]
    print("RESULT " + json.dumps({f"{fam}-{att}-{'x'.join(map(str, s))}": run(fam, att, s)
                                  for fam in ("llama", "gemma3") for att, s in runs}))
    """
)


def _compare(out: dict, ref_shape: str) -> int:
    checked = 0
    for key, got in out.items():
        family, attention, shape = key.split("-")
        if attention == "auto" and shape == ref_shape:
            continue
        one = out[f"{family}-auto-{ref_shape}"]
        assert np.abs(np.array(got["logits"]) - np.array(one["logits"])).max() <= 1e-5, key
        for a, b in zip(got["grads"], one["grads"], strict=True):
            a, b = np.array(a), np.array(b)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), key
        checked += 1
    return checked


def test_models_with_the_kernel_equal_xla_on_one_device_and_under_a_mesh():
    """Llama (grouped-query) and Gemma 3 (a sliding-window layer, then a global one) over packed rows: logits and
    parameter gradients with model.attention=splash equal XLA's, on one device and on 8 (data=2 x fsdp=2 x
    tensor=2: rows and heads split, the kernel per device)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MODEL_SCRIPT],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert _compare(out, "1x1x1") == 2 * 2  # per family: the kernel on 1 and on 8 devices


def test_kernel_refusals_are_one_line(tiny_cfg):
    with pytest.raises(ConfigError, match=r"model\.attention=splash with mesh\.context=2: the splash kernel"):
        backend_of(load_config(None, ["model.family=llama", "model.attention=splash", "mesh.context=2"]))
    with pytest.raises(ConfigError, match=r"model\.attention=splash is JAX's TPU attention kernel, and this run's "
                                          r"devices are cpu: use model\.attention=auto"):
        train(tiny_cfg("model.family=llama", "model.attention=splash"))
