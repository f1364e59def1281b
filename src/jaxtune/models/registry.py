"""From the run's `ModelConfig` section to a family's own config and module."""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxtune.config import ConfigError, ModelConfig
from jaxtune.models.gpt2 import GPT, PRESETS, GPTConfig

FAMILIES = {"gpt2": (GPTConfig, GPT, PRESETS)}


def model_config(cfg: ModelConfig, vocab_size: int | None = None) -> GPTConfig:
    """The family preset named by ``model.preset`` with every key set in the section applied on top.

    ``vocab_size`` (the tokenizer's) is used when ``model.vocab_size`` is not set.
    """
    family_cfg, _, presets = FAMILIES[cfg.family]
    if cfg.preset not in presets:
        raise ConfigError(f"model.preset={cfg.preset!r} is not a {cfg.family} preset; choose one of {sorted(presets)}")
    fields = {f.name for f in dataclasses.fields(family_cfg)}
    overrides = {k: v for k, v in cfg.model_dump().items() if k in fields and v is not None}
    if "vocab_size" not in overrides and vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    try:
        return presets[cfg.preset](**overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_model(cfg: GPTConfig, seed: int) -> GPT:
    _, module, _ = next(v for v in FAMILIES.values() if isinstance(cfg, v[0]))
    return module(cfg, rngs=nnx.Rngs(params=seed))
