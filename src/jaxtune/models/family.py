"""What a model family declares: its config class and module, presets, and how it maps to HuggingFace
(config.json fields and tensor names). `jaxtune.models.hf` does the reading and writing once for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxtune.config import ConfigError
from jaxtune.models.layers import REMAT_POLICIES, Rope

TORCHAX_HINT = "set model.backend: torchax to train it through its PyTorch implementation"


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or config field jaxtune has no native implementation of."""


@dataclass(frozen=True)
class RuntimeConfig:
    """The fields every native family config has besides its shapes: how it runs (dtypes, remat, layer scan,
    attention kernel, dropout), its context, and the token ids an exported config.json carries."""

    vocab_size: int = 32000
    max_seq_len: int = 2048
    dropout: float = 0.0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    attention: str = "auto"  # auto | xla | cudnn
    bos_id: int | None = None  # token ids carried to an exported config.json
    eos_id: int | None = None

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")

    @property
    def needs_key(self) -> bool:
        """Whether training draws random numbers (dropout)."""
        return self.dropout > 0

    def replace(self, **kw) -> Any:
        return dataclasses.replace(self, **kw)


def check_fits(vocab_size: int, context: int, *, tokenizer_vocab: int | None = None, seq_len: int | None = None,
               max_seq_len: int | None = None, what: str = "the model") -> None:
    """The one check that a tokenizer and the configured lengths fit a model of ``vocab_size`` ids and ``context``
    positions (``what`` names it in the error): a `ConfigError` naming the key to change."""
    if tokenizer_vocab is not None and tokenizer_vocab > vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} ids but {what} only {vocab_size}; use the model's "
                          "tokenizer (or a model with a larger vocabulary)")
    if max_seq_len is not None and max_seq_len > context:
        raise ConfigError(f"model.max_seq_len={max_seq_len} exceeds the context of {what}, {context}")
    if seq_len is not None and seq_len > context:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's context (model.max_seq_len={context}); lower "
                          "data.seq_len or raise max_seq_len")


@dataclass(frozen=True)
class Map:
    """One parameter's HuggingFace tensor. ``transpose``: HF stores (out, in) where jaxtune has (in, out).
    A jaxtune parameter with more dims than its HF tensor (GPT-2's (D, 3, N*H) q/k/v) is reshaped."""

    hf: str
    transpose: bool = False
    hf_ndim: int | None = None  # HF's rank when it differs: jaxtune's trailing dims are flattened into it


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    module_cls: type
    presets: dict[str, Callable[..., Any]]
    hf_model_types: tuple[str, ...]  # config.json model_type values this family reads
    hf_map: dict[str, Map]  # jaxtune param path ("layers.{i}.attn.q.kernel") -> HF tensor
    from_hf: Callable[[dict[str, Any]], Any]  # config.json dict -> family config
    to_hf: Callable[[Any], dict[str, Any]]  # family config -> config.json dict
    hf_ignore: tuple[str, ...] = field(default=())  # HF tensor name suffixes that are buffers, not weights


def require(c: dict[str, Any], key: str, allowed: tuple[Any, ...], family: str) -> None:
    """Refuse a config.json value jaxtune does not implement natively, naming the field. A missing key takes
    the first allowed value (transformers' default)."""
    value = c.get(key, allowed[0])
    if value not in allowed:
        raise UnsupportedModelError(f"config.json: {key}={value!r} is not supported by the native {family} model "
                                    f"(supported: {', '.join(map(repr, allowed))}); {TORCHAX_HINT}")


def _rope_from_params(p: dict[str, Any] | None, theta: float, where: str) -> Rope:
    p = dict(p or {})
    kind = p.get("rope_type", p.get("type", "default"))
    theta = p.get("rope_theta", theta)
    if kind not in Rope.KINDS:
        raise UnsupportedModelError(f"config.json: {where}.rope_type={kind!r} is not supported natively "
                                    f"(supported: {', '.join(Rope.KINDS)}); {TORCHAX_HINT}")
    if p.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={p['partial_rotary_factor']} is not "
                                    f"supported natively; {TORCHAX_HINT}")
    if kind == "default":
        return Rope(theta=float(theta))
    if kind == "linear":
        return Rope(theta=float(theta), kind="linear", factor=float(p["factor"]))
    return Rope(theta=float(theta), kind="llama3", factor=float(p["factor"]),
                low_freq_factor=float(p["low_freq_factor"]), high_freq_factor=float(p["high_freq_factor"]),
                original_max_len=int(p["original_max_position_embeddings"]))


def rope_from_hf(c: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0) -> Rope:
    """RoPE of a config.json written by transformers 5.x (``rope_parameters``, possibly per layer type) or 4.x
    (``rope_theta`` + ``rope_scaling``; Gemma 3's ``rope_local_base_freq`` for sliding layers)."""
    params = c.get("rope_parameters")
    if params and layer_type and layer_type in params:
        return _rope_from_params(params[layer_type], default_theta, f"rope_parameters.{layer_type}")
    if params and "rope_type" in params or params and "rope_theta" in params:
        return _rope_from_params(params, default_theta, "rope_parameters")
    if layer_type == "sliding_attention" and "rope_local_base_freq" in c:
        return Rope(theta=float(c["rope_local_base_freq"]))
    return _rope_from_params(c.get("rope_scaling"), c.get("rope_theta", default_theta), "rope_scaling")


def rope_to_hf(rope: Rope) -> dict[str, Any] | None:
    """The 4.x ``rope_scaling`` dict (None for plain RoPE); transformers 5 reads it too."""
    if rope.kind == "default":
        return None
    if rope.kind == "linear":
        return {"rope_type": "linear", "factor": rope.factor}
    return {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor, "original_max_position_embeddings": rope.original_max_len}


def layer_types_from_hf(c: dict[str, Any], n_layer: int) -> tuple[str, ...] | None:
    """Per-layer full/sliding attention: ``layer_types`` (5.x), Gemma 3's ``sliding_window_pattern`` (4.x),
    Qwen's ``use_sliding_window`` + ``max_window_layers``; None when the config names none."""
    if c.get("layer_types"):
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        unknown = sorted(set(c["layer_types"]) - set(names))
        if unknown:
            raise UnsupportedModelError(f"config.json: layer_types {unknown} are not supported natively; {TORCHAX_HINT}")
        return tuple(names[t] for t in c["layer_types"])
    if "sliding_window_pattern" in c:
        p = int(c["sliding_window_pattern"])
        return tuple("sliding" if (i + 1) % p else "full" for i in range(n_layer))
    if "use_sliding_window" in c:
        if not c["use_sliding_window"] or not c.get("sliding_window"):
            return ("full",) * n_layer
        first = int(c.get("max_window_layers", 0))
        return tuple("sliding" if i >= first else "full" for i in range(n_layer))
    return None


def layer_types_to_hf(types: tuple[str, ...]) -> list[str]:
    return [f"{t}_attention" for t in types]


def token_ids_from_hf(c: dict[str, Any]) -> dict[str, int | None]:
    first = lambda v: v[0] if isinstance(v, list) else v
    return {"bos_id": first(c.get("bos_token_id")), "eos_id": first(c.get("eos_token_id")),
            "pad_id": first(c.get("pad_token_id"))}


def dtype_from_hf(c: dict[str, Any]) -> str:
    """The checkpoint's stored dtype (``dtype`` in 5.x, ``torch_dtype`` in 4.x); float32 when unsaid."""
    name = str(c.get("dtype") or c.get("torch_dtype") or "float32").replace("torch.", "")
    if name not in ("float32", "bfloat16", "float16"):
        raise UnsupportedModelError(f"config.json: dtype {name!r} is not supported (float32, bfloat16, float16)")
    return name


# --- The Llama-style decoder (decoder.py) shared by Llama, Qwen, Mistral and Gemma 3 ---

_L = "model.layers.{i}."


def decoder_hf_map(**renames: str) -> dict[str, Map]:
    """jaxtune `Decoder` param -> HF tensor, in the Llama naming; ``renames`` replaces the HF name of a param
    (Gemma 3 calls its pre-MLP norm ``pre_feedforward_layernorm``)."""
    m = {"embed.embedding": Map("model.embed_tokens.weight"), "norm.scale": Map("model.norm.weight"),
         "lm_head.embedding": Map("lm_head.weight"),
         "layers.{i}.attn_norm.scale": Map(_L + "input_layernorm.weight"),
         "layers.{i}.mlp_norm.scale": Map(_L + "post_attention_layernorm.weight"),
         "layers.{i}.attn.q_norm.scale": Map(_L + "self_attn.q_norm.weight"),
         "layers.{i}.attn.k_norm.scale": Map(_L + "self_attn.k_norm.weight")}
    for ours, theirs in [("attn.q", "self_attn.q_proj"), ("attn.k", "self_attn.k_proj"), ("attn.v", "self_attn.v_proj"),
                         ("attn.o", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.up", "mlp.up_proj"),
                         ("mlp.down", "mlp.down_proj")]:
        m[f"layers.{{i}}.{ours}.kernel"] = Map(f"{_L}{theirs}.weight", transpose=True)
        m[f"layers.{{i}}.{ours}.bias"] = Map(f"{_L}{theirs}.bias")
    for ours, theirs in renames.items():
        m[ours] = Map(_L + theirs if ours.startswith("layers.") else theirs, m[ours].transpose if ours in m else False)
    return m


ACT_FROM_HF = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}
ACT_TO_HF = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def decoder_from_hf(c: dict[str, Any], cls: type, family: str, act_key: str = "hidden_act", **diff: Any):
    """The fields every Llama-style config.json has; ``diff`` is what the family sets differently."""
    act = c.get(act_key, "silu")
    if act not in ACT_FROM_HF:
        raise UnsupportedModelError(f"config.json: {act_key}={act!r} is not supported natively; {TORCHAX_HINT}")
    n_layer = int(c["num_hidden_layers"])
    types = layer_types_from_hf(c, n_layer)
    window = c.get("sliding_window")
    if types is not None and "sliding" not in types:
        window = None
    fields = dict(
        family=family, vocab_size=int(c["vocab_size"]), max_seq_len=int(c.get("max_position_embeddings", 2048)),
        n_layer=n_layer, n_head=int(c["num_attention_heads"]),
        n_kv_head=int(c.get("num_key_value_heads") or c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], d_model=int(c["hidden_size"]),
        d_ff=int(c["intermediate_size"]), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), mlp_act=ACT_FROM_HF[act],
        rope=rope_from_hf(c, "full_attention"), sliding_window=window,
        layer_types=types if window else None, **token_ids_from_hf(c))
    fields.update(diff)
    return cls(**fields)


def decoder_to_hf(cfg: Any, model_type: str, architecture: str, act_key: str = "hidden_act", **extra: Any):
    """A config.json in the transformers 4.x layout (``rope_theta``/``rope_scaling``), which 5.x also reads,
    plus ``layer_types``."""
    c = {"architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layer,
         "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.hd,
         "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, act_key: ACT_TO_HF[cfg.mlp_act],
         "tie_word_embeddings": cfg.tie_embeddings, "rope_theta": cfg.rope.theta, "rope_scaling": rope_to_hf(cfg.rope),
         "sliding_window": cfg.sliding_window, "layer_types": layer_types_to_hf(cfg.types),
         "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id, "use_cache": True}
    c.update(extra)
    return c
