"""Backends by name (``model.backend``): one registry, the only place that picks one.

``native``: jaxtune's Flax models of the families it implements. ``torchax``: any HuggingFace PyTorch causal LM run
through JAX. See `base.Backend` for what a backend provides and how to add one.
"""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jaxtune.backends import native, torchax
from jaxtune.backends.base import Backend, ParityModel
from jaxtune.config import Config
from jaxtune.train.state import ModelSpec

BACKENDS: dict[str, Backend] = {b.name: b for b in (native.BACKEND, torchax.BACKEND)}


def backend_of(cfg: Config) -> Backend:
    """The run's backend, its cross-section rules checked."""
    backend = BACKENDS[cfg.model.backend]
    backend.check_config(cfg)
    return backend


def make_state_spec(cfg: Config, vocab_size: int | None, mesh: Mesh) -> ModelSpec:
    """The run's model, optimizer and layout on ``mesh`` (nothing allocated yet)."""
    return backend_of(cfg).build(cfg, vocab_size, mesh)


def backend_for_checkpoint(config_json: dict[str, Any]) -> str:
    """The first backend (native before torchax) that runs a HuggingFace checkpoint with this config.json."""
    return next(name for name, b in BACKENDS.items() if b.runs(config_json))


__all__ = ["BACKENDS", "Backend", "ParityModel", "backend_for_checkpoint", "backend_of", "make_state_spec"]
