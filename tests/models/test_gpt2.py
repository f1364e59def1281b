"""GPT-2 model: logits against `transformers` on the same weights, and every execution path against the plain one.

Error measure throughout: rel(a, b) = max|a - b| / max|b| (b is the reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.compare import rel

from jaxtune.models.gpt2 import GPT, PRESETS, GPTConfig

B, T = 2, 16


def tokens(seed: int = 0, shape=(B, T), vocab: int = 512) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def abstract(cfg: GPTConfig) -> GPT:
    """The model of ``cfg`` with ShapeDtypeStruct leaves: structure and shapes, nothing allocated."""
    return nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(params=0)))


def with_params(cfg: GPTConfig, params: dict) -> GPT:
    """Model of ``cfg`` carrying ``params``."""
    return nnx.merge(nnx.split(abstract(cfg), nnx.Param)[0], params)


@functools.partial(jax.jit, static_argnums=0)
def forward(cfg: GPTConfig, params: dict, ids: jax.Array, key: jax.Array | None = None) -> jax.Array:
    """Jitted plain forward (B, T) -> (B, T, V); eager dispatch would compile op by op and take seconds."""
    return with_params(cfg, params)(ids, key=key)


@functools.partial(jax.jit, static_argnums=0)
def cached_forward(cfg: GPTConfig, params: dict, ids, positions, cache, index, key_valid):
    return with_params(cfg, params)(ids, positions=positions, cache=cache, index=index, key_valid=key_valid)


def stack_blocks(params: dict) -> dict:
    """Loop layout {blocks: {0: tree, 1: tree}} -> scan layout {blocks: tree with a leading layer axis}."""
    blocks = [params["blocks"][i] for i in sorted(params["blocks"])]
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}


@pytest.fixture(scope="module")
def cfg() -> GPTConfig:
    return PRESETS["tiny"](max_seq_len=64)


@pytest.fixture(scope="module")
def params(cfg, gpt_params) -> dict:
    return gpt_params(cfg)


# --- HF reference -------------------------------------------------------------------------------------------------


def test_logits_match_transformers_gpt2(hf_gpt2_to_params):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=512, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, layer_norm_epsilon=1e-5,
        bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    # HF initialises biases to 0 and LayerNorms to (1, 0): perturb every tensor so a transposed or swapped
    # mapping cannot hide behind a constant.
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))

    cfg = PRESETS["tiny"](max_seq_len=64, ln_eps=1e-5)
    ids = np.asarray(tokens(1))
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = forward(cfg, hf_gpt2_to_params(hf, cfg.n_layer), jnp.asarray(ids))
    assert got.shape == want.shape == (B, T, 512)
    assert rel(got, want) <= 1e-5  # max|a-b| / max|b|, fp32


# --- execution paths agree ------------------------------------------------------------------------------------------


def test_scan_layers_matches_loop(cfg, params):
    ids = tokens()
    want = forward(cfg, params, ids)
    got = forward(cfg.replace(scan_layers=True), stack_blocks(params), ids)
    assert rel(got, want) <= 1e-6


@functools.partial(jax.jit, static_argnums=0)
def logits_and_grads(cfg: GPTConfig, params: dict, ids: jax.Array):
    """Next-token cross-entropy on ids; returns (logits, d loss / d params)."""

    def loss(p):
        logits = with_params(cfg, p)(ids[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], -1).mean(), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


@pytest.fixture(scope="module")
def reference_grads(cfg, params):
    return logits_and_grads(cfg, params, tokens(2))


# The policies under both layer layouts, against one loop/no-remat reference (scan == loop is tested above); offload
# keeps each layer's input in host memory: one stacked (layers, B, T, D) residual under scan, one a layer in the loop,
# and nothing else there.
@pytest.mark.parametrize("remat,scan", [("full", False), ("dots", True), ("offload", False), ("offload", True)],
                         ids=["full-loop", "dots-scan", "offload-loop", "offload-scan"])
def test_remat_same_logits_and_grads(cfg, params, reference_grads, remat, scan, capsys):
    want_logits, want_grads = reference_grads
    p = stack_blocks(params) if scan else params
    c = cfg.replace(scan_layers=scan, remat=remat)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(lambda p: with_params(c, p)(tokens(2)[:, :-1]).sum(), p)
    on_host = [line for line in capsys.readouterr().out.splitlines() if "<host>" in line]
    layer_input = f"[{cfg.n_layer},{B},{T - 1},{cfg.d_model}]" if scan else f"[{B},{T - 1},{cfg.d_model}]"
    assert len(on_host) == (0 if remat != "offload" else 1 if scan else cfg.n_layer), on_host
    assert all(layer_input in line for line in on_host), on_host
    got_logits, got_grads = logits_and_grads(c, p, tokens(2))
    if scan:
        want_grads = stack_blocks(want_grads)
    assert rel(got_logits, want_logits) <= 1e-6
    errs = jax.tree.map(rel, got_grads, want_grads)
    assert max(jax.tree.leaves(errs)) <= 1e-6, errs


@pytest.mark.parametrize("scan", [False, True], ids=["loop", "scan"])
def test_kv_cache_prefill_then_decode_matches_full_forward(cfg, params, scan):
    c, p = cfg.replace(scan_layers=scan), (stack_blocks(params) if scan else params)
    ids = tokens(3)
    full = forward(c, p, ids)
    prefill = 10
    key_valid = jnp.ones((B, T), bool)
    cache = abstract(c).init_cache(B, T)
    assert cache.k.shape == (cfg.n_layer, B, cfg.n_head, cfg.head_dim, T)  # keys: slots last (`KVCache`)
    assert cache.v.shape == (cfg.n_layer, B, cfg.n_head, T, cfg.head_dim)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits, cache = cached_forward(c, p, ids[:, :prefill], pos[:, :prefill], cache, 0, key_valid)
    out = [logits]
    for i in range(prefill, T):  # one decode compile: index is traced
        logits, cache = cached_forward(c, p, ids[:, i:i + 1], pos[:, i:i + 1], cache, i, key_valid)
        out.append(logits)
    got = jnp.concatenate(out, axis=1)
    assert got.shape == full.shape
    assert rel(got, full) <= 1e-5


def test_left_padding_matches_unpadded(cfg, params):
    """Generator's layout: prompts left-padded to 10 slots in a 16-slot cache; row 0 has 4 pads, row 1 none.

    Pads are masked (key_valid False) and the real tokens take positions from 0, so each row's logits equal the
    unpadded forward's, and nothing is NaN (a pad query sees no valid key at all).
    """
    ids = tokens(4)
    n_pad, p = 4, 10
    valid = jnp.ones((B, p), bool).at[0, :n_pad].set(False)
    prompt = jnp.where(valid, ids[:, :p], 0)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    key_valid = jnp.concatenate([valid, jnp.ones((B, T - p), bool)], axis=1)  # later slots: decoded tokens
    logits, cache = cached_forward(cfg, params, prompt, positions, abstract(cfg).init_cache(B, T), 0, key_valid)
    assert jnp.isfinite(logits).all()
    assert jnp.isfinite(cache.k).all() and jnp.isfinite(cache.v).all()
    # reference: row 0's real tokens at the front, nothing before them (causal: what follows does not matter)
    unpadded = forward(cfg, params, ids.at[0, :p - n_pad].set(ids[0, n_pad:p]))
    assert rel(logits[0, n_pad:], unpadded[0, :p - n_pad]) <= 1e-5
    assert rel(logits[1], unpadded[1, :p]) <= 1e-5


def test_bf16_compute_close_to_fp32_and_returns_fp32(cfg, params):
    ids = tokens(5)
    want = forward(cfg, params, ids)
    bf16 = cfg.replace(compute_dtype="bfloat16")
    assert abstract(bf16).wte.embedding.dtype == jnp.float32  # params stay fp32 (param_dtype's default)
    got = forward(bf16, params, ids)
    assert got.dtype == jnp.float32
    assert jnp.isfinite(got).all()
    assert rel(got, want) <= 5e-2


def test_dropout_is_keyed(cfg, params):
    drop = cfg.replace(dropout=0.1)
    ids = tokens(6)
    eval_out = forward(drop, params, ids)
    np.testing.assert_array_equal(forward(drop, params, ids), eval_out)  # key=None: deterministic ...
    np.testing.assert_array_equal(eval_out, forward(cfg, params, ids))  # ... and no dropout at all
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a, a_again, b = forward(drop, params, ids, k1), forward(drop, params, ids, k1), forward(drop, params, ids, k2)
    np.testing.assert_array_equal(a, a_again)
    assert not np.allclose(a, b)
    assert not np.allclose(a, eval_out)


# --- parameter count ----------------------------------------------------------------------------------------------


def count(cfg: GPTConfig) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract(cfg), nnx.Param)))


SIZED = {
    "tiny": PRESETS["tiny"](),
    "tiny-scan-dff": PRESETS["tiny"](scan_layers=True, d_ff=96),
    "gpt2-124m": PRESETS["gpt2-124m"](),
}


@pytest.mark.parametrize("name", SIZED)
def test_num_params_matches_parameters(name):
    cfg = SIZED[name]
    assert cfg.num_params() == count(cfg)
    assert cfg.num_params(non_embedding=True) == count(cfg) - (cfg.vocab_size + cfg.max_seq_len) * cfg.d_model


def test_gpt2_small_has_its_known_size():
    assert PRESETS["gpt2-124m"](vocab_size=50257).num_params() == 124_439_808
