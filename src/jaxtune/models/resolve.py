"""From the run's ``model`` section (`jaxtune.config.NativeModelConfig`) to a native family's config: a preset, or a
HuggingFace checkpoint's config.json, with the keys the section sets applied on top."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxtune.config import LORA_TARGETS, STRUCTURAL, ConfigError, HubError, NativeModelConfig
from jaxtune.io import CheckpointError
from jaxtune.models.fits import check_fits
from jaxtune.models.hf import read_hf_config
from jaxtune.models.layers import LoraSpec
from jaxtune.models.registry import FAMILIES

# Keys of the model section that still apply with model.from_hf (the checkpoint's config.json decides `STRUCTURAL`).
RUNTIME = ("param_dtype", "compute_dtype", "remat", "scan_layers", "attention", "formulation", "dropout",
           "max_seq_len")


def model_config(cfg: NativeModelConfig, vocab_size: int | None = None) -> Any:
    """The family config for ``cfg``: the checkpoint's (``model.from_hf``) or the preset ``model.preset``, with
    every key set in the section applied on top. ``vocab_size`` (the tokenizer's) is used when
    ``model.vocab_size`` is not set."""
    if cfg.from_hf:
        return _from_checkpoint(cfg, vocab_size)
    fam = FAMILIES[cfg.family or "gpt2"]
    if cfg.preset not in fam.presets:
        raise ConfigError(f"model.preset={cfg.preset!r} is not a {fam.name} preset; "
                          f"choose one of {sorted(fam.presets)}")
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


def _with_lora(model_cfg: Any, cfg: NativeModelConfig) -> Any:
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


def _from_checkpoint(cfg: NativeModelConfig, vocab_size: int | None) -> Any:
    try:
        fam, base, _ = read_hf_config(cfg.from_hf)
    except ConfigError:  # it names model.from_hf already
        raise
    except (CheckpointError, ValueError) as e:  # the directory said once: the error may begin with it
        why = str(e).removeprefix(f"{cfg.from_hf}: ").removeprefix(f"{Path(cfg.from_hf)}: ")
        raise ConfigError(f"model.from_hf={cfg.from_hf}: {why}") from None
    if cfg.family is not None and cfg.family != fam.name:
        raise ConfigError(f"model.family={cfg.family} but model.from_hf={cfg.from_hf} holds a {fam.name} model; "
                          "drop model.family (the checkpoint decides)")
    fixed = [k for k in STRUCTURAL if getattr(cfg, k) is not None]
    if fixed:
        raise ConfigError(f"model.{fixed[0]} cannot be set with model.from_hf: the checkpoint's config.json "
                          "decides the shapes")
    updates = {k: getattr(cfg, k) for k in RUNTIME if getattr(cfg, k) is not None}
    check_fits(base.vocab_size, base.max_seq_len, tokenizer_vocab=vocab_size, max_seq_len=updates.get("max_seq_len"),
               what="the model.from_hf checkpoint")
    return _with_lora(base.replace(**updates), cfg)


# The hub checkpoints of the shipped recipes, and the family preset with their shapes: `planned_section` plans from it
# when the checkpoint's config.json cannot be read (offline).
HUB_PRESETS = {"google/gemma-3-270m-it": ("gemma3", "gemma3-270m"), "google/gemma-3-1b-it": ("gemma3", "gemma3-1b"),
               "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", "qwen2.5-0.5b"),
               "meta-llama/Llama-3.2-1B-Instruct": ("llama", "llama3.2-1b"),
               "meta-llama/Meta-Llama-3-8B": ("llama", "llama3.1-8b"),
               "Qwen/Qwen3-30B-A3B": ("qwen3_moe", "qwen3-30b-a3b")}


def planned_section(cfg: Any) -> tuple[Any, str | None]:
    """The model section (of any backend) to plan a run's size with (`jaxtune.info`), and a note when it is not
    ``cfg``: when the config.json of a native ``model.from_hf`` hub checkpoint cannot be read (offline, gated) and
    `HUB_PRESETS` names its preset, the section with that preset. Any other failure is `model_config`'s error."""
    if not isinstance(cfg, NativeModelConfig) or cfg.from_hf not in HUB_PRESETS:
        return cfg, None
    try:
        read_hf_config(cfg.from_hf)
        return cfg, None
    except (ConfigError, CheckpointError) as e:
        reason = e.reason if isinstance(e, HubError) else str(e)
    family, preset = HUB_PRESETS[cfg.from_hf]
    note = (f"model.from_hf={cfg.from_hf}: config.json cannot be read: {reason}; planned from the {family} preset "
            f"{preset}, which has the same shapes")
    return cfg.model_copy(update={"from_hf": None, "family": family, "preset": preset}), note
