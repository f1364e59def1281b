"""What a model family declares (`Family`): its config class and module, presets, and how it maps to HuggingFace
(config.json fields and tensor names, `Map`); and the fields every native family config has besides its shapes
(`RuntimeConfig`). `jaxtune.models.hf` does the reading and writing once for all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jaxtune.models.layers import REMAT_POLICIES


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
    attention: str = "auto"  # auto | xla | cudnn | splash
    formulation: int = 2  # 1: attention head-major, `layers.matmul` gradients; 2: the narrower operand transposed
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


@dataclass(frozen=True)
class Map:
    """One parameter's HuggingFace tensor. ``transpose``: HF stores (out, in) where jaxtune has (in, out).
    A jaxtune parameter with more dims than its HF tensor (GPT-2's (D, 3, N*H) q/k/v) is reshaped."""

    hf: str
    transpose: bool = False
    hf_ndim: int | None = None  # HF's rank when it differs: jaxtune's trailing dims are flattened into it
    experts: bool = False  # a leading expert axis (after the layers'), one HF tensor per expert (``{j}`` in ``hf``)


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
