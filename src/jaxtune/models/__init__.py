"""Native model families. Each family file holds one family's math; `registry.FAMILIES` names them;
`resolve.model_config` picks one from the run's ``model`` section; `hf` moves weights in and out of HuggingFace
checkpoint directories."""

from jaxtune.models.hf import from_hf
from jaxtune.models.registry import FAMILIES, build_model
from jaxtune.models.resolve import model_config

__all__ = ["FAMILIES", "build_model", "from_hf", "model_config"]
