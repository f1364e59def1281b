"""GGUF import: a llama.cpp ``.gguf`` file as a HuggingFace model directory.

A ``.gguf`` file is converted once into a cached directory (config.json rebuilt from the GGUF metadata,
model.safetensors with every tensor dequantized to float32, the tokenizer with its chat template, and
generation_config.json), which the HuggingFace path (`jaxtune.models.hf`) then reads like any other. The cache key
is the file's size, mtime and the sha256 of its first `HASHED_BYTES`, so an edited or replaced file is converted
again; the directory is written beside its final name and renamed into place (`jaxtune.io.atomic_dir`).

Architectures: ``llama`` (Llama 2/3.x (3.1+ RoPE scaling from ``rope_freqs``), SmolLM, Mistral), ``qwen2``, ``qwen3``,
``gemma3`` (Gemma3ForCausalLM; tested on 270M, 1B has the same layout, and the text model of the 4B+ files reads
the same way) and ``gpt2`` (GPT2LMHeadModel: llama.cpp stores its Conv1D weights transposed, as (out, in)).
Tensor types: whatever the ``gguf`` package dequantizes (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants,
...). llama.cpp's converter permutes the rows of a llama model's q/k projections for its RoPE layout,
and stores Gemma's RMSNorm weights as the scale they apply, 1 + w; both are undone.
Needs ``gguf`` (tensors) and ``transformers`` (the tokenizer): ``pip install gguf transformers``.
QLoRA with ``model.quantize: gguf`` keeps the adapted kernels as the file's own blocks instead of these float copies
(`jaxtune.models.gguf_blocks`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxtune.io import CheckpointError, atomic_dir, exclusive, write_safetensors
from jaxtune.models.unsupported import TORCHAX_HINT, UnsupportedModelError

CONVERTER_VERSION = 1  # part of the cache key: bump when the converted directory changes
HASHED_BYTES = 16 << 20
INSTALL = "pip install gguf transformers"

# GGUF general.architecture -> (HF model_type, HF architecture class, q/k rows permuted by llama.cpp)
ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM", True), "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
                 "qwen3": ("qwen3", "Qwen3ForCausalLM", False), "gemma3": ("gemma3_text", "Gemma3ForCausalLM", False),
                 "gpt2": ("gpt2", "GPT2LMHeadModel", False)}

_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Per architecture, where its block names differ from `_BLOCK`: Gemma 3 also norms each sublayer's output, and HF
# calls the pre-MLP norm (llama.cpp's ffn_norm) pre_feedforward_layernorm.
BLOCK_RENAMES = {"gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                            "post_ffw_norm": "post_feedforward_layernorm"}}
# GPT-2's own names (GPT2LMHeadModel), and the GGUF block tensors that are HF Conv1D weights: (in, out) in HF,
# transposed to (out, in) by llama.cpp's converter like every other linear layer it writes.
GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
              "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
            "output": "lm_head"}
CONV1D = {"gpt2": ("attn_qkv", "attn_output", "ffn_up", "ffn_down")}
# What llama.cpp's convert_hf_to_gguf.py adds to every ``*norm.weight`` (Gemma 3's RMSNorm scales by 1 + w; llama.cpp
# stores that scale): subtracted on import.
NORM_SHIFT = {"gemma3": 1.0}
# What llama.cpp does not write for Gemma 3 but fixes in llama-model.cpp (see `gemma3_config`).
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# HF model_type -> its end-of-turn token, which llama.cpp also stops at (llama-vocab.cpp finds it by its text):
# listed with the EOS in generation_config.json, as Gemma's own is, so a chat answer stops there.
END_OF_TURN = {"gemma3_text": "<end_of_turn>"}


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    """Where converted files live: $JAXTUNE_GGUF_CACHE, else ~/.cache/jaxtune/gguf."""
    return Path(os.environ.get("JAXTUNE_GGUF_CACHE") or "~/.cache/jaxtune/gguf").expanduser()


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"reading a .gguf file needs the gguf package: {INSTALL}") from None
    return gguf


def cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(HASHED_BYTES))
    return f"{path.stem[:60]}-{st.st_size}-{st.st_mtime_ns}-{h.hexdigest()[:16]}-v{CONVERTER_VERSION}"


def gguf_to_hf_dir(path: str | Path, cache: Path | None = None) -> Path:
    """The HuggingFace model directory a ``.gguf`` file converts to, converted on first use and cached."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CheckpointError(f"{path}: no such .gguf file")
    out = (cache or cache_root()) / cache_key(path)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out.parent / f".{out.name}.lock"):  # one process converts; the others wait and read it
        if not (out / "config.json").is_file():
            atomic_dir(out, lambda tmp: convert(path, tmp), replace=False)
    return out


# --- metadata ---

def _fields(reader: Any) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.scores"):
            out[key] = len(field.data)  # only their length is needed here; transformers reads the tokenizer
            continue
        try:
            out[key] = field.contents()
        except (ValueError, TypeError, IndexError, KeyError):  # a field this gguf cannot decode: not one we use
            continue
    return out


def hf_config(meta: dict[str, Any], tensor_names: set[str], where: str) -> dict[str, Any]:
    """config.json for the GGUF metadata ``meta`` (see `_fields`)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{where}: GGUF architecture {arch!r} is not supported (supported: "
                                    f"{', '.join(ARCHITECTURES)}); convert the original HuggingFace checkpoint "
                                    "instead, or use a supported model")
    model_type, cls, _ = ARCHITECTURES[arch]

    def get(key: str, default: Any = KeyError) -> Any:
        if f"{arch}.{key}" in meta:
            return meta[f"{arch}.{key}"]
        if default is KeyError:
            raise CheckpointError(f"{where}: GGUF metadata lacks {arch}.{key}")
        return default

    if arch == "gpt2":
        return gpt2_config(get, meta)
    n_head = int(get("attention.head_count"))
    d_model = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", KeyError if arch == "gemma3" else d_model // n_head))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise UnsupportedModelError(f"{where}: partial RoPE ({arch}.rope.dimension_count={rope_dim}, head_dim="
                                    f"{head_dim}) is not supported natively; {TORCHAX_HINT}")
    vocab = meta.get("tokenizer.ggml.tokens") or get("vocab_size")
    n_layer = int(get("block_count"))
    c: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "vocab_size": int(vocab), "hidden_size": d_model,
        "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": n_layer,
        "num_attention_heads": n_head, "num_key_value_heads": int(get("attention.head_count_kv", n_head)),
        "head_dim": head_dim, "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)), "hidden_act": "silu",
        "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_scaling": rope_scaling(get, where),
        "tie_word_embeddings": "output.weight" not in tensor_names, "torch_dtype": "float32",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    if model_type == "llama":
        c["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        c["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    if model_type in ("qwen2", "qwen3"):
        c["use_sliding_window"] = False
        if model_type == "qwen3":
            c["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "gemma3":
        del c["hidden_act"]  # Gemma's is hidden_activation
        c.update(gemma3_config(get, n_layer, d_model, n_head, head_dim, where))
    return c


def gpt2_config(get: Callable[..., Any], meta: dict[str, Any]) -> dict[str, Any]:
    """config.json of a ``gpt2`` GGUF (llama.cpp's GPT2Model keys): GPT2LMHeadModel, its embeddings tied."""
    d_model, d_ff, n_pos = int(get("embedding_length")), int(get("feed_forward_length")), int(get("context_length"))
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": int(meta.get("tokenizer.ggml.tokens") or get("vocab_size")), "n_positions": n_pos,
            "n_ctx": n_pos, "n_embd": d_model, "n_layer": int(get("block_count")),
            "n_head": int(get("attention.head_count")), "n_inner": None if d_ff == 4 * d_model else d_ff,
            "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
            "activation_function": "gelu_new", "tie_word_embeddings": True, "torch_dtype": "float32",
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}


def rope_scaling(get: Callable[..., Any], where: str) -> dict[str, Any] | None:
    """config.json's ``rope_scaling`` for the GGUF's rope.scaling keys: none, or linear (position interpolation)."""
    kind = get("rope.scaling.type", "none")
    if kind in ("none", "", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    raise UnsupportedModelError(f"{where}: GGUF rope scaling {kind!r} is not supported; use the original "
                                "HuggingFace checkpoint")


def gemma3_config(get: Callable[..., Any], n_layer: int, d_model: int, n_head: int, head_dim: int,
                  where: str) -> dict[str, Any]:
    """The Gemma 3 fields of config.json. The file has the sliding window and the global layers' RoPE
    (rope.freq_base, rope.scaling); what llama.cpp's converter does not write, llama-model.cpp fixes, and so does
    this: one global layer in every six (unless attention.sliding_window_pattern is given), base 10000 for the
    sliding layers' RoPE, and attention scaled by head_dim^-1/2, but by (d_model / n_head)^-1/2 in the 27B (62
    layers)."""
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{where}: gemma3.attention.value_length differs from key_length; Gemma 3 has "
                                    "one head_dim")
    pattern = get("attention.sliding_window_pattern", GEMMA3_PATTERN)
    if isinstance(pattern, list):  # per layer: True where the layer slides
        if len(pattern) != n_layer:
            raise CheckpointError(f"{where}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                                  f"for {n_layer} layers")
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:  # one global layer in every ``pattern`` (0: none, as llama.cpp reads it)
        every = int(pattern)
        types = ["sliding_attention" if every == 0 or (i + 1) % every else "full_attention" for i in range(n_layer)]
    softcap = get("final_logit_softcapping", None)
    return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": int(get("attention.sliding_window")),
            "layer_types": types, "rope_local_base_freq": float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
            "query_pre_attn_scalar": d_model // n_head if n_layer == 62 else head_dim,
            "final_logit_softcapping": None if softcap is None else float(softcap), "attn_logit_softcapping": None}


# --- tensors ---

def tensor_names(arch: str) -> dict[str, str]:
    """GGUF tensor stem -> HF tensor stem for the GGUF architecture ``arch``, blocks as ``{i}``
    (``blk.{i}.attn_q`` -> ``model.layers.{i}.self_attn.q_proj``); the export reads it backwards."""
    if arch == "gpt2":
        block, top, prefix = GPT2_BLOCK, GPT2_TOP, "transformer.h.{i}."
    else:
        block, top, prefix = {**_BLOCK, **BLOCK_RENAMES.get(arch, {})}, _TOP, "model.layers.{i}."
    return {**{f"blk.{{i}}.{stem}": prefix + hf for stem, hf in block.items()}, **top}


def hf_name(name: str, where: str, arch: str = "llama") -> str:
    """The HF tensor name of a GGUF one (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    table = tensor_names(arch)
    if parts[0] == "blk" and len(parts) == 3 and f"blk.{{i}}.{parts[2]}" in table:
        return f"{table[f'blk.{{i}}.{parts[2]}'].format(i=parts[1])}.{suffix}"
    if stem in table:
        return f"{table[stem]}.{suffix}"
    raise UnsupportedModelError(f"{where}: GGUF tensor {name!r} has no HuggingFace counterpart natively; "
                                "use the original HuggingFace checkpoint")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py ``LlamaModel.permute``)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantized(tensor: Any, where: str) -> np.ndarray:
    """A GGUFReader tensor as a float32 array in numpy (= HF, (out, in)) order."""
    t = tensor.tensor_type
    try:
        x = _gguf().quants.dequantize(tensor.data, t)
    except NotImplementedError:
        raise CheckpointError(f"{where}: tensor {tensor.name} has GGUF type {t.name}, which the gguf package cannot "
                              "dequantize; use a file quantized to another type (F16, Q8_0, Q4_K, ...)") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(shape))


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(config.json dict, {HF name: float32 array}) of a .gguf file."""
    gguf = _gguf()
    where = str(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - any parse failure is a damaged or non-GGUF file
        raise CheckpointError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = _fields(reader)
    names = {t.name for t in reader.tensors}
    config = hf_config(meta, names, where)
    arch = meta["general.architecture"]
    permuted, shift = ARCHITECTURES[arch][2], NORM_SHIFT.get(arch)
    conv1d = tuple(f".{stem}.weight" for stem in CONV1D.get(arch, ()))
    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            config["rope_scaling"] = llama3_rope(dequantized(t, where), config, where)
            continue
        name = hf_name(t.name, where, arch)
        x = dequantized(t, where)
        if permuted and t.name.endswith((".attn_q.weight", ".attn_q.bias")):
            x = unpermute(x, config["num_attention_heads"])
        elif permuted and t.name.endswith((".attn_k.weight", ".attn_k.bias")):
            x = unpermute(x, config["num_key_value_heads"])
        elif shift and t.name.endswith("norm.weight"):
            x = x - np.float32(shift)
        elif t.name.endswith(conv1d):
            x = np.ascontiguousarray(x.T)
        tensors[name] = x
    if arch == "gpt2" and "lm_head.weight" in tensors:
        check_tied(tensors.pop("lm_head.weight"), tensors["transformer.wte.weight"], where)
    return config, tensors


TIED_TOLERANCE = 0.25


def check_tied(head: np.ndarray, embedding: np.ndarray, where: str) -> None:
    """A GPT-2 GGUF may carry ``output.weight``: older llama.cpp converters wrote a copy of the (tied) embedding,
    often quantized to another type. GPT2LMHeadModel ties the two, so the copy is dropped when it is the embedding
    within quantization error: rms(head - embedding) <= `TIED_TOLERANCE` rms(embedding) (Q4_0 of a Gaussian
    matrix is ~0.1; two unrelated matrices are ~1.4)."""
    diff = float(np.sqrt(np.mean((head - embedding) ** 2) / max(np.mean(embedding**2), 1e-30))) \
        if head.shape == embedding.shape else np.inf
    if diff > TIED_TOLERANCE:
        raise UnsupportedModelError(f"{where}: its output.weight is not the token embedding (relative rms "
                                    f"difference {diff:.2f}); GPT-2 ties them, so this is not a GPT-2 jaxtune or "
                                    "transformers can load; use the original HuggingFace checkpoint")


def llama3_rope(divisors: np.ndarray, config: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``rope_scaling`` of a Llama 3.1+ GGUF, whose ``rope_freqs`` tensor holds the per-frequency divisors
    convert_hf_to_gguf.py computed from it: factor = the largest divisor, and low/high_freq_factor and
    original_max_position_embeddings Meta's (1, 4, 8192), checked by recomputing every divisor."""
    dim, theta = config["head_dim"], config["rope_theta"]
    factor = float(divisors.max())
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    old = scaling["original_max_position_embeddings"]
    low, high = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    want = []
    for freq in 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * np.pi / freq
        low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
        smooth = (old / wavelen - low_factor) / (high_factor - low_factor)
        want.append(1.0 if wavelen < high else factor if wavelen > low else 1 / ((1 - smooth) / factor + smooth))
    if divisors.shape != (dim // 2,) or not np.allclose(divisors, want, rtol=1e-4):
        raise UnsupportedModelError(f"{where}: its rope_freqs are not Llama 3's RoPE scaling (factor {factor:g}, "
                                    "low/high_freq_factor 1/4, original context 8192); use the original "
                                    "HuggingFace checkpoint")
    return scaling


# --- the converted directory ---

def _tokenizer(path: Path, out: Path) -> Any:
    """The GGUF's tokenizer as transformers rebuilds it, saved into ``out``."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CheckpointError(f"{path}: its tokenizer is converted by transformers: {INSTALL}") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - transformers' own message says which tokenizer it could not read
        raise CheckpointError(f"{path}: transformers could not convert its tokenizer ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    tok.save_pretrained(str(out))
    return tok


def convert(path: Path, out: Path) -> None:
    """Write the HuggingFace model directory of the .gguf ``path`` into ``out``."""
    config, tensors = read_gguf(path)
    tok = _tokenizer(path, out)
    write_safetensors(out / "model.safetensors", tensors)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    eot = tok.get_vocab().get(END_OF_TURN.get(config["model_type"], ""))
    if eot is not None and "eos_token_id" in gen and eot != gen["eos_token_id"]:
        gen["eos_token_id"] = [gen["eos_token_id"], eot]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "SOURCE").write_text(f"{path.resolve()}\n")
