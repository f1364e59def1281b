"""Load a trained run and evaluate it: validation loss/perplexity, and the model for generation."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, ConfigError, DataConfig, load_config
from jaxtune.data import (
    Tokenizer,
    load_tokenizer,
    load_tokenizer_dir,
    make_sequence_batches,
    make_training_data,
    prepare_tokens,
)
from jaxtune.data.pipeline import TextWindows
from jaxtune.models import model_config
from jaxtune.train import sharding
from jaxtune.train.checkpoint import Checkpointer
from jaxtune.train.loop import check_context
from jaxtune.train.state import StateSpec, make_state_spec
from jaxtune.train.step import make_eval_step


@dataclass
class LoadedRun:
    cfg: Config
    tokenizer: Tokenizer
    spec: StateSpec
    params: Any  # the trained params (a LoRA run's adapters)
    frozen: tuple  # (frozen base,) for LoRA, else ()
    step: int  # 0: no checkpoint, the freshly initialised model

    @property
    def weights(self) -> Any:
        """What the model is merged from (`jaxtune.models.registry.merge`, `Generator`)."""
        return self.spec.weights(self.params, self.frozen)


def load_run(target: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRun:
    """A run directory (with config.yaml) or a config file -> its latest checkpoint's params on a mesh.

    A config whose run has no checkpoint yet gives the initial model (step 0), useful as a baseline.
    """
    path = Path(target).expanduser()
    if path.is_dir() and not (path / "config.yaml").is_file() and (path / "config.json").is_file():
        # An exported (or any HuggingFace) model directory: its weights, its tokenizer, default settings.
        native = _has_native_model(path) or any(o.startswith("model.backend=") for o in overrides)
        cfg = load_config(None, [f"model.from_hf={path}", f"run_dir={path}",
                                 *([] if native else ["model.backend=torchax"]), *overrides])
        if not any(o.startswith("data.seq_len=") for o in overrides):  # default: up to the model's context
            context = (model_config(cfg.model).max_seq_len if cfg.model.backend == "native"
                       else _hf_context(path))
            cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": min(cfg.data.seq_len,
                                                                                            context)})})
    elif path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path} is not a run directory (no config.yaml) nor a HuggingFace model (no "
                              "config.json); pass a run directory, a model directory or a config")
        cfg = load_config(path / "config.yaml", overrides)
        cfg = cfg.model_copy(update={"run_dir": str(path)})
    else:
        cfg = load_config(target, overrides)
    run_dir = cfg.run_path
    tok_dir = run_dir / "tokenizer"
    tokenizer = load_tokenizer_dir(tok_dir) if tok_dir.is_dir() else load_tokenizer(cfg.tokenizer, cfg.data)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    spec = make_state_spec(cfg, tokenizer.vocab_size, mesh)
    ckpt_dir = run_dir / "checkpoints"
    step = 0
    if ckpt_dir.is_dir():
        ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
        step = ckpt.latest_step() or 0
        if step:
            state, _ = ckpt.restore(step, spec.abstract)
        ckpt.close()
    if not step:
        state = spec.init(cfg.train.seed)
    return LoadedRun(cfg, tokenizer, spec, state.params, spec.load_frozen(cfg.train.seed), step)


def _has_native_model(directory: Path) -> bool:
    """Whether jaxtune has a native model for this HF directory's model_type (else it runs through torchax)."""
    from jaxtune.models.family import UnsupportedModelError
    from jaxtune.models.hf import family_of

    try:
        family_of(json.loads((directory / "config.json").read_text()))
    except UnsupportedModelError:
        return False
    return True


def _hf_context(directory: Path) -> int:
    raw = json.loads((directory / "config.json").read_text())
    return int(raw.get("max_position_embeddings") or raw.get("n_positions") or 2048)


def evaluate(target: str | Path, overrides: list[str] | tuple[str, ...] = (), batches: int | None = None,
             data: str | None = None) -> dict[str, Any]:
    """Held-out loss and perplexity of a run's latest checkpoint (or a HuggingFace model directory).

    Without ``data``: the run's own held-out split (``eval.batches`` batches). With ``data`` (a file, glob or
    ``hf:`` dataset in the run's ``data.format``): every sequence of it, loss on the tokens the run trains on
    (the assistant's, for chat data)."""
    run = load_run(target, overrides)
    cfg, tok = run.cfg, run.tokenizer
    check_context(cfg, run.spec.model_cfg)
    split = dict(process_index=jax.process_index(), process_count=jax.process_count())
    size = cfg.train.batch_size
    extra: dict[str, Any] = {}
    if data is None:
        held_out = make_training_data(cfg.data, tok, batch_size=size, seed=cfg.train.seed,
                                      eval_batches=batches or cfg.eval.batches, **split)
        eval_batches = held_out.eval_batches
        if not eval_batches:
            raise ConfigError("data.val_fraction is 0 (and no data.val_sources): there is nothing held out to "
                              "evaluate on; pass a test file (jaxtune eval RUN --data FILE)")
    else:
        source, extra = _test_sequences(cfg.data, tok, data)
        eval_batches = make_sequence_batches(source, batch_size=size, num_batches=batches or len(source), **split)
    mesh, spec = run.spec.mesh, run.spec
    step = jax.jit(make_eval_step(spec.loss_fn(cfg.train.loss_chunk)),
                   in_shardings=(spec.shardings.params, sharding.batch_sharding(mesh), spec.frozen_shardings))
    total = count = 0.0
    with sharding.use_mesh(mesh):
        for b in eval_batches:
            s, n = jax.device_get(step(run.params, sharding.global_batch(mesh, b), run.frozen))
            total, count = total + float(s), count + float(n)
    loss = total / max(count, 1.0)
    return {"step": run.step, "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count, **extra}


def _test_sequences(data_cfg: DataConfig, tok: Tokenizer, data: str) -> tuple[Any, dict[str, Any]]:
    """Every sequence of the test data ``data`` (in ``data_cfg``'s format), and what was read."""
    test_cfg = data_cfg.model_copy(update={"sources": [data], "val_sources": [], "val_fraction": 0.0})
    if data_cfg.format == "text":
        tokens = prepare_tokens(test_cfg, tok)
        return TextWindows(tokens, "train"), {"sequences": tokens.train_windows}
    from jaxtune.data.sft import SFTStats, load_examples, resolve_chat_template, sequences

    resolve_chat_template(test_cfg, tok)
    stats = SFTStats()
    rows = load_examples(test_cfg.sources, test_cfg, tok, stats)
    if not rows:
        raise ConfigError(f"--data {data}: no usable rows ({stats.rows} read, dropped {dict(stats.dropped)})")
    return sequences(rows, test_cfg), {"rows": stats.rows, "examples": len(rows), "dropped": dict(stats.dropped)}
