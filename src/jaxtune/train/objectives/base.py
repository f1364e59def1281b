"""What an objective is: a function of the model (`jaxtune.train.state.Forward`), its weights and a batch.

It returns ``(summed loss, count, metrics)``: the loss summed over its units (tokens for cross-entropy,
sequence pairs for a preference loss), how many units counted, and extra scalars as sums over the same units. The
step divides all of them by the count accumulated over the whole batch (micro-batches included), so a logged
metric is a mean per unit, at train and eval alike; the loop logs every metric an objective returns.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jaxtune.train.state import Batch, Forward

Metrics = dict[str, jax.Array]


class Objective(Protocol):
    name: str
    metric_names: tuple[str, ...]  # the keys of the metrics it returns (logged as they are)

    def __call__(self, forward: Forward, weights: Any, batch: Batch,
                 key: jax.Array | None) -> tuple[jax.Array, jax.Array, Metrics]: ...
