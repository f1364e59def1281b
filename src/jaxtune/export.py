"""``jaxtune export``: a trained run (or a native model) written as a HuggingFace model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from jaxtune.backends import BACKENDS
from jaxtune.config import ConfigError
from jaxtune.evaluate import load_run
from jaxtune.io import check_out_dir
from jaxtune.models.hf import write_model


def export(source: Any, out_dir: str | Path, *, tokenizer: Any = None, dtype: str | None = None,
           max_shard_bytes: int = 5_000_000_000, overwrite: bool = False, adapter: bool = False) -> Path:
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
    """
    out = Path(out_dir).expanduser()
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
