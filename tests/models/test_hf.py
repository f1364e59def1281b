"""HuggingFace model zoo: `jaxtune.models.from_hf` / `export` against `transformers` on the same weights.

Every family (gpt2, llama, qwen2, qwen3, mistral, gemma3_text) is a tiny random model built locally with the
`transformers` config classes (no downloads), every tensor perturbed with noise (HF initialises biases to 0 and
Gemma's norm weights to 0, which would hide a swapped or transposed mapping), and saved with ``save_pretrained``.

Error measure throughout: rel(ours, ref) = max|ours - ref| / max|ref| over the whole logits tensor (over the real,
unpadded positions only in the padding tests). Tolerances:
  * from_hf logits vs transformers, fp32 (bf16 checkpoints: both upcast to fp32):  rel <= 1e-5
  * export -> transformers reload vs the original transformers model:              rel <= 1e-6
  * export -> from_hf re-import vs the first import:                               params bitwise equal
  * greedy generation (Generator, KV cache) vs transformers generate, 32 tokens:   token ids equal
  * left/right padded batch vs transformers on the real positions:                 rel <= 1e-5, no NaN
  * transformers 4.x config.json vs the 5.x one, same weights:                     same config, rel <= 1e-6
  * 8-device sharded load vs single device:                                        params bitwise, rel <= 3e-6
  * scan_layers vs the loop layout:                                                rel <= 2e-6, same tokens
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.compare import rel

from jaxtune.export import export
from jaxtune.io import CheckpointError, write_safetensors
from jaxtune.models.hf import HFCheckpoint, from_hf, read_hf_config
from jaxtune.models.sampling import Generator
from jaxtune.models.unsupported import UnsupportedModelError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 40
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))  # the logits tests' batch
PROMPTS = [p.tolist() for p in np.split(np.random.default_rng(7).integers(0, VOCAB, 18), [5])]  # 5 and 13 tokens
# std of the noise added to every HF tensor: large enough that greedy decoding does not collapse into repeating
# one token (top-2 logit margins stay >= ~1e-3 relative, far above the 1e-6 numerical differences). Gemma 3
# multiplies its (tied) embeddings by sqrt(d_model): more noise there makes it echo its input token instead.
NOISE = {"gemma3": 0.05}
DEFAULT_NOISE = 0.2

# --- the zoo --------------------------------------------------------------------------------------------------------

_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 2,
           "eos_token_id": 1, "attn_implementation": "eager"}


def _configs():
    T = transformers
    return {
        # MHA, tied (GPT-2 always is), fused q/k/v Conv1D weights
        "gpt2": (T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=2,
                              eos_token_id=1, attn_implementation="eager"), "float32", None),
        # untied, GQA, llama3 rope scaling with all three frequency bands at head_dim 16 (original length 64:
        # wavelengths 6.3 (kept), 32 (smoothed), 167+ (scaled)), attention + MLP biases, sharded index
        "llama": (T.LlamaConfig(**_COMMON, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 64}),
                  "float32", "20KB"),
        # bf16, tied, q/k/v bias, layer 0 full and layer 1 sliding (window 8 < SEQ), sharded index
        "qwen2": (T.Qwen2Config(**_COMMON, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                                max_window_layers=1), "bfloat16", "20KB"),
        # q/k norm, head_dim 12 set apart from d_model/n_head (16), multi-query (one kv head), tied
        "qwen3": (T.Qwen3Config(**{**_COMMON, "num_key_value_heads": 1}, head_dim=12, tie_word_embeddings=True),
                  "float32", None),
        # a mixture of experts in every layer: 8 experts of 32, 2 a token, their weights renormalised; untied, q/k
        # norm, head_dim 16 (tests/models/test_moe.py: dense layers among sparse ones, and the routing itself)
        "qwen3_moe": (T.Qwen3MoeConfig(**_COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False),
                      "float32", None),
        # bf16, untied, every layer sliding (window 8 < SEQ), head_dim 24
        "mistral": (T.MistralConfig(**_COMMON, head_dim=24, sliding_window=8, tie_word_embeddings=False),
                    "bfloat16", None),
        # 3 layers sliding/full/sliding (window 8), head_dim 20, query_pre_attn_scalar 16 (not head_dim),
        # non-default RoPE bases for both layer kinds, final logit soft-cap, tied
        "gemma3": (T.Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=20, sliding_window=8,
                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                      query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                                      rope_parameters={
                                          "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0}}),
                   "float32", None),
    }


NAMES = ["gpt2", "llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe"]


@dataclasses.dataclass
class Case:
    name: str
    dir: Path
    hf: object  # the transformers model in fp32, eval mode (a bf16 checkpoint's weights upcast exactly)
    dtype: str  # the checkpoint's dtype


class Zoo:
    """Builds each tiny HF checkpoint once (lazily), and caches what tests share."""

    def __init__(self, root: Path):
        self.root = root
        self.cases: dict[str, Case] = {}
        self.models: dict[str, nnx.Module] = {}
        self.ref: dict[str, np.ndarray] = {}
        self.greedy_ref: dict[str, list[list[int]]] = {}

    def case(self, name: str) -> Case:
        if name not in self.cases:
            config, dtype, shard = _configs()[name]
            torch.manual_seed(NAMES.index(name))
            m = transformers.AutoModelForCausalLM.from_config(config).eval()
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(NOISE.get(name, DEFAULT_NOISE) * torch.randn_like(p))
            d = self.root / name
            if dtype == "bfloat16":
                m.to(torch.bfloat16)
            m.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
            if dtype == "bfloat16":
                # The fp32 reference on exactly the stored (bf16-rounded) weights: loaded back rather than
                # m.float(), since m.to(bfloat16) also rounded the RoPE inv_freq buffer, which .float() keeps.
                m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
            assert json.loads((d / "config.json").read_text())["dtype"] == dtype
            if shard:
                assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 1
            self.cases[name] = Case(name, d, m, dtype)
        return self.cases[name]

    def model(self, name: str) -> nnx.Module:
        """from_hf in fp32 (a bf16 checkpoint upcast exactly)."""
        if name not in self.models:
            self.models[name] = from_hf(self.case(name).dir, param_dtype="float32")
        return self.models[name]

    def greedy(self, name: str) -> list[list[int]]:
        """transformers' 32 greedy tokens after each of PROMPTS, each prompt alone, never stopping at EOS."""
        if name not in self.greedy_ref:
            hf = self.case(name).hf
            # A generation_config passed to generate() takes an unset (None) eos from the model's own
            # generation_config (eos 1 here), and min_new_tokens would then mask token 1 instead of running plain
            # greedy; so clear the model's, and the tests check that all 32 tokens come back.
            eos, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
            try:
                out = []
                for prompt in PROMPTS:
                    with torch.no_grad():
                        seq = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, pad_token_id=0,
                                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
                    out.append(seq[0, len(prompt):].tolist())
            finally:
                hf.generation_config.eos_token_id = eos
            self.greedy_ref[name] = out
        return self.greedy_ref[name]

    def ref_logits(self, name: str) -> np.ndarray:
        if name not in self.ref:
            self.ref[name] = hf_logits(self.case(name).hf, IDS)
        return self.ref[name]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("hf-zoo"))


# --- helpers --------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, tokens, positions, key_valid):
    return nnx.merge(graphdef, params)(tokens, positions=positions, key_valid=key_valid)


def logits(model, tokens, positions=None, key_valid=None) -> np.ndarray:
    """Jitted forward of a jaxtune model: (B, T) -> (B, T, V) float32."""
    graphdef, params = nnx.split(model, nnx.Param)
    as_array = lambda x, dt: None if x is None else jnp.asarray(x, dt)
    return np.asarray(_apply(graphdef, params, jnp.asarray(tokens, jnp.int32), as_array(positions, jnp.int32),
                             as_array(key_valid, bool)))


def hf_logits(hf, tokens, attention_mask=None, position_ids=None) -> np.ndarray:
    t = lambda x: None if x is None else torch.as_tensor(np.asarray(x, np.int64))
    with torch.no_grad():
        out = hf(input_ids=t(tokens), attention_mask=t(attention_mask), position_ids=t(position_ids))
    return out.logits.float().numpy()


def params_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), x.dtype, y.dtype)
        bits = f"u{x.dtype.itemsize}"
        assert np.array_equal(x.view(bits), y.view(bits)), jax.tree_util.keystr(path)


def reload_in_transformers(out: Path, kind: type):
    """AutoModelForCausalLM.from_pretrained on an export: the same class, nothing missing or left over."""
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True,
                                                                  attn_implementation="eager")
    assert type(hf) is kind
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return hf.float().eval()


# --- 1. logits against transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(zoo, name):
    """from_hf on the checkpoint vs transformers on the same weights, fp32 (bf16 checkpoints: param_dtype=float32
    against transformers loading them with dtype=float32): rel <= 1e-5."""
    ours = logits(zoo.model(name), IDS)
    ref = zoo.ref_logits(name)
    assert ours.shape == ref.shape == (2, SEQ, VOCAB)
    assert np.isfinite(ours).all()
    assert rel(ours, ref) <= 1e-5


@pytest.mark.parametrize("name", ["qwen2", "mistral"])
def test_bf16_checkpoint_keeps_its_dtype(zoo, name):
    """Without param_dtype the params stay in the checkpoint's bf16, bitwise the stored values."""
    case = zoo.case(name)
    model = from_hf(case.dir)
    assert model.cfg.param_dtype == model.cfg.compute_dtype == "bfloat16"
    leaves = jax.tree.leaves(params_of(model))
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    up = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), params_of(model))
    assert_bitwise_equal(up, params_of(zoo.model(name)))  # fp32 import == bf16 import upcast
    emb = case.hf.get_input_embeddings().weight.detach().numpy()
    assert np.array_equal(up["embed"]["embedding"], emb)


def test_gemma3_attn_logit_softcapping_is_what_transformers_does(zoo, tmp_path):
    """transformers' Gemma3Attention never passes ``attn_logit_softcapping`` to its attention function (unlike
    Gemma 2), so a Gemma 3 config.json that sets it computes the same logits as one that does not; from_hf must
    give transformers' logits for it too (rel <= 1e-5)."""
    case = zoo.case("gemma3")
    c = {**json.loads((case.dir / "config.json").read_text()), "attn_logit_softcapping": 50.0}
    d = _rewritten(case, tmp_path / "capped", c)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    assert hf.config.attn_logit_softcapping == 50.0
    ref = hf_logits(hf, IDS)
    assert rel(ref, zoo.ref_logits("gemma3")) <= 1e-6  # transformers ignores the field
    assert rel(logits(from_hf(d), IDS), ref) <= 1e-5


# --- 2. export -> transformers, and back ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_export_reloads_in_transformers_and_reimports_bitwise(zoo, name, tmp_path):
    """import -> export -> AutoModelForCausalLM: no missing/unexpected keys, logits rel <= 1e-6 vs the original HF
    model; export -> from_hf: params bitwise equal to the first import (in the checkpoint's dtype)."""
    case = zoo.case(name)
    model = from_hf(case.dir)
    out = export(model, tmp_path / "export")
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == case.dtype
    assert not list(tmp_path.glob(".export*"))  # nothing half-written left beside it
    hf = reload_in_transformers(out, type(case.hf))
    assert rel(hf_logits(hf, IDS), zoo.ref_logits(name)) <= 1e-6
    again = from_hf(out)
    assert_bitwise_equal(params_of(again), params_of(model))


def test_export_sharded_with_index(zoo, tmp_path):
    """max_shard_bytes smaller than the model: several files + model.safetensors.index.json that covers every
    tensor; transformers and from_hf both load it (rel <= 1e-6, params bitwise)."""
    case, model = zoo.case("llama"), zoo.model("llama")
    out = export(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in out.glob("*.safetensors")) == files
    assert not (out / "model.safetensors").exists()
    sizes = [os.path.getsize(out / f) for f in files]
    assert index["metadata"]["total_size"] <= sum(sizes)
    stored = set().union(*(HFCheckpoint(out).files[f].entries for f in files))
    assert stored == set(index["weight_map"])
    hf = reload_in_transformers(out, type(case.hf))
    assert rel(hf_logits(hf, IDS), zoo.ref_logits("llama")) <= 1e-6
    assert_bitwise_equal(params_of(from_hf(out)), params_of(model))
    # an existing export is replaced only when asked
    with pytest.raises(FileExistsError):
        export(model, out)
    export(model, out, overwrite=True)
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["sharded"]


def test_export_dtype_cast(zoo, tmp_path):
    """export(dtype=bfloat16) of an fp32 model stores bf16 tensors (config torch_dtype bfloat16) that re-import
    bitwise equal to the fp32 params rounded to bf16."""
    model = zoo.model("gemma3")
    out = export(model, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ck = HFCheckpoint(out)
    assert {e["dtype"] for f in ck.files.values() for e in f.entries.values()} == {"BF16"}
    again = from_hf(out)
    assert again.cfg.param_dtype == "bfloat16"
    want = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params_of(model))
    assert_bitwise_equal(params_of(again), want)


# --- 3. greedy generation -------------------------------------------------------------------------------------------


def generate(model, prompts=PROMPTS) -> list[list[int]]:
    """jaxtune's Generator: the prompts left-padded into one batch, KV cache, greedy, 32 new tokens, no EOS."""
    graphdef, state = nnx.split(model, nnx.Param)
    return Generator(graphdef, model.cfg.max_seq_len)(nnx.to_pure_dict(state), prompts, max_new_tokens=32).ids


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers(zoo, name):
    """32 greedy tokens from jaxtune's Generator (prompts of 5 and 13 tokens left-padded into one batch, KV cache)
    equal transformers' generate (each prompt alone), fp32; the mistral/qwen2/gemma3 windows (8) are far shorter
    than prompt + 32."""
    ours, want = generate(zoo.model(name)), zoo.greedy(name)
    for got, ref in zip(ours, want):
        assert len(ref) == len(got) == 32
        assert len(set(ref)) >= 5  # a real continuation, not one token repeated (which hides cache errors)
        assert got == ref, f"first difference at token {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"


# --- 4. padding -----------------------------------------------------------------------------------------------------


def _padded_batch(side: str):
    """Row 0: SEQ real tokens; row 1: 20 real tokens and 20 padding (more than the windows of 8, so with right
    padding the sliding layers' last padded queries see only padding keys: fully masked rows, the Gemma 3 NaN
    of transformers issue 45491; with left padding every padded query row is fully masked)."""
    mask = np.ones((2, SEQ), bool)
    if side == "left":
        mask[1, :20] = False
    else:
        mask[1, 20:] = False
    tokens = np.where(mask, IDS, 0)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_padding_finite_and_matches_transformers(zoo, name, side):
    """key_valid padding: our logits are finite everywhere (padded rows too) and match transformers (given the
    attention_mask and position_ids = cumsum(mask) - 1 clipped at 0) on the real positions: rel <= 1e-5."""
    tokens, mask, positions = _padded_batch(side)
    ours = logits(zoo.model(name), tokens, positions, mask)
    assert np.isfinite(ours).all()
    ref = hf_logits(zoo.case(name).hf, tokens, mask, positions)
    assert rel(ours[mask], ref[mask]) <= 1e-5
    # the full row is the unpadded reference too
    assert rel(ours[0], zoo.ref_logits(name)[0]) <= 1e-5


# --- 5. transformers 4.x config.json --------------------------------------------------------------------------------


def _to_4x(name: str, c: dict) -> dict:
    """Rewrite a transformers 5.x config.json the way 4.x wrote it."""
    c = dict(c)
    c["torch_dtype"] = c.pop("dtype")
    rope = c.pop("rope_parameters")
    if name == "gemma3":  # global base + local base + the layer pattern
        c["rope_theta"] = rope["full_attention"]["rope_theta"]
        c["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        c["rope_scaling"] = None
        assert c.pop("layer_types") == ["sliding_attention", "full_attention", "sliding_attention"]
        c["sliding_window_pattern"] = 2  # 3 layers, pattern 2: sliding, full, sliding
    else:
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
        c.pop("layer_types", None)  # qwen2 keeps use_sliding_window + max_window_layers
    return c


def _rewritten(case: Case, dest: Path, config: dict) -> Path:
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    for f in case.dir.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f)
    return dest


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gemma3"])
def test_transformers_4x_config(zoo, name, tmp_path):
    """The same checkpoint with a 4.x config.json (rope_theta/rope_scaling, torch_dtype; Gemma 3's
    rope_local_base_freq + sliding_window_pattern; Qwen's use_sliding_window + max_window_layers) reads to the
    same config and logits (rel <= 1e-6 vs the 5.x import; <= 1e-5 vs transformers)."""
    case = zoo.case(name)
    old = _to_4x(name, json.loads((case.dir / "config.json").read_text()))
    assert "rope_parameters" not in old and "layer_types" not in old
    d = _rewritten(case, tmp_path / "v4", old)
    _, cfg4, _ = read_hf_config(d)
    _, cfg5, _ = read_hf_config(case.dir)
    assert cfg4 == cfg5
    ours = logits(from_hf(d, param_dtype="float32"), IDS)
    assert rel(ours, logits(zoo.model(name), IDS)) <= 1e-6
    assert rel(ours, zoo.ref_logits(name)) <= 1e-5


def test_qwen_4x_window_off_means_full_attention(zoo, tmp_path):
    """Qwen 2.5 4.x configs carry a sliding_window value with use_sliding_window=false: every layer is full."""
    c = _to_4x("qwen2", json.loads((zoo.case("qwen2").dir / "config.json").read_text()))
    c.update(use_sliding_window=False, sliding_window=4, max_window_layers=0)
    _, cfg, _ = read_hf_config(_rewritten(zoo.case("qwen2"), tmp_path / "v4", c))
    assert cfg.types == ("full", "full") and not cfg.sliding_window


# --- 6. sharded load on 8 devices -----------------------------------------------------------------------------------

SHARD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from jaxtune.models import from_hf
    from jaxtune.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()
    jobs, tokens, out = json.loads(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3]
    arrays, info = {}, {}
    for key, (d, shape, scan) in jobs.items():
        model = from_hf(d, mesh=make_mesh(*shape), scan_layers=scan)
        graphdef, params = nnx.split(model, nnx.Param)
        leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(params))[0]
        info[key] = {
            "paths": [jax.tree_util.keystr(p) for p, _ in leaves],
            "sharded": [jax.tree_util.keystr(p) for p, x in leaves
                        if len(x.sharding.device_set) > 1 and x.addressable_shards[0].data.shape != x.shape],
            "embed_shard": list(model.embed.embedding[...].addressable_shards[0].data.shape),
        }
        arrays[key] = np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens))
        arrays.update({f"{key}:{i}": np.asarray(x) for i, (_, x) in enumerate(leaves)})  # gathered
    np.savez(out, **arrays)
    print("RESULT " + json.dumps(info))
    """
)


def test_sharded_load_on_8_devices_matches_single_device(zoo, tmp_path):
    """from_hf(d, mesh=make_mesh(2,2,2)) and make_mesh(1,8,1) on 8 simulated CPU devices (a subprocess): the
    parameters really are sharded as they are read, gathered they are bitwise the single-device import's, and the
    logits are within rel 3e-6 of the single-device ones. (Not 1e-6: fsdp and tensor split the contractions over
    d_model, heads and d_ff, so fp32 partial sums are added in another order; measured 1.4e-6 for llama, 0.8e-6
    for gemma3, a few ulp at the logits' scale; a wrong shard would be off by O(1).) Llama reads a sharded
    checkpoint (index + several files); Gemma 3 mixes layer kinds, and is also loaded with scan_layers (each
    device's shard of the stacked (layer, ...) params read from the per-layer tensors)."""
    jobs = {f"{n}-{'x'.join(map(str, shape))}": (str(zoo.case(n).dir), shape, False)
            for n in ["llama", "gemma3"] for shape in [(2, 2, 2), (1, 8, 1)]}
    jobs["gemma3-2x2x2-scan"] = (str(zoo.case("gemma3").dir), (2, 2, 2), True)
    np.save(tmp_path / "ids.npy", IDS.astype(np.int32))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SHARD_SCRIPT, json.dumps(jobs), str(tmp_path / "ids.npy"),
                           str(tmp_path / "out.npz")], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.split("RESULT ", 1)[1])
    arrays = np.load(tmp_path / "out.npz")
    for key, (_, shape, scan) in jobs.items():
        name = key.split("-")[0]
        assert info[key]["sharded"], key
        assert rel(arrays[key], logits(zoo.model(name), IDS)) <= 3e-6, key
        # embed (vocab, d_model): vocab over tensor, d_model over fsdp
        assert info[key]["embed_shard"] == [VOCAB // shape[2], 64 // shape[1]], key
        if not scan:
            single = jax.tree_util.tree_flatten_with_path(params_of(zoo.model(name)))[0]
            assert info[key]["paths"] == [jax.tree_util.keystr(p) for p, _ in single]
            for i, (path, x) in enumerate(single):
                assert np.array_equal(arrays[f"{key}:{i}"], np.asarray(x)), (key, jax.tree_util.keystr(path))
    assert any(p.startswith("['layers']['attn']") for p in info["gemma3-2x2x2-scan"]["sharded"])


# --- 7. errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["phi3", "gemma3"])
def test_unsupported_model_type_names_it(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 8}))
    with pytest.raises(UnsupportedModelError, match=rf"model_type='{model_type}'.*torchax") as e:
        from_hf(tmp_path)
    if model_type == "gemma3":
        assert "Gemma3ForCausalLM" in str(e.value)  # the multimodal checkpoint hint


def test_pickle_only_checkpoint_is_refused(zoo, tmp_path):
    (tmp_path / "config.json").write_text((zoo.case("llama").dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")  # never opened
    with pytest.raises(CheckpointError, match=r"no \.safetensors.*pytorch_model\.bin.*pickle"):
        from_hf(tmp_path)


@pytest.mark.parametrize("name,change,named", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type='yarn'"),
    ("gemma3", {"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
])
def test_unsupported_config_field_names_it(zoo, tmp_path, name, change, named):
    """A config.json value with no native implementation is refused before any weight is read, naming the field
    and its value, and pointing at the torchax backend."""
    c = {**json.loads((zoo.case(name).dir / "config.json").read_text()), **change}
    d = _rewritten(zoo.case(name), tmp_path / "bad", c)
    with pytest.raises(UnsupportedModelError, match=rf"{re.escape(named)}.*torchax"):
        from_hf(d)


def test_missing_tensor_is_named(zoo, tmp_path):
    ck = HFCheckpoint(zoo.case("gpt2").dir)
    tensors = {n: np.asarray(ck.get(n)) for n in sorted(ck.names()) if n != "transformer.h.1.mlp.c_fc.weight"}
    tmp_path.joinpath("config.json").write_text((zoo.case("gpt2").dir / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"missing tensors \['transformer\.h\.1\.mlp\.c_fc\.weight'\]"):
        from_hf(tmp_path)


# --- 8. scan layers -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_scan_layers_matches_loop_and_exports(zoo, name, tmp_path):
    """from_hf(scan_layers=True): logits rel <= 2e-6 vs the loop layout (plain and left-padded); its export loads
    in transformers (no missing keys, rel <= 1e-6) and re-imports bitwise equal to the loop import."""
    loop = zoo.model(name)
    scanned = from_hf(zoo.case(name).dir, param_dtype="float32", scan_layers=True)
    assert scanned.cfg.scan_layers
    assert rel(logits(scanned, IDS), logits(loop, IDS)) <= 2e-6  # float32: XLA fuses a loop and a scan apart
    tokens, mask, positions = _padded_batch("left")
    want = logits(loop, tokens, positions, mask)
    got = logits(scanned, tokens, positions, mask)
    assert np.isfinite(got).all() and rel(got, want) <= 2e-6
    out = export(scanned, tmp_path / "export")
    hf = reload_in_transformers(out, type(zoo.case(name).hf))
    assert rel(hf_logits(hf, IDS), zoo.ref_logits(name)) <= 1e-6
    assert_bitwise_equal(params_of(from_hf(out)), params_of(loop))


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_scan_layers_generation_matches_transformers(zoo, name):
    """The scanned layout through the KV-cache Generator, on the families that mix full and sliding layers (one
    traced layer body selects the mask per layer): the same 32 greedy tokens as transformers."""
    scanned = from_hf(zoo.case(name).dir, param_dtype="float32", scan_layers=True)
    assert generate(scanned) == zoo.greedy(name)
