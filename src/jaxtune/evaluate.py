"""Load a trained run and evaluate it: validation loss/perplexity, and the model for generation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, ConfigError, load_config
from jaxtune.data import Tokenizer, load_tokenizer, load_tokenizer_dir, make_eval_batches, prepare_tokens
from jaxtune.train import sharding
from jaxtune.train.checkpoint import Checkpointer
from jaxtune.train.state import StateSpec, make_state_spec
from jaxtune.train.step import make_eval_step


@dataclass
class LoadedRun:
    cfg: Config
    tokenizer: Tokenizer
    spec: StateSpec
    params: Any
    step: int  # 0: no checkpoint, the freshly initialised model


def load_run(target: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> LoadedRun:
    """A run directory (with config.yaml) or a config file -> its latest checkpoint's params on a mesh.

    A config whose run has no checkpoint yet gives the initial model (step 0), useful as a baseline.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path} is not a run directory (no config.yaml); pass a run directory or a config")
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
    return LoadedRun(cfg, tokenizer, spec, state.params, step)


def evaluate(target: str | Path, overrides: list[str] | tuple[str, ...] = (), batches: int | None = None) -> dict[str, float]:
    """Validation loss and perplexity of a run's latest checkpoint on its data's validation split."""
    run = load_run(target, overrides)
    cfg = run.cfg
    data = prepare_tokens(cfg.data, run.tokenizer)
    if not data.val_windows:
        raise ConfigError("data.val_fraction is 0: there is no validation split to evaluate on")
    mesh = run.spec.mesh
    eval_batches = make_eval_batches(data, batch_size=cfg.train.batch_size, num_batches=batches or cfg.eval.batches,
                                     process_index=jax.process_index(), process_count=jax.process_count())
    step = jax.jit(make_eval_step(run.spec.graphdef), in_shardings=(run.spec.shardings.params,
                                                                     sharding.batch_sharding(mesh)))
    total = count = 0.0
    with sharding.use_mesh(mesh):
        for b in eval_batches:
            s, n = jax.device_get(step(run.params, sharding.global_batch(mesh, b)))
            total, count = total + float(s), count + float(n)
    loss = total / max(count, 1.0)
    return {"step": run.step, "loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": count}
