"""From the run's `ModelConfig` section to a family's own config and module, and its parameter layout."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxtune.config import ConfigError, ModelConfig
from jaxtune.models import gemma3, gpt2, llama, mistral, qwen
from jaxtune.models.family import Family
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
    overrides = {k: v for k, v in given.items() if k in fields}
    if "vocab_size" not in overrides and vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        return fam.presets[cfg.preset](**overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
    return base.replace(**updates)


def build_model(cfg: Any, seed: int) -> nnx.Module:
    return FAMILIES[cfg.family].module_cls(cfg, rngs=nnx.Rngs(params=seed))


def model_layout(cfg: Any, mesh: Mesh | None, seed: int = 0) -> tuple[nnx.GraphDef, Any, Any]:
    """(graphdef, abstract params (pure dict of ShapeDtypeStructs), NamedShardings on ``mesh`` or None),
    without allocating anything."""
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, seed))
    graphdef, param_state = nnx.split(abstract_model, nnx.Param)
    abstract = nnx.to_pure_dict(param_state)
    if mesh is None:
        return graphdef, abstract, None
    logical = nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["logical_axes"]), param_state,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable)))
    axes = sharding.param_axes(abstract, logical)
    return graphdef, abstract, sharding.param_shardings(mesh, abstract, axes)
