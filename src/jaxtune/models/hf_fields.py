"""config.json fields several families share, translated both ways: RoPE (transformers 5.x ``rope_parameters``,
possibly per layer type, or 4.x ``rope_theta`` + ``rope_scaling``), per-layer full/sliding attention, the token ids
and the stored dtype. A value jaxtune does not implement natively is an `UnsupportedModelError`."""

from __future__ import annotations

from typing import Any

from jaxtune.models.layers import Rope
from jaxtune.models.unsupported import TORCHAX_HINT, UnsupportedModelError


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
            raise UnsupportedModelError(
                f"config.json: layer_types {unknown} are not supported natively; {TORCHAX_HINT}")
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


def is_classifier(c: dict[str, Any]) -> bool:
    """Whether a config.json is a *ForSequenceClassification model's (a score head, no language-model head)."""
    return any(str(a).endswith("ForSequenceClassification") for a in c.get("architectures") or ())


def sequence_labels(c: dict[str, Any]) -> int:
    """0 for a causal LM's config.json; 1 for a *ForSequenceClassification one with one label (a reward model's
    score head); other label counts are refused (one line naming the key)."""
    if not is_classifier(c):
        return 0
    labels = int(c.get("num_labels") or len(c.get("id2label") or {}) or 2)
    if labels != 1:
        raise UnsupportedModelError(f"config.json: a sequence classifier with num_labels={labels}; jaxtune reads "
                                    "reward models, whose score head has one label (num_labels: 1)")
    return 1


def classifier_to_hf(c: dict[str, Any], lm_architecture: str) -> dict[str, Any]:
    """A reward model's config.json from its family's causal-LM one (architecture ``lm_architecture``): transformers'
    sequence classifier with one label."""
    return {**c, "architectures": [lm_architecture.replace("ForCausalLM", "ForSequenceClassification")
                                   .replace("LMHeadModel", "ForSequenceClassification")],
            "num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
