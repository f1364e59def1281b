"""``jaxtune export``: a trained run (or a native model) written as a HuggingFace model directory, or as one
llama.cpp GGUF file."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxtune.backends import BACKENDS
from jaxtune.config import GGUF_TYPES, ConfigError
from jaxtune.data import end_of_turn_ids
from jaxtune.io import check_out_dir, writable_dir
from jaxtune.models.gguf_export import check_out_file, write_gguf
from jaxtune.models.hf import write_model
from jaxtune.run import LoadedRun, load_run


@dataclass(frozen=True)
class ExportFormat:
    """One thing ``jaxtune export`` writes: ``write(source, out, options)`` -> the path written. ``flag``: the CLI
    flag that picks it (none: the default)."""

    name: str
    flag: str | None
    description: str
    write: Callable[[Any, Path, ExportOptions], Path]


@dataclass(frozen=True)
class ExportOptions:
    tokenizer: Any = None
    dtype: str | None = None
    max_shard_bytes: int = 5_000_000_000
    overwrite: bool = False
    gguf_type: str = "f16"


def export(source: Any, out_dir: str | Path, *, tokenizer: Any = None, dtype: str | None = None,
           max_shard_bytes: int = 5_000_000_000, overwrite: bool = False, adapter: bool = False,
           gguf: str | None = None) -> Path:
    """Write a HuggingFace model directory that `transformers.AutoModelForCausalLM.from_pretrained` loads:
    config.json, generation_config.json, safetensors (sharded with an index past ``max_shard_bytes``) and the
    tokenizer files.

    ``source``: a run directory (its latest checkpoint and tokenizer; its backend writes it) or a native model
    (``tokenizer`` then optional). ``dtype``: float32/bfloat16/float16; default the params' dtype. The directory is
    written beside ``out_dir`` and renamed into place, so a failed export leaves nothing half-written; an existing
    ``out_dir`` is replaced only with ``overwrite``, and only when it holds nothing but an earlier export's files
    (`jaxtune.io.EXPORT_FILES`; anything else is a `FileExistsError` naming it, and the directory is untouched).

    A LoRA run exports merged (``W + scale A B``: an ordinary checkpoint), or with ``adapter`` as a PEFT adapter
    directory for ``peft.PeftModel.from_pretrained(base, out_dir)``. A run fine-tuned on chat data stops where
    `jaxtune generate` stops it, at its chat template's end of turn as well as the EOS
    (`jaxtune.models.hf.write_stop_tokens`, and the GGUF's end-of-turn id); other sources keep their EOS.

    ``gguf`` (`jaxtune.config.GGUF_TYPES`: f16, bf16, q8_0, f32): ``out_dir`` is instead one ``*.gguf`` file for
    llama.cpp and Ollama (`jaxtune.models.gguf_export`), converted from the HuggingFace directory this writes in
    float32 to a temporary directory beside it (so a LoRA run is merged first); an existing file is replaced only with
    ``overwrite``. Each of the three is an `ExportFormat` in `EXPORT_FORMATS`.
    """
    if gguf is not None and (adapter or dtype is not None):
        raise ConfigError(f"--gguf writes the whole model as --gguf-type {gguf}; drop "
                          f"{'--adapter' if adapter else '--dtype'}")
    name = "gguf" if gguf is not None else "peft" if adapter else "hf"
    options = ExportOptions(tokenizer, dtype, max_shard_bytes, overwrite, gguf or "f16")
    return EXPORT_FORMATS[name].write(source, Path(out_dir).expanduser(), options)


def _write_gguf(source: Any, out: Path, o: ExportOptions) -> Path:
    if o.gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {o.gguf_type}: supported: {', '.join(GGUF_TYPES)}")
    check_out_file(out, o.overwrite)
    writable_dir(out.parent, "export to ", out)
    model = _loaded(source)
    _not_a_reward_model(model, "--gguf")
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.hf-") as tmp:
        hf_dir = _write_loaded(model, Path(tmp) / "model", ExportOptions(o.tokenizer, "float32", o.max_shard_bytes))
        if jax.process_index() != 0:
            return out
        return write_gguf(hf_dir, out, o.gguf_type, end_of_turn=_end_of_turn(model, o.tokenizer))


def _write_peft(source: Any, out: Path, o: ExportOptions) -> Path:
    return _write_hf(source, out, o, adapter=True)


def _not_a_reward_model(model: LoadedRun | nnx.Module, what: str) -> None:
    """A reward model (a score head) exports as transformers' sequence classifier or a PEFT adapter, no GGUF."""
    if isinstance(model, LoadedRun) and model.cfg.objective.spec.head == "score":
        raise ConfigError(f"{what} of a reward model (objective.name={model.cfg.objective.name}) is not written yet; "
                          "export it without it: a transformers sequence classifier (its LoRA merged), or --adapter")


def _write_hf(source: Any, out: Path, o: ExportOptions, adapter: bool = False) -> Path:
    if out.suffix.lower() == ".gguf":
        raise ConfigError(f"{out}: a .gguf name for a HuggingFace directory; pass --gguf to write a GGUF file")
    check_out_dir(out, o.overwrite)
    writable_dir(out.parent, "export to ", out)
    return _write_loaded(_loaded(source), out, o, adapter)


def _loaded(source: Any) -> LoadedRun | nnx.Module:
    """A run directory, model directory or config loaded (a run with no checkpoint yet refused); a native model as
    it is."""
    if not isinstance(source, (str, Path)):
        return source
    run = load_run(source)
    if run.step == 0 and _is_run(source):
        raise ConfigError(f"{source}: the run has no checkpoint yet (it stopped or failed before its first save), "
                          "so there is nothing trained to export; train it (or resume it) until it saves, "
                          "e.g. checkpoint.every, then export")
    return run


def _write_loaded(model: LoadedRun | nnx.Module, out: Path, o: ExportOptions, adapter: bool = False) -> Path:
    """A loaded run as its backend writes it, or a native model, as a HuggingFace (or PEFT adapter) directory."""
    if isinstance(model, LoadedRun):
        return BACKENDS[model.cfg.model.backend].export(
            model, out, tokenizer=o.tokenizer or model.tokenizer, dtype=o.dtype, adapter=adapter,
            max_shard_bytes=o.max_shard_bytes, overwrite=o.overwrite, end_of_turn=_end_of_turn(model, o.tokenizer))
    if adapter:
        raise ConfigError("--adapter: only a LoRA run (model.lora.rank > 0) has an adapter; export the full model")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return write_model(model.cfg, params, out, tokenizer=o.tokenizer, dtype=o.dtype,
                       max_shard_bytes=o.max_shard_bytes)


def _end_of_turn(model: LoadedRun | nnx.Module, tokenizer: Any) -> tuple[int, ...]:
    """The ids a run fine-tuned on chat data ends its turns with (the chat template's, as `jaxtune generate` stops
    at them): the export stops there too. Empty for other runs and for a native model: they keep their EOS."""
    if not isinstance(model, LoadedRun) or not model.chat:
        return ()
    return tuple(end_of_turn_ids(tokenizer or model.tokenizer))


def _is_run(source: str | Path) -> bool:
    """A run directory or a config (trained weights come from its checkpoints), not a model directory or file."""
    path = Path(source).expanduser()
    return (path / "config.yaml").is_file() or path.suffix in (".yaml", ".yml")


EXPORT_FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("hf", None, "a HuggingFace model directory (a LoRA run merged)", _write_hf),
    ExportFormat("peft", "--adapter", "a PEFT adapter directory (LoRA runs)", _write_peft),
    ExportFormat("gguf", "--gguf", "one llama.cpp/Ollama GGUF file", _write_gguf),
)}
