"""Model families. Each file holds one family's math; `build_model` picks one from a `ModelConfig`;
`from_hf` / `export` move weights in and out of HuggingFace checkpoint directories."""

from jaxtune.models.hf import export, from_hf
from jaxtune.models.registry import FAMILIES, build_model, model_config

__all__ = ["FAMILIES", "build_model", "export", "from_hf", "model_config"]
