"""``model.formulation``: how the native models write their products, the same math rounded otherwise in the last bits.

Formulation 1 scores attention with the heads before the positions (`layers._attend`) and gives every `Dense` the
gradient of `layers.matmul` (its weight's product written as xᵀ dy, not autodiff's (dyᵀ x)ᵀ); 2 (the default) is 1
with the operand transposed for a weight's gradient the narrower one: (dyᵀ x)ᵀ for a layer narrower out than in, and
the output head's gradient through `layers.matmul` too. 0 is the formulation runs saved before 1 were trained with
(`layers._attend_positions_first`, autodiff's gradient). A resumed run keeps its own (`tests/train/test_old_runs.py`
holds it bitwise).

Checked here: they agree (attention outputs and gradients within 2e-6 of the largest entry, measured up to 1.2e-6;
a model's loss and gradients within 1e-5 relative; formulation 2's MLP and head within 1e-6); and on CPU the compiled
gradient of each has none of the layout copies it exists to remove: with 1, no fusion writes the attention scores (or
their gradient) transposed, and none computes the SwiGLU's gradient while writing it transposed (0 does both); with
2, nothing as large as the GELU's output or the logits is written transposed (1 does both).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtune.models import layers
from jaxtune.models.gpt2 import PRESETS as GPT2
from jaxtune.models.llama import PRESETS as LLAMA
from jaxtune.models.registry import build_model

B, T, N, K, H = 2, 256, 4, 2, 32


def _qkv(kv_heads: int):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((B, T, n, H)).astype(np.float32)) for n in (N, kv_heads, kv_heads)]


def _mask(kind: str):
    if kind == "causal":
        return None
    segments = jnp.asarray(np.repeat(np.arange(1, 3), T // 2)[None].repeat(B, 0))  # two documents a row
    if kind == "packed":
        return layers.attention_mask(layers.MaskSpec(T, T, segment_ids=segments))
    branches = jnp.asarray(np.repeat(np.array([0, 1, 2]), [T // 2, T // 4, T // 4])[None].repeat(B, 0))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))  # a shared prompt, then two branches after it
    return layers.attention_mask(layers.MaskSpec(T, T, segment_ids=jnp.ones((B, T), jnp.int32), branch_ids=branches,
                                                 positions=positions))


def _attention_grad(formulation: int, mask, softcap=None):
    def loss(q, k, v):
        out = layers.attention(q, k, v, mask, None, softcap=softcap, formulation=formulation)
        return jnp.sum(out * jnp.cos(out)), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("kv_heads", [K, N], ids=["grouped", "multi-head"])
@pytest.mark.parametrize("kind,softcap", [("causal", None), ("packed", None), ("branches", 30.0)])
def test_head_major_attention_equals_the_positions_first_one(kv_heads, kind, softcap):
    q, k, v = _qkv(kv_heads)
    mask = _mask(kind)
    (_, new), g_new = _attention_grad(1, mask, softcap)(q, k, v)
    (_, old), g_old = _attention_grad(0, mask, softcap)(q, k, v)
    for a, b in zip((new, *g_new), (old, *g_old), strict=True):  # k's and v's gradients sum T G rows another way
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 2e-6 * np.abs(np.asarray(b)).max()


def _transposing_fusions(hlo: str) -> list[tuple[int, int]]:
    """(elements written, arithmetic ops inside) of each loop fusion of a compiled CPU program that transposes."""
    found = re.finditer(r"^(%[\w.-]+) .*?\{\n(.*?)\n\}", hlo, re.DOTALL | re.MULTILINE)
    bodies = {m.group(1): m.group(2) for m in found}
    out = []
    for m in re.finditer(r"= f32\[([\d,]+)\]\{[\d,]+\} fusion\([^)]*\), kind=kLoop, calls=(%[\w.-]+)", hlo):
        body = bodies.get(m.group(2), "")
        if " transpose(" in body:
            ops = len(re.findall(r" (?:multiply|add|subtract|exponential|divide|negate)\(", body))
            out.append((int(np.prod([int(d) for d in m.group(1).split(",")])), ops))
    return out


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's layouts")
def test_head_major_gradient_writes_no_scores_transposed():
    """Formulation 0's gradient writes the (B, N, T, S) scores transposed (4 fusions here); 1's writes none: only
    the (B, T, N, H) queries, keys and values and their gradients move."""
    q, k, v = _qkv(K)
    scores = B * N * T * T
    written = {f: _transposing_fusions(_attention_grad(f, _mask("packed")).lower(q, k, v).compile().as_text())
               for f in (1, 0)}
    assert sum(n >= scores for n, _ in written[0]) >= 2  # what formulation 1 removes is there to remove
    assert all(n < scores for n, _ in written[1]), written[1]


def _swiglu_grad(formulation: int):
    rngs = nnx.Rngs(0)
    gate, up = (layers.Dense(64, 256, ("embed", "mlp"), rngs=rngs, bias=False, formulation=formulation)
                for _ in range(2))
    down = layers.Dense(256, 64, ("mlp", "embed"), rngs=rngs, bias=False, formulation=formulation)
    graph, weights = nnx.split((gate, up, down))

    def loss(weights, x):
        g, u, d = nnx.merge(graph, weights)
        y = d(jax.nn.silu(g(x)) * u(x))
        return jnp.sum(y * jnp.cos(y))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), weights


def test_dense_gradients_equal_autodiffs_and_leave_the_swiglu_gradient_untransposed():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 128, 64)).astype(np.float32))
    (new, weights), (plain, _) = _swiglu_grad(1), _swiglu_grad(0)
    (a, ga), (b, gb) = new(weights, x), plain(weights, x)
    assert float(a) == float(b)
    for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        assert np.abs(np.asarray(u) - np.asarray(w)).max() <= 1e-6 * np.abs(np.asarray(w)).max()
    if jax.default_backend() != "cpu":
        return
    hidden = 2 * 128 * 256  # (tokens, d_ff)
    written = {f: [ops for n, ops in _transposing_fusions(grad.lower(weights, x).compile().as_text()) if n >= hidden]
               for f, grad in ((1, new), (0, plain))}
    assert max(written[0]) >= 4  # autodiff's: the SwiGLU's gradient computed while written transposed
    assert max(written[1], default=0) <= 1, written[1]  # at most the activation's product, re-read


def _model_loss_and_grads(family, formulation: int):
    model = build_model(family["tiny"](vocab_size=128, formulation=formulation), 0)
    graph, params = nnx.split(model)
    tokens = jnp.asarray(np.random.default_rng(2).integers(1, 128, (2, 64)))
    segments = jnp.asarray(np.repeat([1, 2], 32)[None].repeat(2, 0))

    def loss(params):
        logits = nnx.merge(graph, params)(tokens[:, :-1], segment_ids=segments[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("formulation", [1, 2])
@pytest.mark.parametrize("family", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_each_formulation_gives_a_models_loss_and_gradients(family, formulation):
    (new, g_new), (old, g_old) = _model_loss_and_grads(family, formulation), _model_loss_and_grads(family, 0)
    assert abs(float(new) - float(old)) <= 1e-5 * abs(float(old))
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old), strict=True):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5 * np.abs(np.asarray(b)).max() + 1e-9


def _gelu_mlp_and_head_grad(formulation: int, vocab: int = 2048):
    """GPT-2's MLP (64 -> 256 -> 64, tanh GELU) and a tied output head over ``vocab`` words."""
    rngs = nnx.Rngs(0)
    fc = layers.Dense(64, 256, ("embed", "mlp"), rngs=rngs, formulation=formulation)
    proj = layers.Dense(256, 64, ("mlp", "embed"), rngs=rngs, formulation=formulation)
    table = layers.Embed(vocab, 64, ("vocab", "embed"), rngs=rngs, formulation=formulation)
    graph, weights = nnx.split((fc, proj, table))

    def loss(weights, x):
        fc, proj, table = nnx.merge(graph, weights)
        logits = table.attend(x + proj(jax.nn.gelu(fc(x), approximate=True)))
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0])

    return jax.jit(jax.value_and_grad(loss)), weights


def test_formulation_2_transposes_the_narrower_operand_of_a_weight_gradient():
    """Formulation 2 changes two weight gradients, to the same values: a dense layer narrower out than in (GPT-2's
    down projection) and the output head. With 1 XLA:CPU writes the GELU's (tokens, 256) output transposed while
    computing it again, and the head's (tokens, vocab) logits gradient transposed; with 2 it transposes neither, only
    the narrower output gradient and hidden states."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 128, 64)).astype(np.float32))
    grads = {f: _gelu_mlp_and_head_grad(f) for f in (2, 1, 0)}
    (a, ga), (b, gb) = (grads[f][0](grads[f][1], x) for f in (2, 0))
    assert abs(float(a) - float(b)) <= 1e-6 * abs(float(b))
    for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        assert np.abs(np.asarray(u) - np.asarray(w)).max() <= 1e-6 * np.abs(np.asarray(w)).max()
    if jax.default_backend() != "cpu":
        return
    hidden, logits = 2 * 128 * 256, 2 * 128 * 2048
    written = {f: _transposing_fusions(grad.lower(weights, x).compile().as_text()) for f, (grad, weights) in
               grads.items() if f}
    assert any(n == hidden and ops >= 2 for n, ops in written[1]), written[1]  # the GELU, computed as transposed
    assert any(n >= logits for n, _ in written[1]), written[1]
    assert all(n < hidden for n, _ in written[2]), written[2]
