"""Model families. Each file holds one family's math; `build_model` picks one from a `ModelConfig`."""

from jaxtune.models.registry import build_model, model_config

__all__ = ["build_model", "model_config"]
