"""Mixtures of experts (`jaxtune.models.moe`, the ``qwen3_moe`` family): the dropless grouped products against a loop
over the experts (values and gradients), dense layers among sparse ones against transformers, LoRA on the attention
against PEFT, the parameter and FLOP counts, and the configurations refused. The every-layer-sparse checkpoint's
logits, export, generation, padding and scanned layers are test_hf.py's zoo case ``qwen3_moe``."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.compare import rel
from helpers.tiny_hf import peft_reload

from jaxtune.models.hf import HFCheckpoint, from_hf, hf_tensors, load_params, read_hf_config
from jaxtune.models.layers import LoraSpec
from jaxtune.models.lora import write_adapter
from jaxtune.models.moe import blocked_matmul, dropless, route
from jaxtune.models.registry import merge, model_layout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 128
IDS = np.random.default_rng(3).integers(0, VOCAB, (2, 24))


def _loop_over_experts(x, experts, weights, gate, up, down):
    """transformers' way, in float64 numpy: each expert's tokens in turn, weighted and added to their rows."""
    x, gate, up, down = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    silu = lambda z: z / (1 + np.exp(-z))
    for e in range(gate.shape[0]):
        for t, slot in zip(*np.nonzero(np.asarray(experts) == e)):
            h = silu(x[t] @ gate[e]) * (x[t] @ up[e])
            out[t] += float(weights[t, slot]) * (h @ down[e])
    return out


def _dense_reference(x, routing, gate, up, down):
    """Every expert on every token, weighted by the routing's weights scattered over the experts (0 where a token did
    not choose one): the same function as `dropless`, by plain autodiff-able einsums."""
    n = gate.shape[0]
    w = jnp.zeros((x.shape[0], n), x.dtype).at[jnp.arange(x.shape[0])[:, None], routing.experts].add(routing.weights)
    h = jax.nn.silu(jnp.einsum("td,edf->tef", x, gate)) * jnp.einsum("td,edf->tef", x, up)
    return jnp.einsum("tef,efd,te->td", h, down, w)


@pytest.mark.parametrize("norm_topk", [False, True])
def test_dropless_equals_a_loop_over_experts(norm_topk):
    """40 tokens, 6 experts, 2 a token (some experts get none): `dropless` equals the per-expert loop to 1e-5
    (relative, float32 against float64), and its gradients with respect to the tokens, the router's logits and the
    three expert matrices equal those of the all-experts reference to 1e-5."""
    rng = np.random.default_rng(0)
    t, d, f, n = 40, 16, 8, 6
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, n)) * 2, jnp.float32).at[:, 5].add(-30.0)  # expert 5: no token
    gate, up, down = (jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
                      for s in ((n, d, f), (n, d, f), (n, f, d)))
    routing = route(logits, 2, norm_topk)
    assert not np.any(np.asarray(routing.experts) == 5)
    sums = np.asarray(routing.weights.sum(-1))
    assert np.allclose(sums, 1.0, atol=1e-6) if norm_topk else np.all(sums < 1.0)
    got = dropless(x, routing, gate, up, down, jax.nn.silu)
    want = _loop_over_experts(x, routing.experts, routing.weights, gate, up, down)
    assert rel(got, want) <= 1e-5

    probe = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)

    def loss(fn, x, logits, gate, up, down):
        return jnp.sum(probe * fn(x, route(logits, 2, norm_topk), gate, up, down))

    ours = jax.grad(lambda *a: loss(lambda x, r, g, u, dn: dropless(x, r, g, u, dn, jax.nn.silu), *a),
                    argnums=(0, 1, 2, 3, 4))(x, logits, gate, up, down)
    ref = jax.grad(lambda *a: loss(_dense_reference, *a), argnums=(0, 1, 2, 3, 4))(x, logits, gate, up, down)
    for name, a, b in zip(("x", "logits", "gate", "up", "down"), ours, ref):
        assert rel(a, b) <= 1e-5, name
    assert float(jnp.abs(ours[3][5]).max()) == 0.0  # the expert no token chose has no gradient


@pytest.mark.parametrize("sizes", [[0, 7, 0, 30, 3], [40, 0, 0, 0, 0], [1, 1, 1, 1, 36]])
def test_blocked_products_equal_ragged_dot(sizes):
    """The CPU's grouped product (blocks of 8 rows of one group each: groups empty, smaller than a block, several
    blocks long) equals `jax.lax.ragged_dot` (XLA's own, which multiplies by every group), and so do its gradients
    with respect to the rows and the weights, to 1e-5."""
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.standard_normal((40, 12)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5, 12, 6)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal((40, 6)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    ours = jax.value_and_grad(lambda r, w: jnp.sum(probe * blocked_matmul(r, w, sizes, 8)), argnums=(0, 1))
    ref = jax.value_and_grad(lambda r, w: jnp.sum(probe * jax.lax.ragged_dot(r, w, sizes)), argnums=(0, 1))
    (v, (gr, gw)), (v_ref, (gr_ref, gw_ref)) = ours(rows, w), ref(rows, w)
    assert rel(blocked_matmul(rows, w, sizes, 8), jax.lax.ragged_dot(rows, w, sizes)) <= 1e-5
    assert abs(float(v) - float(v_ref)) <= 1e-4 * abs(float(v_ref))
    assert rel(gr, gr_ref) <= 1e-5 and rel(gw, gw_ref) <= 1e-5


def _checkpoint(tmp_path, seed: int, **config):
    c = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False,
                                    max_position_embeddings=64, attn_implementation="eager", **config)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(c).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    return hf


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.from_numpy(ids)).logits.float().numpy()


@pytest.mark.parametrize("config,dense", [({"mlp_only_layers": [1]}, (1,)),
                                          ({"decoder_sparse_step": 2, "norm_topk_prob": True}, (0, 2))])
def test_dense_layers_among_sparse_ones_match_transformers(tmp_path, config, dense):
    """mlp_only_layers and decoder_sparse_step leave some layers dense (the unnormalised router weights in the first
    case): the config reads them, the logits equal transformers' (rel <= 1e-5) and the tensors written back are the
    checkpoint's, name for name and bit for bit, in transformers' per-expert layout."""
    hf = _checkpoint(tmp_path, 0, **config)
    fam, cfg, _ = read_hf_config(tmp_path)
    assert cfg.family == "qwen3_moe" and cfg.dense_layers == dense and cfg.n_experts == 4
    model = from_hf(tmp_path)
    assert rel(np.asarray(model(jnp.asarray(IDS))), _hf_logits(hf, IDS)) <= 1e-5
    written = hf_tensors(fam, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    ckpt = HFCheckpoint(tmp_path)
    assert set(written) == ckpt.names()
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in written or 0 in dense
    assert all(np.array_equal(written[k], ckpt.get(k)) for k in written)
    exported = fam.to_hf(cfg)
    assert fam.from_hf(exported) == cfg  # config.json both ways


def test_lora_on_the_attention_matches_peft(tmp_path):
    """Random adapters on q, k, v and o of every layer, the experts frozen: the adapter directory jaxtune writes
    loads in PEFT on the checkpoint, with our logits (rel <= 1e-5); the base alone is far from them."""
    ckpt_dir = tmp_path / "base"
    hf = _checkpoint(ckpt_dir, 1, mlp_only_layers=[2])
    fam, cfg, _ = read_hf_config(ckpt_dir)
    cfg = cfg.replace(lora=LoraSpec(rank=4, alpha=8, targets=("q", "k", "v", "o")))
    graphdef, (abstract_adapters, abstract_base), _ = model_layout(cfg, None)
    base = load_params(HFCheckpoint(ckpt_dir), fam, abstract_base)
    rng = np.random.default_rng(5)
    adapters = jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), abstract_adapters)
    out = write_adapter(tmp_path / "adapter", fam, cfg.lora, adapters, base_model=str(ckpt_dir))
    ours = np.asarray(merge(graphdef, (adapters, base))(jnp.asarray(IDS)))
    theirs = _hf_logits(peft_reload(hf, out), IDS)
    assert rel(ours, theirs) <= 1e-5
    assert rel(_hf_logits(transformers.AutoModelForCausalLM.from_pretrained(ckpt_dir).eval(), IDS), theirs) > 1e-3


def test_parameter_and_flop_counts_are_the_active_experts(tmp_path):
    """num_params is transformers' parameter count; the FLOPs per token count the router and the 2 experts a token
    reaches of 4, not all 4 (an MFU against every expert's weights would overstate a MoE step twofold here)."""
    hf = _checkpoint(tmp_path, 2, mlp_only_layers=[1])
    _, cfg, _ = read_hf_config(tmp_path)
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    d, f, sparse = cfg.d_model, cfg.moe_d_ff, sum(cfg.sparse)
    assert cfg.num_params() - cfg.num_params(active=True) == sparse * 2 * 3 * d * f  # 2 experts unread a layer
    assert cfg.flops_per_token(16) == 6 * (cfg.num_params(non_embedding=True, active=True) + VOCAB * d) \
        + 12 * cfg.n_head * cfg.hd * 16 * cfg.n_layer


@pytest.mark.parametrize("change,named", [
    ({"scan_layers": True}, "model.scan_layers"),
    ({"lora": LoraSpec(rank=4, alpha=8, targets=("q", "gate"))}, "model.lora.targets: gate"),
])
def test_what_a_mixture_does_not_take_is_refused(tmp_path, change, named):
    """Scanned layers over dense and sparse ones, and LoRA on the experts (not yet per expert), are one line naming
    the key, at config time."""
    _checkpoint(tmp_path, 3, mlp_only_layers=[1])
    _, cfg, _ = read_hf_config(tmp_path)
    with pytest.raises(ValueError, match=named):
        cfg.replace(**change)


def test_config_json_names_the_experts_as_transformers_reads_them(tmp_path):
    """The exported config.json is transformers': it builds the checkpoint's own mixture from it, whether the experts'
    count is written ``num_experts`` (as jaxtune writes it) or ``num_local_experts`` (as transformers 5 saves it)."""
    _checkpoint(tmp_path, 4, mlp_only_layers=[0])
    fam, cfg, raw = read_hf_config(tmp_path)
    assert "num_local_experts" in raw and "num_experts" not in raw
    exported = fam.to_hf(cfg)
    theirs = transformers.Qwen3MoeConfig(**{k: v for k, v in exported.items() if k != "architectures"})
    original = transformers.AutoConfig.from_pretrained(tmp_path)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                "decoder_sparse_step", "intermediate_size"):
        assert getattr(theirs, key) == getattr(original, key), key
    renamed = {**{k: v for k, v in raw.items() if k != "num_local_experts"}, "num_experts": raw["num_local_experts"]}
    (tmp_path / "config.json").write_text(json.dumps(renamed))
    assert read_hf_config(tmp_path)[1] == cfg


def test_a_checkpoint_asking_for_the_load_balancing_loss_is_refused_for_training(tmp_path):
    """output_router_logits: true asks for the router's load-balancing loss, which jaxtune does not compute yet: the
    config reads its weight, and building a training state refuses it in one line naming the file's keys, rather
    than training without it."""
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import ConfigError, load_config

    _checkpoint(tmp_path, 5, output_router_logits=True, router_aux_loss_coef=0.02)
    fam, cfg, _ = read_hf_config(tmp_path)
    assert cfg.router_aux_loss == 0.02 and fam.from_hf(fam.to_hf(cfg)) == cfg
    run = load_config(None, [f"model.from_hf={tmp_path}"])
    with pytest.raises(ConfigError, match="output_router_logits: true, router_aux_loss_coef 0.02") as e:
        make_state_spec(run, VOCAB, sharding.make_mesh(1, 1, 1))
    assert "\n" not in str(e.value)


MESH_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
from jaxtune import sharding
from jaxtune.models import from_hf

assert jax.device_count() == 8, jax.devices()
directory, ids, out = sys.argv[1], np.load(sys.argv[2]), sys.argv[3]
results = {}
for shape in ([2, 2, 2], [1, 8, 1], [8, 1, 1]):
    mesh = sharding.make_mesh(*shape)
    graphdef, params = nnx.split(from_hf(directory, mesh=mesh), nnx.Param)

    def loss(p, x):
        logits = nnx.merge(graphdef, p)(x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    with sharding.use_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        value, grads = step(params, jnp.asarray(ids))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]
    results["x".join(map(str, shape))] = {"loss": float(value),
                                          "grads": {jax.tree_util.keystr(k): np.asarray(g).tolist() for k, g in flat}}
json.dump(results, open(out, "w"))
"""


def test_routing_per_device_on_a_mesh_equals_one_device(tmp_path):
    """On 8 simulated CPU devices (a subprocess), meshes (data, fsdp, tensor) 2x2x2, 1x8x1 and 8x1x1: each device
    routes its own rows (`jax.shard_map`), and the loss and every gradient, the router's and the experts' included,
    equal one device's to 1e-5 (float32 partial sums in another order)."""
    import os
    import subprocess
    import sys

    import optax

    _checkpoint(tmp_path / "ckpt", 6, mlp_only_layers=[1])
    ids = np.random.default_rng(4).integers(0, VOCAB, (8, 17)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "ids.npy"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    graphdef, params = nnx.split(from_hf(tmp_path / "ckpt"), nnx.Param)

    def loss(p, x):
        logits = nnx.merge(graphdef, p)(x[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params, jnp.asarray(ids))
    single = {jax.tree_util.keystr(k): np.asarray(g)
              for k, g in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(grads))[0]}
    for shape, got in json.loads((tmp_path / "out.json").read_text()).items():
        assert abs(got["loss"] - float(value)) <= 1e-5 * abs(float(value)), shape
        assert set(got["grads"]) == set(single)
        for k, g in got["grads"].items():
            assert rel(np.asarray(g), single[k]) <= 1e-5, (shape, k)
        assert any("router" in k for k in single) and any(k.endswith("['down']") for k in single)
