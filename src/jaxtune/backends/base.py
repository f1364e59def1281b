"""What a backend is. A backend turns the run's ``model`` section into a `jaxtune.train.state.ModelSpec` (the model,
its optimizer and layout on the mesh, its forward and sampler), writes a trained run back out as a HuggingFace
model, and runs a checkpoint for `jaxtune parity`. Everything else (data, step, loop, checkpoints, evaluation) is
shared.

Adding a backend: a folder here whose module-level ``BACKEND`` meets `Backend`, one entry in
`jaxtune.backends.BACKENDS`, and its ``model`` section class in `jaxtune.config.MODEL_SECTIONS`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from jax.sharding import Mesh

from jaxtune.config import Config
from jaxtune.train.state import ModelSpec


class ParityModel(NamedTuple):
    """A checkpoint loaded by a backend, for comparison with transformers: ``logits(tokens (B, T)) -> (B, T, V)``
    and ``greedy(prompts, n) -> new ids per prompt``."""

    logits: Callable[[Any], Any]
    greedy: Callable[[list[list[int]], int], list[list[int]]]


class Backend(Protocol):
    name: str
    # whether its programs may be traced on worker threads while the main thread traces others (compiled ahead,
    # `jaxtune.train.ahead`): Flax NNX keeps its tracing state per thread, torchax keeps one environment per process
    traces_in_threads: bool

    def check_config(self, cfg: Config) -> None:
        """Rules that tie this backend's model section to other sections (the mesh, ...): `ConfigError`."""
        ...

    def build(self, cfg: Config, vocab_size: int | None, mesh: Mesh) -> ModelSpec:
        """The spec for ``cfg``; ``vocab_size`` is the tokenizer's (checked against the model's)."""
        ...

    def runs(self, config_json: dict[str, Any]) -> bool:
        """Whether this backend can run a HuggingFace checkpoint with this config.json."""
        ...

    def export(self, run: Any, out: Path, *, tokenizer: Any, dtype: str | None, adapter: bool,
               max_shard_bytes: int, overwrite: bool, end_of_turn: tuple[int, ...] = ()) -> Path:
        """Write a loaded run (`jaxtune.run.LoadedRun`) as a HuggingFace model directory (or, ``adapter``, a
        PEFT adapter directory) at ``out``; ``end_of_turn``: the chat template's end-of-turn ids, which the written
        model stops at besides its EOS (`jaxtune.models.hf.write_stop_tokens`)."""
        ...

    def parity_model(self, directory: Path) -> ParityModel:
        """The checkpoint in ``directory`` as this backend runs it, in float32."""
        ...
