"""GGUF import of Gemma 3 (`jaxtune.models.gguf`, architecture ``gemma3``).

The tiny files are written here the way llama.cpp's convert_hf_to_gguf.py (``Gemma3Model``) writes a Gemma 3: its
metadata keys (no layer pattern, no sliding-layer RoPE base, no query_pre_attn_scalar: llama.cpp fixes those), every
``*norm.weight`` stored as 1 + w, q/k not permuted, norms F32, no output.weight (tied), a SentencePiece-style
(``llama``) vocabulary with scores and a chat template; from a tiny random transformers Gemma3ForCausalLM (seven
layers: five sliding, one global, one sliding; head_dim 32 apart from d_model / n_head = 16; window 8, shorter
than the inputs). References: transformers' own GGUF loader (``gguf_file=``) and the original model.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|. Tolerances:
  * imported tensors vs transformers' GGUF loader, F32 and Q8_0:       bitwise equal (both dequantize with the gguf
    package and subtract 1 in float32)
  * imported tensors vs the original weights: F32 projections bitwise; norms (always F32) |err| <= 2^-24 (|1 + w| + 1)
    (rounding 1 + w to float32, then 1 + w - 1); Q8_0 |err| <= max|w| / 127
  * logits, native model from the .gguf vs transformers from the same .gguf and vs the original, fp32: rel <= 1e-5
  * Gemma 3 270M Q4_K_M (real, when installed), 600 tokens (past its 512-token window), fp32: logits vs transformers'
    GGUF loader rel <= 3e-5 (measured 5.0e-6), the argmax equal at every position, 8 greedy tokens equal.
"""

from __future__ import annotations

import inspect
import json
import json.decoder
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flax import nnx
from helpers.compare import hf_from_gguf, jax_logits, rel, torch_logits
from helpers.gguf_files import finish_gguf
from helpers.real_models import GEMMA3_270M_INSTALL, gemma3_270m_gguf
from helpers.tiny_gemma3 import HEAD_DIM, IDS, SPECIALS, TEMPLATE, tiny_gemma, tiny_tokenizer

from jaxtune.data import load_hf_tokenizer
from jaxtune.data.chat import encode_prompt
from jaxtune.data.templates import SHIPPED_TEMPLATES
from jaxtune.io import CheckpointError
from jaxtune.models.hf import HFCheckpoint, from_hf, read_hf_config
from jaxtune.models.registry import FAMILIES
from jaxtune.models.sampling import Generator

gguf = pytest.importorskip("gguf", reason="GGUF import needs the gguf package: pip install gguf==0.19.0")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

Q = gguf.GGMLQuantizationType
GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    stem, _, suffix = hf.rpartition(".")
    if stem in GGUF_NAMES:
        return f"{GGUF_NAMES[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{BLOCK[rest]}.{suffix}"


def write_gemma_gguf(path: Path, hf_dir: Path, qtype: str, drop: str | None = None,
                     extra: Callable[[Any], None] | None = None) -> Path:
    """The HF Gemma 3 ``hf_dir`` as llama.cpp writes it; projections and the embedding as ``qtype``, norms F32
    (stored as 1 + w). ``drop``: a metadata key left out; ``extra(writer)`` adds more."""
    from safetensors.numpy import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    tok = tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w = gguf.GGUFWriter(str(path), "gemma3")
    keys = {"context_length": (w.add_context_length, c["max_position_embeddings"]),
            "embedding_length": (w.add_embedding_length, c["hidden_size"]),
            "block_count": (w.add_block_count, c["num_hidden_layers"]),
            "feed_forward_length": (w.add_feed_forward_length, c["intermediate_size"]),
            "attention.head_count": (w.add_head_count, c["num_attention_heads"]),
            "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, c["rms_norm_eps"]),
            "attention.key_length": (w.add_key_length, c["head_dim"]),
            "attention.value_length": (w.add_value_length, c["head_dim"]),
            "rope.freq_base": (w.add_rope_freq_base, c["rope_parameters"]["full_attention"]["rope_theta"]),
            "attention.sliding_window": (w.add_sliding_window, c["sliding_window"]),
            "attention.head_count_kv": (w.add_head_count_kv, c["num_key_value_heads"])}
    if c.get("final_logit_softcapping"):
        keys["final_logit_softcapping"] = (w.add_final_logit_softcapping, c["final_logit_softcapping"])
    scaling = c["rope_parameters"]["full_attention"]
    if scaling["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    w.add_name("tiny gemma")
    for key, (add, value) in keys.items():
        if key != drop:
            add(value)
    if extra is not None:
        extra(w)
    w.add_file_type({"F32": 0, "Q8_0": 7}[qtype])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([0.0 if t in SPECIALS else -float(i) for t, i in vocab])
    w.add_token_types([2 if t == "<unk>" else 3 if t in SPECIALS else 1 for t, _ in vocab])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(TEMPLATE)
    for name, x in load_file(str(hf_dir / "model.safetensors")).items():
        x = x.astype(np.float32)
        if name.endswith("norm.weight"):
            w.add_tensor(gguf_name(name), x + np.float32(1))
        elif qtype == "F32":
            w.add_tensor(gguf_name(name), x)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(x, Q[qtype]), raw_dtype=Q[qtype])
    finish_gguf(w)
    return path


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf-gemma3")
    hf = tiny_gemma(root / "hf")
    return {"hf": hf, "cache": root / "cache",
            **{t: write_gemma_gguf(root / f"tiny-{t}.gguf", hf, t) for t in ("F32", "Q8_0")}}


@pytest.fixture
def tiny(tiny_files, monkeypatch) -> dict:
    """{"hf": the tiny HF Gemma 3 directory, "F32"/"Q8_0": its .gguf files}, converted once into the module's own
    cache (set per test, so the real model below keeps the default cache)."""
    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tiny_files["cache"]))
    return tiny_files


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_tensors_match_transformers_and_original(tiny, qtype):
    """Every imported tensor (norms shifted back by 1, Gemma's names) equals transformers' dequantization of the
    same file, and the original weights within the type's error (module docstring)."""
    from safetensors.numpy import load_file

    ours = HFCheckpoint(tiny[qtype])
    original = load_file(str(tiny["hf"] / "model.safetensors"))
    theirs = {k: v.float().numpy() for k, v in hf_from_gguf(tiny[qtype]).state_dict().items()}
    assert ours.names() == set(original)
    for name, w in original.items():
        got = ours.get(name)
        np.testing.assert_array_equal(got, theirs[name], err_msg=name)
        if name.endswith("norm.weight"):
            bound = (np.abs(1 + w) + 1) * 2.0**-24
        else:
            bound = 0.0 if qtype == "F32" else np.abs(w).max() / 127
        assert (np.abs(got - w) <= bound).all(), (name, float(np.abs(got - w).max()))


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_logits_match_transformers(tiny, qtype):
    """The native model from the .gguf vs transformers' GGUF-loaded model, and (F32) vs the original: rel <= 1e-5,
    over 24 positions (three sliding windows). transformers' GGUF config reader leaves query_pre_attn_scalar at
    its default, 256 (the released 270M-12B's head_dim); llama.cpp scales by this model's head_dim, so it is given."""
    model = from_hf(tiny[qtype])
    assert model.cfg.types == ("sliding",) * 5 + ("full", "sliding") and model.cfg.sliding_window == 8
    ours = jax_logits(model, IDS)
    assert rel(ours, torch_logits(hf_from_gguf(tiny[qtype], query_pre_attn_scalar=HEAD_DIM), IDS)) <= 1e-5
    if qtype == "F32":
        original = transformers.AutoModelForCausalLM.from_pretrained(tiny["hf"], attn_implementation="eager")
        assert rel(ours, torch_logits(original, IDS)) <= 1e-5


def test_rope_scaling_and_softcap(tmp_path, monkeypatch):
    """Linear RoPE scaling of the global layers (rope.scaling.*) and the final logit soft-cap come through: logits
    vs the original rel <= 1e-5, and the model without them differs."""
    monkeypatch.setenv("JAXTUNE_GGUF_CACHE", str(tmp_path / "cache"))
    hf = tiny_gemma(tmp_path / "hf", rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=3.0)
    model = from_hf(write_gemma_gguf(tmp_path / "scaled.gguf", hf, "F32"))
    assert (model.cfg.rope.kind, model.cfg.rope.factor, model.cfg.local_rope.kind) == ("linear", 8.0, "default")
    assert model.cfg.final_softcap == 3.0
    ref = torch_logits(transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager"), IDS)
    ours = jax_logits(model, IDS)
    assert rel(ours, ref) <= 1e-5
    plain = from_hf(write_gemma_gguf(tmp_path / "plain.gguf", tiny_gemma(tmp_path / "hf-plain"), "F32"))
    assert rel(jax_logits(plain, IDS), ref) > 1e-2


def test_tokenizer_and_generation_config(tiny):
    """The converted directory's tokenizer encodes like the original (BOS added, specials whole) and like
    transformers' GGUF tokenizer, keeps the chat template; BOS/EOS/PAD ids in config.json, and generation_config.json
    stops at EOS and at <end_of_turn>, as Gemma's own does."""
    d = HFCheckpoint(tiny["F32"]).dir
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny["F32"].parent), gguf_file=tiny["F32"].name)
    original = tiny_tokenizer()
    for text in ["the quick brown fox", "hello world, how are you today?", "<start_of_turn>user\nhi<end_of_turn>",
                 " two  spaces", "zebra!"]:
        assert tok(text).input_ids == ref(text).input_ids == [2] + original.encode(text).ids, text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    config = json.loads((d / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [1, 5]


@pytest.mark.parametrize("pattern", [3, [True, False] * 3 + [True]])
def test_layout_keys_when_given(tiny, tmp_path, pattern):
    """llama.cpp writes no layer pattern or sliding-layer RoPE base for Gemma 3; a file that has them
    (attention.sliding_window_pattern: every n-th layer global, or per layer True where it slides;
    rope.freq_base_swa) is read by them."""
    def extra(w):
        w.add_sliding_window_pattern(pattern)
        w.add_rope_freq_base_swa(20000.0)

    _, cfg, _ = read_hf_config(write_gemma_gguf(tmp_path / "layout.gguf", tiny["hf"], "F32", extra=extra))
    slides = [(i + 1) % 3 != 0 for i in range(7)] if pattern == 3 else pattern
    assert cfg.types == tuple("sliding" if s else "full" for s in slides)
    assert cfg.local_rope.theta == 20000.0 and cfg.rope.theta == 1e6


@pytest.mark.parametrize("key", ["attention.sliding_window", "attention.key_length"])
def test_missing_metadata(tiny, tmp_path, key):
    """A Gemma 3 file without its sliding window or head size: a one-line error naming the key."""
    with pytest.raises(CheckpointError, match=f"lacks gemma3.{key}") as e:
        from_hf(write_gemma_gguf(tmp_path / "bad.gguf", tiny["hf"], "F32", drop=key))
    assert "\n" not in str(e.value)


# --- a real model ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma270m() -> dict:
    """Gemma 3 270M Q4_K_M: the file (its parts assembled and checked once), its converted directory (kept in the
    default GGUF cache between runs: converting takes about a minute on two cores), the converted tokenizer, and
    transformers' model of the file: its own GGUF reader, dequantization and norm shift, with the converted
    config.json (checked against Google's in `test_gemma3_270m_config`), which saves a second parse of the file's
    metadata (its 262k-token vocabulary takes the gguf package ~20 s)."""
    path = gemma3_270m_gguf()
    if path is None:
        pytest.skip(f"Gemma 3 270M GGUF not installed ({GEMMA3_270M_INSTALL})")
    ckpt = HFCheckpoint(path)
    return {"path": path, "ckpt": ckpt, "tok": transformers.AutoTokenizer.from_pretrained(ckpt.dir),
            "ref": hf_from_gguf(path, config=transformers.AutoConfig.from_pretrained(ckpt.dir))}


@pytest.mark.slow
def test_gemma3_270m_config(gemma270m):
    """The config rebuilt from the file's metadata is the published google/gemma-3-270m one (jaxtune's preset
    gemma3-270m): shapes, window 512, one global layer in six, RoPE bases 1M/10k, query_pre_attn_scalar 256, tied
    head, token ids; the RMSNorm epsilon as float32 stores 1e-6."""
    _, cfg, _ = read_hf_config(gemma270m["path"])
    assert cfg.norm_eps == pytest.approx(1e-6, rel=1e-7)
    assert cfg.replace(norm_eps=1e-6) == FAMILIES["gemma3"].presets["gemma3-270m"]()


@pytest.mark.slow
def test_gemma3_270m_tensors_match_transformers(gemma270m):
    """Every imported tensor equals transformers' dequantization of the file (Q8_0, Q5_0, Q4_K, Q6_K, F32 norms)."""
    ckpt, theirs = gemma270m["ckpt"], gemma270m["ref"].state_dict()
    assert ckpt.names() == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    for name in ckpt.names():
        np.testing.assert_array_equal(ckpt.get(name), theirs[name].numpy(), err_msg=name)


@pytest.mark.slow
def test_gemma3_270m_logits_and_greedy_past_window(gemma270m):
    """600 tokens of text, past the 512-token sliding window: logits vs transformers' GGUF loader rel <= 3e-5
    (measured 5.0e-6), the same argmax at every position, and 8 greedy tokens equal (ours through the KV cache,
    theirs continuing its prefill's cache)."""
    tok, ref = gemma270m["tok"], gemma270m["ref"]
    ids = tok(inspect.getsource(json.decoder)).input_ids[:600]
    assert len(ids) == 600 and ids[0] == tok.bos_token_id == 2
    model = from_hf(gemma270m["path"])
    assert model.cfg.sliding_window == 512 and model.cfg.types.count("full") == 3
    ours = jax_logits(model, [ids])[0]
    with torch.no_grad():
        out = ref(torch.tensor([ids]), use_cache=True)
        theirs, cache = out.logits[0].numpy(), out.past_key_values
        greedy = [int(theirs[-1].argmax())]
        for _ in range(7):
            out = ref(torch.tensor([greedy[-1:]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            greedy.append(int(out.logits[0, -1].argmax()))
    err = rel(ours, theirs)
    print(f"Gemma 3 270M logits rel {err:.2e}")
    assert err <= 3e-5
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    graphdef, state = nnx.split(model, nnx.Param)
    generated = Generator(graphdef, len(ids) + 8)(nnx.to_pure_dict(state), [ids], max_new_tokens=8).ids[0]
    print("Gemma 3 270M continues:", repr(tok.decode(generated)))
    assert generated == greedy


@pytest.mark.slow
def test_gemma3_270m_tokenizer(gemma270m):
    """The converted tokenizer: Gemma 3's special ids, kept whole; text round-trips; BOS added; generation stops
    at <eos> and <end_of_turn>."""
    tok = gemma270m["tok"]
    assert tok.convert_ids_to_tokens([0, 1, 2, 3, 105, 106]) == \
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    text = "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n"
    ids = tok(text).input_ids
    assert ids[:2] == [2, 105] and ids.count(106) == 1 and tok.decode(ids[1:]) == text
    generation = json.loads((gemma270m["ckpt"].dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]
    # jaxtune's tokenizer: a plain-text prompt starts with <bos>, as transformers encodes it (without it Gemma
    # degenerates: "The capital of France is France. The The The ..."); a chat prompt gets it from the template.
    ours = load_hf_tokenizer(str(gemma270m["ckpt"].dir))
    plain = "The capital of France is"
    assert ours.bos_prefix == (2,) and encode_prompt(ours, plain) == tok(plain).input_ids
    ours.chat_template = SHIPPED_TEMPLATES["gemma"]
    assert encode_prompt(ours, "What is 2 + 2?", chat=True) == ids
