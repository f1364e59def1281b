"""What a run leaves in its run directory, read back: the rows of metrics.jsonl, the train loss per step, and the
parameters (and data state) of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jaxtune.backends import make_state_spec
from jaxtune.data import load_tokenizer_dir
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.sharding import make_mesh


def metric_rows(run_dir: Path, kind: str) -> list[dict]:
    """The rows of ``kind`` ("train", "eval") in the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss from metrics.jsonl; a resumed run's later lines win."""
    return {row["step"]: row["step_loss"] for row in metric_rows(run_dir, "train")}


def final_params(cfg, step: int, vocab: int | None = None):
    """(params as numpy arrays, data state) of ``cfg``'s run (its tokenizer's ``vocab``, default the one saved in its
    run directory) restored from checkpoint ``step``, on one device."""
    vocab = vocab or load_tokenizer_dir(cfg.run_path / "tokenizer").vocab_size
    spec = make_state_spec(cfg, vocab, make_mesh(1, 1, 1, jax.devices()[:1]))
    ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
    got, state, data_state = ckpt.restore(step, spec.abstract)
    assert got == step, f"step {step} did not restore (step {got} did)"
    ckpt.close()
    return jax.tree.map(np.asarray, state.params), data_state
