"""GGUF export (`jaxtune.models.gguf_export`, `jaxtune export RUN OUT.gguf --gguf`): files written here load back in
transformers (``gguf_file=``), in jaxtune's own GGUF import, and in llama.cpp (llama-cpp-python, when installed).

Models (`tiny`): tiny random transformers checkpoints (`helpers.tiny_hf.tiny_llama`: 2 layers, d_model 64, every
tensor perturbed, a ChatML byte-level BPE) loaded natively; a native tied Llama with Llama 3.1 RoPE scaling; Gemma 3
(`helpers.tiny_gemma3.tiny_gemma`) and a native Mistral with SentencePiece-style tokenizers; a transformers GPT-2
(`helpers.tiny_hf.tiny_gpt2`) and a native one with its own context; a LoRA run; SmolLM2-135M-Instruct. Qwen 3 uses
head_dim 128, Qwen3Config's default: transformers' GGUF loader ignores ``qwen3.attention.key_length`` (jaxtune's
import and llama.cpp read it).

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|. Tolerances:
  * tensors transformers reads from the file vs the weights exported: F32 bitwise; F16 |err| <= 2^-11 |w| (half an
    ulp; 2^-25 below F16's normal range); BF16 |err| <= 2^-8 |w|; Q8_0 |err| <= (max|block| / 127) / 2, half a
    step, plus the step's own F16 rounding (2^-11 of it times 127)
  * logits, transformers from the file vs jaxtune's import of the same file (same weights, fp32): rel <= 1e-5
  * logits, transformers from the file vs the jaxtune model exported: f32 rel <= 1e-5; else the type's rounding
    as it reaches the logits. Per-weight relative rounding u: f16 2^-11, bf16 2^-8, q8_0 up to 1/254 of the
    block's largest weight (several times u for a typical weight). Measured on these tiny models: f16 0.3-2.5e-3 (up
    to 5u), bf16 2.4e-2 (6u), q8_0 3.6-6.3e-2; bounds f16 1e-2, bf16 6e-2, q8_0 0.2 (4x, 2.5x, 3x the largest
    measured), below what one misplaced tensor gives (0.87 for one q projection in the wrong row order, 0.72 for
    gate and up swapped)
  * SmolLM2-135M-Instruct (Q4_1 imported, exported f16): logits rel <= 5e-3 (measured 1.1e-3: f16 rounding of
    Q4_1's d * q + m), the same greedy answer as ours through the EOS
  * llama.cpp, f32 files, f32 KV cache: logits rel <= 1e-5 (measured 2e-7 to 2e-6); the GELU models, Gemma 3 and
    GPT-2, <= 1e-3 (measured 3.2e-4 and 3.7e-4: ggml's CPU GELU reads an f16 table; with our GELU's input and output
    rounded to f16, GPT-2's gap falls to 7e-5); token ids equal to ours
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_gemma3
from helpers.chat_stops import END_OF_TURN, assert_stopped_at, forced_generation
from helpers.compare import hf_from_gguf, jax_logits, rel, torch_logits
from helpers.real_models import SMOLLM2_INSTALL, smollm2_gguf
from helpers.rows import write_jsonl
from helpers.tiny_hf import CHAT_SPECIALS, IDS, TEXTS, save_chatml_tokenizer, tiny_gpt2, tiny_llama

from jaxtune.cli import main
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_hf_tokenizer
from jaxtune.export import export
from jaxtune.io import CheckpointError
from jaxtune.loop import train
from jaxtune.models import build_model, from_hf
from jaxtune.models.gemma3 import PRESETS as GEMMA3
from jaxtune.models.gguf_export import pre_tokenizer_name, write_gguf
from jaxtune.models.gpt2 import PRESETS as GPT2
from jaxtune.models.hf import HFCheckpoint, hf_tensors
from jaxtune.models.layers import Rope
from jaxtune.models.llama import PRESETS as LLAMA
from jaxtune.models.mistral import PRESETS as MISTRAL
from jaxtune.models.registry import FAMILIES, merge
from jaxtune.models.unsupported import UnsupportedModelError
from jaxtune.run import load_run

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install gguf==0.19.0")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGIT_BOUND = {"f32": 1e-5, "f16": 1e-2, "bf16": 6e-2, "q8_0": 0.2}
LLAMA3_ROPE = Rope(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_len=8192)
CHAT = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "how are you today?"}]
SAMPLES = ["the quick brown fox jumps over the lazy dog", "  12345 x\n\n y", "<|im_start|>user\nhi<|im_end|>\n"]
GEMMA_SAMPLES = ["the quick brown fox", "hello  world, how are you?", "<start_of_turn>user\nhi<end_of_turn>\n"]


class Source(NamedTuple):
    directory: Path  # holds the tokenizer (and, but for "tied", the HF checkpoint)
    model: Any
    tokenizer: Any
    ids: np.ndarray
    logits: np.ndarray  # the model's on ids


def tensor_bound(qtype: str, w: np.ndarray) -> np.ndarray:
    """The largest |dequantized - w| each type allows, elementwise (module docstring)."""
    if qtype == "f32":
        return np.zeros_like(w)
    if qtype == "f16":
        return np.maximum(np.abs(w) * 2.0**-11, 2.0**-25)
    if qtype == "bf16":
        return np.abs(w) * 2.0**-8
    blocks = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    return np.broadcast_to(blocks * (0.5 + 127 * 2.0**-11), (blocks.shape[0], 32)).reshape(w.shape)


def sentencepiece_style(directory: Path, prefix_space: bool) -> int:
    """`tiny_gemma3.tiny_tokenizer`'s ▁-joined BPE saved in ``directory`` as a SentencePiece-style
    tokenizer.json (byte fallback, BOS added; with ``prefix_space`` a ▁ before the text, as Llama 2's and Mistral's,
    else none, as Gemma's) with a chat template; returns its vocabulary size."""
    from tokenizers import normalizers, processors

    sp = tiny_gemma3.tiny_tokenizer()
    if prefix_space:
        sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    spec = json.loads(sp.to_str())
    spec["model"]["byte_fallback"] = True
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
        "pad_token": "<pad>", "chat_template": tiny_gemma3.TEMPLATE}))
    return sp.get_vocab_size()


@pytest.fixture(scope="module")
def root(gguf_module_root):
    """The module's directory, jaxtune's GGUF import cache in it."""
    return gguf_module_root


@pytest.fixture(scope="module")
def tiny(root):
    """tiny(name) -> its `Source`, made once: "llama", "qwen2", "qwen3" (`tiny_llama` checkpoints), "tied" (a
    native Llama: tied embeddings, Llama 3.1 RoPE scaling, 20 more embeddings than tokens, 80-wide MLP rows), "gemma3"
    (`tiny_gemma3.tiny_gemma`: 7 layers, one global, window 8, head_dim 32; Gemma's SentencePiece-style
    tokenizer), "mistral" (a native one, no sliding window, with a prefix-space SentencePiece-style tokenizer),
    "gpt2" (`tiny_gpt2`, a transformers GPT-2)."""
    made = {}

    def make(name: str) -> Source:
        if name in made:
            return made[name]
        ids = IDS
        if name == "tied":
            d = root / "tok-tied"
            d.mkdir()
            n_tok = save_chatml_tokenizer(d, TEXTS)
            model = build_model(LLAMA["tiny"](vocab_size=n_tok + 20, d_ff=80, rope=LLAMA3_ROPE, bos_id=1, eos_id=2), 0)
        elif name == "gemma3":
            d, ids = tiny_gemma3.tiny_gemma(root / "hf-gemma3"), tiny_gemma3.IDS
            sentencepiece_style(d, prefix_space=False)
            model = from_hf(d)
        elif name == "gpt2":
            d = tiny_gpt2(root / "hf-gpt2")
            model = from_hf(d)
        elif name == "mistral":
            d, ids = root / "tok-mistral", tiny_gemma3.IDS
            n_tok = sentencepiece_style(d, prefix_space=True)
            model = build_model(MISTRAL["tiny"](vocab_size=n_tok, sliding_window=None, bos_id=2, eos_id=1), 0)
        else:
            head_dim = {"head_dim": 128} if name == "qwen3" else {}
            d = tiny_llama(root / f"hf-{name}", name, rope_theta=10000.0, **head_dim)
            model = from_hf(d)
        made[name] = Source(d, model, load_hf_tokenizer(str(d)), ids, jax_logits(model, ids))
        return made[name]

    return make


@pytest.mark.parametrize("arch,qtype", [("llama", "f32"), ("llama", "f16"), ("llama", "bf16"), ("llama", "q8_0"),
                                        ("qwen2", "f16"), ("qwen3", "q8_0"), ("mistral", "f16"), ("gpt2", "f32"),
                                        ("gpt2", "q8_0")])
def test_export_loads_in_transformers_and_jaxtune(tiny, root, arch, qtype):
    """Every tensor transformers reads from the file is the exported weight within the type's rounding (q/k
    permuted and un-permuted correctly), its logits are ours within the type's error, and jaxtune's own import of
    the file gives transformers' logits (module docstring)."""
    src = tiny(arch)
    out = export(src.model, root / f"{arch}-{qtype}.gguf", tokenizer=src.tokenizer, gguf=qtype)
    theirs = hf_from_gguf(out)
    original = hf_tensors(FAMILIES[arch], nnx.to_pure_dict(nnx.state(src.model, nnx.Param)))
    state = {k: v.float().numpy() for k, v in theirs.state_dict().items() if k != "lm_head.weight" or
             arch != "gpt2"}  # GPT-2's head is the embedding (tied)
    assert set(state) == set(original)
    for name, w in original.items():
        # GPT-2's Conv1D weights are (in, out) here, and quantized as llama.cpp stores them: (out, in)
        conv1d = arch == "gpt2" and w.ndim == 2 and ".h." in name
        err = np.abs(state[name] - w)
        bound = tensor_bound(qtype if w.ndim == 2 else "f32", w.T if conv1d else w)
        assert (err <= (bound.T if conv1d else bound)).all(), (name, float(err.max()))
    logits = torch_logits(theirs, src.ids)
    err = rel(logits, src.logits)
    print(f"{arch} {qtype}: logits rel {err:.2e}")
    assert err <= LOGIT_BOUND[qtype]
    assert rel(jax_logits(from_hf(out), src.ids), logits) <= 1e-5


def test_metadata_and_tokenizer(tiny, root):
    """llama.cpp's keys and values (EOS: tokenizer_config.json's eos_token, <|endoftext|>, as llama.cpp's converter
    takes it before config.json's id); transformers' tokenizer from the file encodes as ours (jaxtune's chat
    encoding, and the checkpoint's transformers tokenizer) and carries the same chat template."""
    src = tiny("llama")
    out = export(src.model, root / "meta.gguf", tokenizer=src.tokenizer, gguf="f16")
    fields = gguf.GGUFReader(out).fields
    keys = {"general.architecture": "llama", "general.name": "meta", "general.file_type": 1,
            "llama.context_length": 128, "llama.embedding_length": 64, "llama.block_count": 2,
            "llama.feed_forward_length": 96, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.attention.key_length": 16, "llama.rope.dimension_count": 16, "llama.rope.freq_base": 10000.0,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 0, "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": src.tokenizer.chat_template}
    assert {k: fields[k].contents() for k in keys} == keys
    types = fields["tokenizer.ggml.token_type"].contents()
    assert types[:3] == [gguf.TokenType.CONTROL] * 3 and set(types[3:]) == {gguf.TokenType.NORMAL}

    theirs = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=out.name)
    reference = transformers.AutoTokenizer.from_pretrained(src.directory)
    for text in [*SAMPLES, src.tokenizer.apply_chat_template(CHAT)]:
        assert theirs(text, add_special_tokens=False).input_ids == src.tokenizer.encode_chat([text])[0], text
        assert theirs(text).input_ids == reference(text).input_ids, text
    assert theirs.chat_template == src.tokenizer.chat_template
    assert theirs.apply_chat_template(CHAT, tokenize=False) == src.tokenizer.apply_chat_template(CHAT)


def test_tied_llama3_rope_padded_vocabulary_q8_fallback(tiny, root, caplog):
    """The tied Llama with Llama 3.1 RoPE scaling and spare embeddings: no output.weight, rope_freqs as llama.cpp's
    converter computes it, the spare ids as [PADi] UNUSED tokens; jaxtune's import gives the model back (logits rel
    <= 1e-5, its rope and tie). Its 80-wide MLP rows do not split into 32-value blocks: in q8_0 those tensors are
    F16, and the log says so."""
    src = tiny("tied")
    n_tok = src.tokenizer.vocab_size
    out = export(src.model, root / "tied.gguf", tokenizer=src.tokenizer, gguf="f32")
    reader = gguf.GGUFReader(out)
    names = {t.name: t for t in reader.tensors}
    assert "output.weight" not in names and names["token_embd.weight"].shape.tolist() == [64, n_tok + 20]
    divisors = []  # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors
    for freq in 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16):
        wavelen = 2 * np.pi / freq
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        divisors.append(1.0 if wavelen < 8192 / 4 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8.0 + smooth))
    np.testing.assert_allclose(np.asarray(names["rope_freqs.weight"].data), divisors, rtol=1e-6)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[n_tok:] == [f"[PAD{i}]" for i in range(n_tok, n_tok + 20)]
    assert set(reader.fields["tokenizer.ggml.token_type"].contents()[n_tok:]) == {gguf.TokenType.UNUSED}
    back = from_hf(out)
    assert back.cfg.rope == LLAMA3_ROPE and back.cfg.tie_embeddings
    assert rel(jax_logits(back, IDS), src.logits) <= 1e-5

    q8 = export(src.model, root / "tied-q8.gguf", tokenizer=src.tokenizer, gguf="q8_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(q8).tensors}
    assert {n for n, t in types.items() if t == "F16"} == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    assert "2 tensors whose rows do not split into 32-value blocks are written as F16" in caplog.text


def test_gpt2_native(tiny, root):
    """A jaxtune GPT-2 (the `tiny` preset: 128 positions, 512 embeddings for a 300-token BPE), as a pretraining run
    exports it: gpt2 keys as llama.cpp's converter writes them, Conv1D weights stored (out, in), no output.weight,
    the spare ids [PADi]; jaxtune's import gives the model back (f32: logits rel <= 1e-5). transformers cannot
    load it: its GGUF reader keeps GPT-2's 1024 positions whatever context_length says."""
    src = tiny("gpt2")
    model = build_model(GPT2["tiny"](bos_id=1, eos_id=2), 0)
    out = export(model, root / "gpt2-native.gguf", tokenizer=src.tokenizer, gguf="f32")
    reader = gguf.GGUFReader(out)
    keys = {"general.architecture": "gpt2", "gpt2.context_length": 128, "gpt2.embedding_length": 64,
            "gpt2.block_count": 2, "gpt2.feed_forward_length": 256, "gpt2.attention.head_count": 4,
            "gpt2.attention.layer_norm_epsilon": float(np.float32(1e-5)), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2"}
    assert {k: reader.fields[k].contents() for k in keys} == keys
    shapes = {t.name: tuple(reversed(t.shape.tolist())) for t in reader.tensors}  # numpy order
    assert "output.weight" not in shapes and shapes["position_embd.weight"] == (128, 64)
    assert shapes["blk.0.attn_qkv.weight"] == (192, 64) and shapes["blk.0.ffn_up.weight"] == (256, 64)
    assert reader.fields["tokenizer.ggml.tokens"].contents()[-1] == "[PAD511]"
    back = from_hf(out)
    assert back.cfg.max_seq_len == 128 and back.cfg.vocab_size == 512
    assert rel(jax_logits(back, IDS), jax_logits(model, IDS)) <= 1e-5


def test_gemma3_sentencepiece(tiny, root):
    """Gemma 3 with its SentencePiece-style tokenizer: norms stored as 1 + w as llama.cpp stores them, the vocabulary
    as llama.cpp's ``llama`` model (scores -id, specials -1000, no prefix space, add BOS); transformers' logits over
    24 positions (3 windows) equal ours (rel <= 1e-5; told query_pre_attn_scalar, which its GGUF reader leaves at 256
    where llama.cpp uses head_dim, 32), its tokenizer from the file encodes as the checkpoint's, and jaxtune's
    import gives the model back."""
    src = tiny("gemma3")
    out = export(src.model, root / "gemma3.gguf", tokenizer=src.tokenizer, gguf="f32")
    reader = gguf.GGUFReader(out)
    keys = {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 8, "gemma3.attention.key_length": 32,
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    assert {k: reader.fields[k].contents() for k in keys} == keys
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    assert scores[:6] == [-1000.0] * 6 and scores[6:] == [-float(i) for i in range(6, len(scores))]
    norm = next(t for t in reader.tensors if t.name == "blk.0.attn_norm.weight")
    np.testing.assert_array_equal(np.asarray(norm.data), HFCheckpoint(src.directory).get(
        "model.layers.0.input_layernorm.weight") + np.float32(1))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file=out.name, attn_implementation="eager", query_pre_attn_scalar=tiny_gemma3.HEAD_DIM).eval()
    assert rel(torch_logits(theirs, src.ids), src.logits) <= 1e-5
    assert rel(jax_logits(from_hf(out), src.ids), src.logits) <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=out.name)
    reference = transformers.AutoTokenizer.from_pretrained(src.directory)
    for text in GEMMA_SAMPLES:
        assert tok(text).input_ids == reference(text).input_ids, text
    assert tok.chat_template == tiny_gemma3.TEMPLATE


@pytest.fixture(scope="module")
def lora_run(tiny, root):
    """A LoRA run (rank 4) from the tiny Llama checkpoint, trained 2 steps on text."""
    text = root / "train.txt"
    text.write_text("\n".join(TEXTS * 20))
    cfg = load_config(None, [f"model.from_hf={tiny('llama').directory}", "model.lora.rank=4", "model.lora.alpha=8",
                             f"data.sources=[{text}]", f"data.cache_dir={root / 'data-cache'}", "data.seq_len=16",
                             "data.val_fraction=0", "train.steps=2", "train.batch_size=2", "optim.lr=3e-2",
                             "optim.warmup_steps=1", "eval.every=0", "checkpoint.every=2", "logging.progress=false",
                             "logging.tensorboard=false", f"run_dir={root / 'lora-run'}"])
    train(cfg)
    return cfg.run_path


def test_lora_run_command(lora_run, tiny, root, capsys):
    """`jaxtune export RUN OUT.gguf --gguf --gguf-type f32` of a LoRA run writes the merged model: transformers'
    logits equal our adapted model's (rel <= 1e-5), far from the base model's; trained on text, it keeps the
    tokenizer's EOS and names no end of turn; an existing file is refused (exit 2)
    unless --overwrite, which replaces it whole (here with q8_0); bad flag combinations exit 2; nothing else is
    ever left beside the file."""
    out = root / "exports" / "lora.gguf"
    assert main(["export", str(lora_run), str(out), "--gguf", "--gguf-type", "f32"]) == 0
    assert "lora.gguf" in capsys.readouterr().out
    fields = gguf.GGUFReader(out).fields  # trained on text, not chat: the tokenizer's EOS, no end of turn
    assert fields["tokenizer.ggml.eos_token_id"].contents() == CHAT_SPECIALS.index("<|endoftext|>")
    assert "tokenizer.ggml.eot_token_id" not in fields
    run = load_run(lora_run)
    ids = np.asarray(IDS[:, :16])
    ours = np.asarray(merge(run.spec.graphdef, run.weights)(jnp.asarray(ids, jnp.int32)))
    assert rel(torch_logits(hf_from_gguf(out), ids), ours) <= 1e-5
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny("llama").directory)
    assert rel(torch_logits(base, ids), ours) > 1e-3

    stamp = out.stat().st_mtime_ns
    assert main(["export", str(lora_run), str(out), "--gguf"]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.stat().st_mtime_ns == stamp
    assert main(["export", str(lora_run), str(out), "--gguf", "--gguf-type", "q8_0", "--overwrite"]) == 0
    assert {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} == {"F32", "Q8_0"}
    for args in (["--gguf-type", "f16"], ["--gguf", "--adapter"], ["--gguf", "--dtype", "bfloat16"]):
        assert main(["export", str(lora_run), str(root / "exports" / "other.gguf"), *args]) == 2
    assert main(["export", str(lora_run), str(root / "exports" / "dir"), "--gguf"]) == 2
    assert sorted(p.name for p in out.parent.iterdir()) == ["lora.gguf"]



def test_qlora_run_exports_dequantized(tiny, root):
    """A QLoRA run (model.quantize=nf4, rank 4, 2 steps) from the tiny Llama exported to GGUF (f32): transformers'
    logits of the file equal our model's, the adapters merged into the dequantized base (rel <= 1e-5)."""
    text = root / "train.txt"
    text.write_text("\n".join(TEXTS * 20))
    cfg = load_config(None, [f"model.from_hf={tiny('llama').directory}", "model.lora.rank=4", "model.lora.alpha=8",
                             "model.quantize=nf4", f"data.sources=[{text}]", f"data.cache_dir={root / 'data-cache'}",
                             "data.seq_len=16", "data.val_fraction=0", "train.steps=2", "train.batch_size=2",
                             "optim.lr=3e-2", "optim.warmup_steps=1", "eval.every=0", "checkpoint.every=2",
                             "logging.progress=false", "logging.tensorboard=false", f"run_dir={root / 'qlora-run'}"])
    train(cfg)
    out = root / "exports" / "qlora.gguf"
    assert main(["export", str(cfg.run_path), str(out), "--gguf", "--gguf-type", "f32"]) == 0
    run = load_run(cfg.run_path)
    ids = np.asarray(IDS[:, :16])
    ours = np.asarray(merge(run.spec.graphdef, run.weights)(jnp.asarray(ids, jnp.int32)))
    assert rel(torch_logits(hf_from_gguf(out), ids), ours) <= 1e-5

def test_chat_run_stops_at_the_end_of_turn(tiny, root):
    """`jaxtune export RUN OUT.gguf --gguf` of a run trained 2 steps on ChatML conversations: the file's EOS and
    end-of-turn ids are <|im_end|>'s, where llama.cpp then stops (as `jaxtune generate` does), and transformers' model
    and tokenizer from the file stop greedy generation there (`helpers.chat_stops`)."""
    turns = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
             for t in TEXTS[:2]]
    rows = write_jsonl(root / "chat.jsonl", turns * 8)
    cfg = load_config(None, [f"model.from_hf={tiny('llama').directory}", "data.format=messages",
                             f"data.sources=[{rows}]", f"data.cache_dir={root / 'data-cache'}", "data.seq_len=64",
                             "data.val_fraction=0", "train.steps=2", "train.batch_size=2", "eval.every=0",
                             "checkpoint.every=2", "logging.progress=false", "logging.tensorboard=false",
                             f"run_dir={root / 'chat-run'}"])
    train(cfg)
    out = root / "exports" / "chat.gguf"
    assert main(["export", str(cfg.run_path), str(out), "--gguf", "--gguf-type", "f32"]) == 0
    end = CHAT_SPECIALS.index(END_OF_TURN)
    fields = gguf.GGUFReader(out).fields
    assert [fields[f"tokenizer.ggml.{k}_token_id"].contents() for k in ("eos", "eot")] == [end, end]
    tok = transformers.AutoTokenizer.from_pretrained(str(out.parent), gguf_file=out.name)
    assert tok.eos_token == END_OF_TURN
    assert_stopped_at(forced_generation(hf_from_gguf(out), tok, end), end)


def test_errors_and_warnings(tiny, root, monkeypatch, caplog):
    """A model type with no GGUF export (a torchax run's Phi-3), a Gemma 3 whose layer pattern llama.cpp would not
    follow (it fixes one global layer in six), a pre-tokenizer llama.cpp has no name for, a .gguf name without
    --gguf, and a missing gguf package: each a one-line error naming it. The pre-tokenizer names are the ones
    transformers' GGUF loader maps to the same splitting regex. A Mistral with a sliding window exports as llama.cpp
    runs it (a Llama, attending to the whole context), and the log says so."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    src = tiny("llama")
    phi = root / "phi3"
    shutil.copytree(src.directory, phi)
    (phi / "config.json").write_text(json.dumps({**json.loads((phi / "config.json").read_text()),
                                                 "model_type": "phi3", "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="'phi3'") as e:
        write_gguf(phi, root / "phi3.gguf", "f16")
    assert "\n" not in str(e.value) and not (root / "phi3.gguf").exists()
    with pytest.raises(UnsupportedModelError, match="layer types") as e:
        export(build_model(GEMMA3["tiny"](), 0), root / "gemma3-pattern.gguf", tokenizer=src.tokenizer, gguf="f16")
    assert "\n" not in str(e.value)
    for name in ("llama-bpe", "qwen2"):
        t = Tokenizer(models.BPE())
        t.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[name]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        assert pre_tokenizer_name(json.loads(t.to_str())["pre_tokenizer"], "t") == name
    with pytest.raises(UnsupportedModelError, match="WhitespaceSplit"):
        pre_tokenizer_name({"type": "WhitespaceSplit"}, "tokenizer.json")
    with pytest.raises(ConfigError, match="--gguf"):
        export(src.model, root / "plain.gguf", tokenizer=src.tokenizer)
    export(build_model(MISTRAL["tiny"](), 0), root / "mistral-window.gguf", tokenizer=src.tokenizer, gguf="f16")
    assert "Mistral's 16-token sliding window is not written" in caplog.text
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if not installed
    with pytest.raises(CheckpointError, match="pip install gguf"):
        export(src.model, root / "none.gguf", tokenizer=src.tokenizer, gguf="f16")


# --- a real model ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_f16_export(root):
    """SmolLM2-135M-Instruct (Q4_1, imported by jaxtune) exported to f16 and reloaded by transformers: both answer a
    chat prompt greedily with SmolLM2's answer, through the EOS (each one's argmax at every position of it,
    teacher-forced: what its greedy decode gives), and the logits over prompt and answer are ours within rel 5e-3."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not installed ({SMOLLM2_INSTALL})")
    model = from_hf(path)
    tok = load_hf_tokenizer(str(HFCheckpoint(path).dir))
    out = export(model, root / "smollm2-f16.gguf", tokenizer=tok, gguf="f16")
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    ids = tok.encode_chat([prompt])[0]
    answer = tok.encode_chat(["The capital of France is Paris.<|im_end|>"])[0]
    assert answer[-1] == tok.eos_id
    ours = jax_logits(model, [ids + answer])
    theirs = torch_logits(hf_from_gguf(out), [ids + answer])
    for logits in (ours, theirs):
        assert logits[0, len(ids) - 1:-1].argmax(-1).tolist() == answer
    err = rel(theirs, ours)
    print(f"SmolLM2 f16 export: logits rel {err:.2e}")
    assert err <= 5e-3


# --- llama.cpp ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "tied", "gemma3", "mistral", "gpt2"])
def test_llama_cpp(tiny, root, name):
    """llama.cpp itself (llama-cpp-python) runs the f32 export: it tokenizes as we do (byte-level BPE, and
    SentencePiece-style with and without the prefix space), and its logits at every position equal ours (rel <=
    1e-5; Gemma 3 and GPT-2 1e-3: module docstring)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install "
                                    "llama-cpp-python: a source build of llama.cpp, ~25 min on 2 cores)")
    src = tiny(name)
    out = export(src.model, root / f"llama-cpp-{name}.gguf", tokenizer=src.tokenizer, gguf="f32")
    llm = llama_cpp.Llama(model_path=str(out), logits_all=True, n_ctx=64, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # its default cache is f16
    for text in GEMMA_SAMPLES + [" leading space"] if name in ("gemma3", "mistral") else SAMPLES:
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == src.tokenizer.encode_chat([text])[0], text
    ids = [int(i) for i in src.ids[0]]
    llm.eval(ids)
    err = rel(np.asarray(llm.scores[:len(ids)], np.float32), src.logits[0])
    print(f"llama.cpp {name}: logits rel {err:.2e}")
    assert err <= (1e-3 if name in ("gemma3", "gpt2") else 1e-5)
