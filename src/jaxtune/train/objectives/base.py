"""What an objective is: a function of the model (`jaxtune.train.state.Forward`), its weights and a batch.

It returns ``(summed loss, count, metrics)``: the loss summed over its units (tokens for cross-entropy,
sequence pairs for a preference loss), how many units counted, and extra scalars as sums over the same units, or as
(sum, count) pairs when a metric has units of its own (GRPO's per-token KL beside a per-sequence loss). The step
divides each sum by its count accumulated over the whole batch (micro-batches included), so a logged metric is a mean
per unit, at train and eval alike; the loop logs every metric an objective returns.

An objective that trains several passes on one batch (``passes`` > 1: GRPO's ``num_iterations``) has its
``prepare(forward, weights, batch) -> batch`` called once before the first pass with the weights as they were (the
others return the batch as it is).

An objective that compares the policy with a frozen reference model (``uses_reference``: DPO's KL anchor, GRPO's
KL penalty) is handed a `Reference`: the reference's per-token log-probs of a batch of (N, T) rows. Which model that
is (LoRA's base with the adapters off, or a frozen copy) is the step's business (`jaxtune.train.reference`), not the
objective's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax

from jaxtune.config import ObjectiveConfig
from jaxtune.train.state import Batch, Forward

Metrics = dict[str, jax.Array | tuple[jax.Array, jax.Array]]  # a sum (over the loss's count), or (sum, its count)
# (N, T) rows[, temperature] -> (N, T) float32 log p(targets) of the reference model (of logits / temperature)
Reference = Callable[..., jax.Array]


class Objective(Protocol):
    name: str
    metric_names: tuple[str, ...]  # the keys of the metrics it returns (logged as they are)
    uses_reference: bool  # reads a reference model's log-probs (a `Reference`, or ``ref_logps`` in the batch)
    passes: int  # optimizer updates on each batch

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> Objective:
        """The objective with the ``objective`` section's keys."""
        ...

    def prepare(self, forward: Forward, weights: Any, batch: Batch) -> Batch:
        """Before the first of several passes: what the later passes need of the weights as they were."""
        ...

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]: ...
