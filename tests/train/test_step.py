"""The pure train step: gradient accumulation equals the large batch, losses are token-weighted."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.sharding import make_mesh
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.step import make_train_step, objective_loss

V = 512


def _setup(*overrides):
    cfg = load_config(None, ["model.preset=tiny", "model.max_seq_len=32", "optim.warmup_steps=0", *overrides])
    return cfg, make_state_spec(cfg, V, make_mesh(1, 1, 1, jax.devices()[:1]))


@pytest.fixture(scope="module")
def plain():
    """(spec, its initial state) for the default setup: `spec.init` compiles for seconds, so the tests whose steps
    do not donate their state read this one (a step that wrongly consumed it would fail the next user loudly)."""
    _, spec = _setup()
    return spec, spec.init(0)


def _ce(spec):
    return objective_loss(CrossEntropy(), spec.forward(), spec.weights)


def _batch(rows, t=32, seed=0, mask=False):
    rng = np.random.RandomState(seed)
    toks = rng.randint(0, V, (rows, t + 1)).astype(np.int32)
    b = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    if mask:  # uneven token counts per row: mean-of-means would differ from the token-weighted mean
        lengths = rng.randint(1, t + 1, rows)
        b["loss_mask"] = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in b.items()}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _capture_grads() -> optax.GradientTransformation:
    """An 'optimizer' whose state becomes the gradient it was given (and which leaves params unchanged),
    so the real step's gradients can be read exactly."""
    return optax.GradientTransformation(
        init=lambda p: jax.tree.map(jnp.zeros_like, p),
        update=lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g),
    )


@pytest.mark.parametrize("mask", [False, True])
def test_grad_accumulation_equals_large_batch(mask, plain):
    spec, init = plain
    batch = _batch(8, mask=mask)
    tx = _capture_grads()
    results = {}
    for micro in (1, 4):
        state = init._replace(opt_state=tx.init(init.params))
        state, m = jax.jit(make_train_step(_ce(spec), tx, spec.lr_schedule, micro_batches=micro))(state, batch)
        results[micro] = (state.opt_state, m)
    (g1, m1), (g4, m4) = results[1], results[4]
    assert _rel(m4["loss"], m1["loss"]) <= 1e-6
    assert _rel(m4["grad_norm"], m1["grad_norm"]) <= 1e-6
    assert float(m4["count"]) == float(m1["count"])
    worst = max(jax.tree.leaves(jax.tree.map(_rel, g4, g1)))  # per leaf: max|g4 - g1| / max|g1|
    assert worst <= 1e-6, worst


def test_loss_is_token_weighted_not_mean_of_means(plain):
    spec, state = plain
    batch = _batch(8, mask=True)
    _, m = jax.jit(make_train_step(_ce(spec), spec.tx, spec.lr_schedule, micro_batches=4))(state, batch)
    # Reference: per-token losses from the unsplit batch, weighted by the mask.
    s, n, _ = CrossEntropy()(spec.forward(), state.params, batch, None)
    assert float(n) == float(batch["loss_mask"].sum())
    assert _rel(m["loss"], s / n) <= 1e-6


def test_skip_policy_keeps_params_on_nonfinite_step(plain):
    spec, state = plain
    batch = _batch(4, mask=True)
    bad = dict(batch, loss_mask=batch["loss_mask"].at[0, 0].set(jnp.nan))
    step = jax.jit(make_train_step(_ce(spec), spec.tx, spec.lr_schedule, skip_nonfinite=True))
    before = jax.tree.map(np.asarray, state.params)
    state, m = step(state, bad)
    assert not bool(m["finite"]) and int(state.nan_streak) == 1 and int(state.nan_skipped) == 1
    assert int(state.step) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), state.params, before)
    state, m = step(state, batch)
    assert bool(m["finite"]) and int(state.nan_streak) == 0 and int(state.nan_skipped) == 1


def test_dropout_key_is_a_function_of_seed_and_step():
    _, spec = _setup("model.dropout=0.1")
    step = jax.jit(make_train_step(_ce(spec), spec.tx, spec.lr_schedule, use_dropout=True))
    batch = _batch(4)
    init = spec.init(0)  # the step does not donate: both runs start from this state
    losses = []
    for _ in range(2):
        state = init
        run = []
        for _ in range(3):
            state, m = step(state, batch)
            run.append(float(m["loss"]))
        losses.append(run)
    assert losses[0] == losses[1]  # same seed, same steps: bitwise the same
    assert len(set(losses[0])) == 3


@pytest.mark.parametrize("name", ["adamw", "adafactor", "sgd"])
def test_optimizers_reduce_loss(name):
    lr = {"adamw": 3e-3, "adafactor": 1e-2, "sgd": 0.3}[name]
    _, spec = _setup(f"optim.name={name}", f"optim.lr={lr}", "optim.schedule=constant")
    step = jax.jit(make_train_step(_ce(spec), spec.tx, spec.lr_schedule), donate_argnums=0)
    batch = _batch(8)
    state = spec.init(0)
    first = None
    for _ in range(15):
        state, m = step(state, batch)
        first = first if first is not None else float(m["loss"])
    assert float(m["loss"]) < first - 0.5, (first, float(m["loss"]))


def test_schedule_warmup_then_cosine():
    _, spec = _setup("optim.warmup_steps=10", "optim.lr=1e-3", "optim.min_lr_ratio=0.1", "train.steps=110")
    lr = spec.lr_schedule
    assert float(lr(0)) == pytest.approx(1e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(110)) == pytest.approx(1e-4, rel=1e-3)
    assert float(lr(60)) == pytest.approx(0.55e-3, rel=1e-3)


def test_bf16_compute_scan_and_remat_train():
    """fp32 master params + bf16 compute, scanned layers and remat: params stay fp32, the loss falls."""
    _, spec = _setup("model.compute_dtype=bfloat16", "model.scan_layers=true", "model.remat=dots",
                       "optim.lr=3e-3", "optim.schedule=constant")
    step = jax.jit(make_train_step(_ce(spec), spec.tx, spec.lr_schedule, micro_batches=2), donate_argnums=0)
    batch = _batch(8)
    state = spec.init(0)
    losses = []
    for _ in range(10):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert state.params["blocks"]["qkv"].shape[0] == spec.model_cfg.n_layer  # stacked by the layer scan
