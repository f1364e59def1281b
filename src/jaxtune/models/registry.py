"""From the run's `ModelConfig` section to a family's own config and module, and its parameter layout."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtune.config import LORA_TARGETS, ConfigError, ModelConfig
from jaxtune.models import gemma3, gpt2, llama, mistral, qwen
from jaxtune.models.family import Family
from jaxtune.models.layers import LoRAParam, LoraSpec
from jaxtune.train import sharding

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen.QWEN2, qwen.QWEN3, mistral.FAMILY,
                                                   gemma3.FAMILY)}
# Keys that define a checkpoint's shapes: with model.from_hf they come from its config.json.
STRUCTURAL = ("n_layer", "n_head", "n_kv_head", "head_dim", "d_model", "d_ff", "vocab_size")
RUNTIME = ("param_dtype", "compute_dtype", "remat", "scan_layers", "attention", "dropout", "max_seq_len")


def model_config(cfg: ModelConfig, vocab_size: int | None = None) -> Any:
    """The family config for ``cfg``: the checkpoint's (``model.from_hf``) or the preset ``model.preset``, with
    every key set in the section applied on top. ``vocab_size`` (the tokenizer's) is used when
    ``model.vocab_size`` is not set."""
    if cfg.from_hf:
        return _from_checkpoint(cfg, vocab_size)
    fam = FAMILIES[cfg.family or "gpt2"]
    if cfg.preset not in fam.presets:
        raise ConfigError(f"model.preset={cfg.preset!r} is not a {fam.name} preset; choose one of {sorted(fam.presets)}")
    fields = {f.name for f in dataclasses.fields(fam.config_cls)}
    given = {k: v for k, v in cfg.model_dump().items() if v is not None and k not in ("family", "preset", "from_hf")}
    foreign = sorted(k for k in given if k not in fields and k in STRUCTURAL)
    if foreign:
        raise ConfigError(f"model.{foreign[0]} does not apply to the {fam.name} family")
    overrides = {k: v for k, v in given.items() if k in fields and k != "lora"}
    if "vocab_size" not in overrides and vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        return _with_lora(fam.presets[cfg.preset](**overrides), cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _with_lora(model_cfg: Any, cfg: ModelConfig) -> Any:
    if not cfg.lora.rank:
        return model_cfg
    if "lora" not in {f.name for f in dataclasses.fields(model_cfg)}:
        raise ConfigError(f"model.lora: LoRA is implemented for the decoder families (llama, qwen2, qwen3, mistral, "
                          f"gemma3), not {model_cfg.family}; set model.lora.rank=0 for full fine-tuning")
    foreign = [t for t in cfg.lora.targets if t not in LORA_TARGETS]
    if foreign:
        raise ConfigError(f"model.lora.targets: {foreign[0]!r} is not a projection of the native models; choose from "
                          f"{list(LORA_TARGETS)} (HF module names of other architectures need model.backend=torchax)")
    spec = LoraSpec(cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, tuple(cfg.lora.targets))
    return model_cfg.replace(lora=spec)


def _from_checkpoint(cfg: ModelConfig, vocab_size: int | None) -> Any:
    from jaxtune.models.hf import CheckpointError, read_hf_config

    try:
        fam, base, _ = read_hf_config(cfg.from_hf)
    except (CheckpointError, ValueError) as e:
        raise ConfigError(f"model.from_hf={cfg.from_hf}: {e}") from None
    if cfg.family is not None and cfg.family != fam.name:
        raise ConfigError(f"model.family={cfg.family} but model.from_hf={cfg.from_hf} holds a {fam.name} model; "
                          "drop model.family (the checkpoint decides)")
    fixed = [k for k in STRUCTURAL if getattr(cfg, k) is not None]
    if fixed:
        raise ConfigError(f"model.{fixed[0]} cannot be set with model.from_hf: the checkpoint's config.json "
                          "decides the shapes")
    if vocab_size is not None and vocab_size > base.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} ids but the model.from_hf checkpoint only "
                          f"{base.vocab_size}; use the checkpoint's tokenizer")
    updates = {k: getattr(cfg, k) for k in RUNTIME if getattr(cfg, k) is not None}
    if updates.get("max_seq_len", 0) > base.max_seq_len:
        raise ConfigError(f"model.max_seq_len={updates['max_seq_len']} exceeds the checkpoint's "
                          f"{base.max_seq_len}")
    return _with_lora(base.replace(**updates), cfg)


def build_model(cfg: Any, seed: int) -> nnx.Module:
    return FAMILIES[cfg.family].module_cls(cfg, rngs=nnx.Rngs(params=seed))


def param_groups(cfg: Any) -> tuple:
    """How a model's parameters split: (trainable, frozen) filters with LoRA, else all of them train."""
    return (LoRAParam, nnx.Param) if getattr(cfg, "lora", None) else (nnx.Param,)


def model_layout(cfg: Any, mesh: Mesh | None, seed: int = 0) -> tuple[nnx.GraphDef, list[Any], list[Any] | None]:
    """(graphdef, abstract params, NamedShardings on ``mesh`` or None) without allocating anything. The params are
    a list with one pure dict of ShapeDtypeStructs per `param_groups` entry: [params], or [adapters, frozen base]
    with LoRA; ``nnx.merge(graphdef, *groups)`` rebuilds the model."""
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, seed))
    graphdef, *states = nnx.split(abstract_model, *param_groups(cfg))
    abstract = [nnx.to_pure_dict(s) for s in states]
    if mesh is None:
        return graphdef, abstract, None
    shardings = []
    for state, tree in zip(states, abstract):
        logical = nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), state,
                                                is_leaf=lambda v: isinstance(v, nnx.Variable)))
        shardings.append(sharding.param_shardings(mesh, tree, sharding.param_axes(tree, logical)))
    return graphdef, abstract, shardings


def init_params(cfg: Any, seed: int) -> list[Any]:
    """The family's initial params, split as `model_layout` splits them (call under jit to place them)."""
    _, *states = nnx.split(build_model(cfg, seed), *param_groups(cfg))
    return [nnx.to_pure_dict(s) for s in states]


def merge(graphdef: nnx.GraphDef, weights: Any) -> nnx.Module:
    """The model from its graph and weights: one params dict, or a tuple (adapters, frozen base) with LoRA."""
    return nnx.merge(graphdef, *weights) if isinstance(weights, (tuple, list)) else nnx.merge(graphdef, weights)
