"""``jaxtune export``: a trained run (or a native model) written as a HuggingFace model directory, or as one
llama.cpp GGUF file."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from jaxtune.backends import BACKENDS
from jaxtune.config import ConfigError
from jaxtune.evaluate import load_run
from jaxtune.io import check_out_dir
from jaxtune.models.gguf_export import TYPES as GGUF_TYPES
from jaxtune.models.gguf_export import check_out_file, write_gguf
from jaxtune.models.hf import write_model


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
    directory for ``peft.PeftModel.from_pretrained(base, out_dir)``.

    ``gguf`` (f32, f16, bf16, q8_0): ``out_dir`` is instead one ``*.gguf`` file for llama.cpp and Ollama
    (`jaxtune.models.gguf_export`), converted from the HuggingFace directory this writes in float32 to a temporary
    directory beside it (so a LoRA run is merged first); an existing file is replaced only with ``overwrite``.
    """
    out = Path(out_dir).expanduser()
    if gguf is not None:
        if gguf not in GGUF_TYPES:
            raise ConfigError(f"--gguf-type {gguf}: supported: {', '.join(GGUF_TYPES)}")
        if adapter or dtype is not None:
            raise ConfigError(f"--gguf writes the whole model as --gguf-type {gguf}; drop "
                              f"{'--adapter' if adapter else '--dtype'}")
        check_out_file(out, overwrite)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.hf-") as tmp:
            hf_dir = export(source, Path(tmp) / "model", tokenizer=tokenizer, dtype="float32")
            return write_gguf(hf_dir, out, gguf) if jax.process_index() == 0 else out
    if out.suffix.lower() == ".gguf":
        raise ConfigError(f"{out}: a .gguf name for a HuggingFace directory; pass --gguf to write a GGUF file")
    check_out_dir(out, overwrite)
    if isinstance(source, (str, Path)):
        run = load_run(source)
        return BACKENDS[run.cfg.model.backend].export(run, out, tokenizer=tokenizer or run.tokenizer, dtype=dtype,
                                                      adapter=adapter, max_shard_bytes=max_shard_bytes,
                                                      overwrite=overwrite)
    if adapter:
        raise ConfigError("--adapter: only a LoRA run (model.lora.rank > 0) has an adapter; export the full model")
    params = nnx.to_pure_dict(nnx.state(source, nnx.Param))
    return write_model(source.cfg, params, out, tokenizer=tokenizer, dtype=dtype, max_shard_bytes=max_shard_bytes)
