"""GGUF export: a HuggingFace model directory (what `jaxtune export` writes) as one llama.cpp ``.gguf`` file.

The file is laid out as llama.cpp's convert_hf_to_gguf.py lays it out, so llama.cpp, Ollama and transformers
(``gguf_file=``) load it: the hyperparameters under llama.cpp's metadata keys; the tensors under llama.cpp's names
(the inverse of `jaxtune.models.gguf`'s tables), a Llama's q/k rows permuted for llama.cpp's RoPE, no
``output.weight`` when the embeddings are tied, Llama 3.1's RoPE scaling as the ``rope_freqs`` tensor; and the
tokenizer: a byte-level BPE as ``tokenizer.ggml.model = gpt2`` (tokens, token types, merges, the name llama.cpp
knows its pre-tokenizer by, the special ids, whether BOS/EOS are added), or a SentencePiece-style one (byte
fallback: Llama 2, Mistral, Gemma) as ``llama`` with scores, with its chat template.

Types: f32, f16 (the default), bf16 and q8_0 (blocks of 32 values sharing one f16 scale), encoded by the ``gguf``
package. As in llama.cpp, 1-D tensors (norms, biases) and ``rope_freqs`` stay F32, and a matrix whose rows do not
split into whole Q8_0 blocks is written F16 (logged). Architectures: ``llama`` (Llama, SmolLM, and Mistral, which
llama.cpp runs as a Llama), ``qwen2``, ``qwen3``, ``gemma3`` (RMSNorm scales stored as 1 + w, as llama.cpp does),
``gpt2`` (its Conv1D weights transposed to (out, in), as llama.cpp's converter writes them).
Needs the ``gguf`` package (`INSTALL`).
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from jaxtune.config import GGUF_TYPES, ConfigError
from jaxtune.io import CheckpointError, read_json
from jaxtune.models.decoder import DecoderConfig
from jaxtune.models.gguf import (
    ARCHITECTURES,
    CONV1D,
    GEMMA3_LOCAL_ROPE_BASE,
    GEMMA3_PATTERN,
    NORM_SHIFT,
    tensor_names,
)
from jaxtune.models.hf import HFCheckpoint, read_config_json, read_hf_config
from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import UnsupportedModelError

log = logging.getLogger(__name__)

INSTALL = "pip install gguf"
# HF model_type -> GGUF general.architecture (llama.cpp converts Mistral as a Llama)
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
        "gpt2": "gpt2"}
# The regex of a byte-level BPE's Split pre-tokenizer -> the name llama.cpp knows that splitting by
# (tokenizer.ggml.pre; llama-vocab.cpp holds the rule itself).
SPLITS = {r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+": "llama-bpe",
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+": "qwen2"}


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CheckpointError(f"writing a .gguf file needs the gguf package: {INSTALL}") from None
    return gguf


def check_out_file(out: Path, overwrite: bool) -> None:
    """Refuse an existing ``out`` unless ``overwrite`` (``--overwrite``), and always a directory there; ``out`` must
    end in .gguf (the suffix llama.cpp, Ollama and jaxtune recognise the format by). Checked before any work, as is
    the gguf package."""
    _gguf()
    if out.suffix.lower() != ".gguf":
        raise ConfigError(f"{out}: a GGUF export is one file named *.gguf; choose a name ending in .gguf")
    if out.is_dir():
        raise FileExistsError(f"{out} is a directory; choose a file name ending in .gguf")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose a new file name, or pass --overwrite to replace it")


def write_gguf(hf_dir: str | Path, out: str | Path, gguf_type: str = "f16", *, name: str | None = None,
               end_of_turn: Sequence[int] = ()) -> Path:
    """Write the HuggingFace model directory ``hf_dir`` (config.json, safetensors, tokenizer.json) as the GGUF file
    ``out``, its matrices as ``gguf_type`` (`GGUF_TYPES`). Written beside ``out`` and renamed into place; an existing
    ``out`` is replaced (`check_out_file` is the caller's guard). ``name``: general.name, default ``out``'s stem.
    ``end_of_turn``: a chat model's end-of-turn ids; the first is tokenizer.ggml.eot_token_id, where llama.cpp ends
    a turn (the EOS is the tokenizer's, which a chat export names as the end of turn too)."""
    gguf = _gguf()
    hf_dir, out = Path(hf_dir), Path(out)
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"GGUF type {gguf_type!r}; supported: {', '.join(GGUF_TYPES)}")
    model_type = read_config_json(hf_dir).get("model_type")
    if model_type not in ARCH:
        raise UnsupportedModelError(f"{hf_dir}: GGUF export of a {model_type!r} model is not supported (supported: "
                                    f"{', '.join(ARCH)}); export a HuggingFace directory instead (drop --gguf) and "
                                    "convert it with llama.cpp's convert_hf_to_gguf.py")
    _, cfg, _ = read_hf_config(hf_dir)
    w = gguf.GGUFWriter(None, ARCH[model_type])
    w.add_name(name or out.stem)
    w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_hyperparameters(w, cfg, str(hf_dir))
    add_tokenizer(w, hf_dir, cfg.vocab_size)
    if end_of_turn:
        w.add_eot_token_id(int(end_of_turn[0]))
    pending = _declare_tensors(w, HFCheckpoint(hf_dir), cfg, gguf_type)
    tmp = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for make in pending:  # one tensor in memory at a time
            w.write_tensor_data(make())
        w.close()
        os.replace(tmp, out)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return out


# --- metadata ---

def add_hyperparameters(w: Any, cfg: Any, where: str) -> None:
    """llama.cpp's hyperparameter keys (under the writer's architecture) for ``cfg``, a `DecoderConfig` (a
    `GPTConfig` for ``gpt2``)."""
    gguf = _gguf()
    if w.arch == "gpt2":  # llama.cpp's GPT2Model: learned positions, LayerNorm, no RoPE
        for add, value in [(w.add_vocab_size, cfg.vocab_size), (w.add_context_length, cfg.max_seq_len),
                           (w.add_embedding_length, cfg.d_model), (w.add_block_count, cfg.n_layer),
                           (w.add_feed_forward_length, cfg.ff), (w.add_head_count, cfg.n_head),
                           (w.add_layer_norm_eps, cfg.ln_eps)]:
            add(value)
        return
    if w.arch == "gemma3":
        _check_gemma3(cfg, where)
        w.add_sliding_window(cfg.sliding_window)
    elif "sliding" in cfg.types:
        if cfg.family != "mistral":
            raise UnsupportedModelError(f"{where}: sliding-window layers are not expressible in a GGUF {w.arch!r} "
                                        "model; export a HuggingFace directory instead (drop --gguf)")
        log.warning("%s: Mistral's %d-token sliding window is not written: llama.cpp runs Mistral as a Llama, "
                    "attending to the whole context (as its own converter does)", where, cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.hd)
    w.add_value_length(cfg.hd)
    w.add_rope_dimension_count(cfg.hd)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    if cfg.rope.kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope.factor)
    if cfg.final_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_softcap)


def _check_gemma3(cfg: Any, where: str) -> None:
    """What llama.cpp fixes for Gemma 3 rather than reads from the file (llama-model.cpp; see
    `jaxtune.models.gguf.gemma3_config`) must be what ``cfg`` has, or llama.cpp would run another model."""
    pattern = tuple("sliding" if (i + 1) % GEMMA3_PATTERN else "full" for i in range(cfg.n_layer))
    local = cfg.local_rope or cfg.rope
    scale = (cfg.d_model // cfg.n_head if cfg.n_layer == 62 else cfg.hd) ** -0.5
    for ok, what in [(cfg.types == pattern, f"layer types {cfg.types} (llama.cpp: 1 global in {GEMMA3_PATTERN})"),
                     (local.kind == "default" and local.theta == GEMMA3_LOCAL_ROPE_BASE,
                      f"sliding layers' RoPE {local} (llama.cpp: base {GEMMA3_LOCAL_ROPE_BASE:g}, unscaled)"),
                     (abs((cfg.query_scale or cfg.hd ** -0.5) - scale) <= 1e-6 * scale,
                      f"attention scale {cfg.query_scale} (llama.cpp: {scale:g})"),
                     (cfg.attn_softcap is None, "attention logit softcapping")]:
        if not ok:
            raise UnsupportedModelError(f"{where}: a Gemma 3 GGUF cannot express its {what}; export a HuggingFace "
                                        "directory instead (drop --gguf)")


def rope_freqs(rope: Rope, head_dim: int) -> np.ndarray:
    """Llama 3.1 RoPE scaling as llama.cpp stores it: (head_dim/2,) float32 divisors of the unscaled frequencies."""
    return Rope(theta=rope.theta).inv_freq(head_dim) / rope.inv_freq(head_dim)


# --- tensors ---

def gguf_names(arch: str) -> dict[str, str]:
    """HF tensor stem (``model.layers.{i}.self_attn.q_proj``) -> GGUF stem (``blk.{i}.attn_q``): the import's
    table (`jaxtune.models.gguf.tensor_names`) read backwards."""
    return {hf: stem for stem, hf in tensor_names(arch).items()}


def gguf_name(name: str, table: dict[str, str]) -> str:
    """The GGUF name of the HF tensor ``name`` by ``table`` (`gguf_names`); the layer index is the stem's first
    all-digit part (``model.layers.3.…``, ``transformer.h.3.…``)."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    layer = next((k for k, part in enumerate(parts) if part.isdigit()), None)
    if layer is not None:
        stem = ".".join([*parts[:layer], "{i}", *parts[layer + 1:]])
    if stem not in table:
        raise UnsupportedModelError(f"tensor {name!r} has no llama.cpp name; GGUF export cannot write it")
    return f"{table[stem].format(i=parts[layer] if layer is not None else '')}.{suffix}"


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for its RoPE (convert_hf_to_gguf.py ``LlamaModel.permute``; undone by
    `jaxtune.models.gguf.unpermute`): within each head, the rows of the two rotated halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _order(name: str) -> tuple[int, str]:
    """llama.cpp's order: the embedding, the blocks in turn, then the final norm and head."""
    parts = name.split(".")
    if parts[0] == "blk":
        return int(parts[1]) + 1, name
    return (0 if parts[0] == "token_embd" else 1 << 30), name


def _declare_tensors(w: Any, ckpt: HFCheckpoint, cfg: Any, gguf_type: str) -> list[Any]:
    """Declare every tensor (name, shape, type, size) to ``w``; returns, in the same order, a function per tensor
    that makes its bytes."""
    gguf = _gguf()
    q = gguf.GGMLQuantizationType
    want = {"f32": q.F32, "f16": q.F16, "bf16": q.BF16, "q8_0": q.Q8_0}[gguf_type]
    table = gguf_names(w.arch)
    tensors: dict[str, tuple[str, Any, tuple[int, ...]]] = {}  # GGUF name -> (HF name, type, shape)
    conv1d = tuple(f".{stem}.weight" for stem in CONV1D.get(w.arch, ()))  # HF (in, out) -> GGUF (out, in)
    for hf in ckpt.names():
        name, shape = gguf_name(hf, table), tuple(ckpt.files[ckpt.where[hf]].entries[hf]["shape"])
        if name.endswith(conv1d):
            shape = shape[::-1]
        qtype = q.F32 if len(shape) < 2 else want
        if qtype == q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[q.Q8_0][0]:
            qtype = q.F16
        tensors[name] = (hf, qtype, shape)
    fallback = sorted((n for n, (_, t, _) in tensors.items() if t == q.F16 and want == q.Q8_0), key=_order)
    if fallback:
        log.warning("GGUF q8_0: %d tensors whose rows do not split into 32-value blocks are written as F16: %s",
                    len(fallback), ", ".join(fallback))
    heads = {"attn_q": cfg.n_head, "attn_k": cfg.kv_heads} if ARCHITECTURES[w.arch][2] else {}
    shift = NORM_SHIFT.get(w.arch)

    def encode(hf: str, name: str, qtype: Any) -> Any:
        def make() -> np.ndarray:
            x = np.asarray(ckpt.get(hf), np.float32)
            if name.split(".")[-2] in heads:
                x = permute(x, heads[name.split(".")[-2]])
            elif shift and name.endswith("norm.weight"):  # Gemma: llama.cpp stores RMSNorm's scale, 1 + w
                x = x + np.float32(shift)
            elif name.endswith(conv1d):
                x = x.T
            return gguf.quants.quantize(np.ascontiguousarray(x), qtype)
        return make

    pending = []
    if isinstance(cfg, DecoderConfig) and cfg.rope.kind == "llama3":  # GPT-2 (GPTConfig) has no RoPE
        freqs = rope_freqs(cfg.rope, cfg.hd)
        w.add_tensor_info("rope_freqs.weight", freqs.shape, freqs.dtype, freqs.nbytes, raw_dtype=q.F32)
        pending.append(lambda: freqs)
    for name in sorted(tensors, key=_order):
        hf, qtype, shape = tensors[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        pending.append(encode(hf, name, qtype))
    return pending


# --- tokenizer ---

def pre_tokenizer_name(pre: dict[str, Any] | None, where: str) -> str:
    """The llama.cpp name (tokenizer.ggml.pre) of a byte-level BPE's pre-tokenizer (tokenizer.json)."""
    pre = pre or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds[-1:] == ["ByteLevel"] and not steps[-1].get("add_prefix_space", False):
        regex = steps[-1].get("use_regex", True)
        if kinds == ["ByteLevel"] and regex:
            return "gpt-2"
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and regex:
            return "smollm"
        if kinds == ["Split", "ByteLevel"] and not regex and steps[0].get("pattern", {}).get("Regex") in SPLITS:
            return SPLITS[steps[0]["pattern"]["Regex"]]
    raise UnsupportedModelError(f"{where}: its pre-tokenizer ({', '.join(map(str, kinds))}) is not one llama.cpp "
                                "knows by name (the GPT-2, Llama 3, Qwen 2 and SmolLM byte-level BPEs); export a "
                                "HuggingFace directory instead (drop --gguf)")


def _special(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _prepends_space(spec: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer.json puts a ▁ before the text (Llama 2, Mistral; not Gemma)."""
    steps = []
    for part in (spec.get("normalizer"), spec.get("pre_tokenizer")):
        part = part or {}
        steps += part.get("normalizers", part.get("pretokenizers", [])) if part.get("type") == "Sequence" else [part]
    return any(s.get("type") == "Prepend" or s.get("type") == "Metaspace" and s.get("prepend_scheme") != "never"
               for s in steps)


def add_tokenizer(w: Any, directory: Path, vocab_size: int) -> None:
    """tokenizer.ggml.* and tokenizer.chat_template from ``directory``'s tokenizer.json, tokenizer_config.json
    (special tokens, chat template), chat_template.jinja and config.json (ids tokenizer_config.json does not name),
    for a model of ``vocab_size`` embeddings. A byte-level BPE is llama.cpp's ``gpt2`` model; a BPE with byte
    fallback (SentencePiece converted: Llama 2, Mistral, Gemma) its ``llama`` model, whose merges llama.cpp takes
    from the scores: -id, the order the converter gives the pieces (merges written too, for transformers)."""
    file = directory / "tokenizer.json"
    spec = _bpe_spec(file, directory)
    model, added = spec["model"], spec.get("added_tokens", [])
    ids = {**model["vocab"], **{t["content"]: t["id"] for t in added}}
    if max(ids.values()) >= vocab_size:
        raise CheckpointError(f"{file}: token id {max(ids.values())} does not fit the model's {vocab_size} "
                              "embeddings")
    _add_vocabulary(w, spec, file, vocab_size)
    config = read_json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}
    _add_special_tokens(w, file, ids, config, read_config_json(directory))
    template = _chat_template(directory, config)
    if template:
        w.add_chat_template(template)


def _bpe_spec(file: Path, directory: Path) -> dict:
    """``file`` (``directory``'s tokenizer.json) read, refused unless it is a BPE tokenizer."""
    if not file.is_file():
        raise CheckpointError(f"{directory}: no tokenizer.json; a GGUF file carries its tokenizer, so export a model "
                              "with a HuggingFace or trained BPE tokenizer")
    spec = read_json(file)
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        raise UnsupportedModelError(f"{file}: a {model.get('type')!r} tokenizer; GGUF export writes BPE tokenizers "
                                    "(byte-level, or SentencePiece-style with byte fallback) only")
    return spec


def _token_table(spec: dict, vocab_size: int, spm: bool) -> tuple[list[str], list[Any]]:
    """(text, llama.cpp token type) of every id below ``vocab_size``: the vocabulary's tokens, then the added ones
    over them; ids the tokenizer never makes are unused ``[PAD{id}]``, named as llama.cpp does."""
    kind = _gguf().TokenType
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [kind.UNUSED] * vocab_size
    for text, i in spec["model"]["vocab"].items():
        tokens[i] = text
        types[i] = kind.BYTE if spm and re.fullmatch(r"<0x[0-9A-F]{2}>", text) else kind.NORMAL
    for t in spec.get("added_tokens", []):  # as written, not byte-level spelt: llama.cpp matches them in the raw text
        tokens[t["id"]] = t["content"]
        types[t["id"]] = kind.CONTROL if t.get("special") else kind.USER_DEFINED
    return tokens, types


def _add_vocabulary(w: Any, spec: dict, file: Path, vocab_size: int) -> None:
    """The tokenizer model (``llama`` with scores for a BPE with byte fallback, else ``gpt2`` with its
    pre-tokenizer), the tokens, their types and the merges."""
    kind = _gguf().TokenType
    model = spec["model"]
    spm = bool(model.get("byte_fallback"))
    tokens, types = _token_table(spec, vocab_size, spm)
    if spm:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_scores([-float(i) if t == kind.NORMAL else 0.0 if t == kind.BYTE else -1000.0
                            for i, t in enumerate(types)])
        w.add_add_space_prefix(_prepends_space(spec))
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer"), str(file)))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])


def _add_special_tokens(w: Any, file: Path, ids: dict[str, int], config: dict, model_config: dict) -> None:
    """The bos, eos, unk and pad ids (tokenizer_config.json's tokens, else config.json's ids), and whether encoding
    adds a BOS and an EOS (what the tokenizer's post-processor adds, as transformers encodes)."""
    for role, add in [("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unk", w.add_unk_token_id),
                      ("pad", w.add_pad_token_id)]:
        i = ids.get(_special(config.get(f"{role}_token")) or "", model_config.get(f"{role}_token_id"))
        if isinstance(i, list):  # several EOS ids: llama.cpp takes one, and finds end-of-turn tokens by their text
            i = i[0]
        if i is not None:
            add(int(i))
    tok = tokenizers.Tokenizer.from_file(str(file))
    plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    w.add_add_bos_token(full[:1] != plain[:1])
    w.add_add_eos_token(full[-1:] != plain[-1:])


def _chat_template(directory: Path, config: dict) -> str | None:
    """The chat template, in transformers' order of preference: chat_template.jinja, else tokenizer_config.json's
    (of a list of named templates, the ``default`` one)."""
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if isinstance(template, list):
        return next((t["template"] for t in template if t.get("name") == "default"), None)
    return template
