"""Next-token cross-entropy over counted tokens: pretraining (every token) and SFT (``loss_mask``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives.base import Metrics, Reference, Unprepared
from jaxtune.train.state import Batch, Forward


@dataclass(frozen=True)
class CrossEntropy(Unprepared):
    """-sum(loss_mask * log p(targets)) over the batch, counted in tokens with loss (all of them without a
    ``loss_mask``)."""

    name: str = "cross_entropy"
    metric_names: tuple[str, ...] = ()
    passes: int = 1
    prepares: bool = False

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> CrossEntropy:
        return cls()

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        targets = batch["targets"]
        mask = batch.get("loss_mask", jnp.ones(targets.shape, jnp.float32))
        logps = forward.token_logps(weights, batch, key)
        return jnp.sum(-logps * mask), jnp.sum(mask), {}
