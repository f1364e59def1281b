"""What an objective is: a function of the model (`jaxtune.train.state.Forward`), its weights and a batch.

It returns ``(summed loss, count, metrics)``: the loss summed over its units (tokens for cross-entropy,
sequence pairs for a preference loss), how many units counted, and extra scalars as sums over the same units, or as
(sum, count) pairs when a metric has units of its own (GRPO's per-token KL beside a per-sequence loss). The step
divides each sum by its count accumulated over the whole batch (micro-batches included), so a logged metric is a mean
per unit, at train and eval alike; the loop logs every metric an objective returns. A metric with units of its own
may count none in a batch (KTO's undesirable rows in a batch of desirable ones): its mean is then NaN, the step
reports its count beside it (`count_key`), and what is logged leaves it out, never 0 (`present`); a logging window
or an evaluation averages it over the units it had, weighted by their counts. ``rewards/margins``, where an objective
gives the chosen and rejected rewards over rows of their own but no margin, is their difference (`with_margins`),
logged only where both are. A metric named ``.../max`` or ``.../min`` is an extreme instead (`EXTREMES`): the
largest (smallest) value over the batch, combined across micro-batches by max (min) and never divided.

An objective that trains several passes on one batch (``passes`` > 1: GRPO's ``num_iterations``), or that says it
``prepares`` (RLOO: its advantages need the whole batch and the reference), has its ``prepare(forward, weights,
batch, reference) -> batch`` called once on the whole batch before the first pass (before micro-batches split it),
with the weights as they were (the others return the batch as it is).

An objective may carry scalars from one optimizer update to the next (adaptive entropy control's coefficient): it
declares ``init_carry() -> {name: value}`` and ``advance(carry, means) -> (carry, logged)``, the carry after an update
from that update's metric means (over the whole batch, micro-batches added up) and the metrics to log of it. The train
state holds the carry (`jaxtune.train.state.TrainState.carry`), so a checkpoint resumes it exactly; the loss reads it
from the batch (each name a scalar, the same in every micro-batch); the eval step gives it the initial carry. An
objective without ``init_carry`` carries nothing (`initial_carry`).

An objective that compares the policy with a frozen reference model (its record's ``companion``, with the config's
``uses_reference`` saying when: DPO's KL anchor always, GRPO's KL penalty while beta > 0) is handed a `Reference`: the
reference's per-token log-probs of a batch of (N, T) rows (unless the batch carries them precomputed), and whether the
policy's weights are the reference's (`Reference.is_policy`). Which model that is (LoRA's base with the adapters off, or
a frozen copy) is the step's business (`jaxtune.train.reference`), not the objective's.

**Exact step 0.** Before the first update the policy is the reference (LoRA's B matrices are 0; a full fine-tune's
weights are its frozen copy), so every log-ratio is 0 by construction. Computed, it is not quite: the policy's
log-probs come out of the differentiated program and the reference's out of another, whose float sums round
differently (~1e-7 per sequence), which turns TRL's strict "chosen > rejected" into a coin flip. `pinned` gives the
policy's log-probs the reference's values wherever the weights are the same (their gradient is untouched), so step
1's rewards are exactly 0 and its loss exactly log 2, as in TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.train.state import Batch, Forward

Metrics = dict[str, jax.Array | tuple[jax.Array, jax.Array]]  # a sum (over the loss's count), or (sum, its count)
EXTREMES = {"/max": (jnp.maximum, -jnp.inf), "/min": (jnp.minimum, jnp.inf)}  # name suffix: (combine, identity)
COUNT_SUFFIX = "/count"  # `count_key`: a metric's own count, as the step reports it beside the metric's mean
MARGINS = "rewards/margins"


def extreme(name: str) -> tuple[Callable, float] | None:
    """How metric ``name`` combines over micro-batches and eval batches when it is an extreme (``.../max``,
    ``.../min``): (combine, identity); None for a sum."""
    return next((v for k, v in EXTREMES.items() if name.endswith(k)), None)


# Metrics that measure the update as it goes (the clipped share of the ratio, the KL to the reference): with several
# optimisation passes per batch (GRPO's num_iterations) the step logs their mean over the passes, as TRL logs them
# at each of its optimizer steps; on the first pass the ratio is 1 and nothing is clipped.
PER_PASS = ("clip_ratio/", "cispo_clip_ratio", "kl")


def varies_per_pass(name: str) -> bool:
    """Whether metric ``name`` (or its count) is averaged over a step's passes (`PER_PASS`), not the first pass's."""
    return name.startswith(PER_PASS)


def count_key(name: str) -> str:
    """The step's key for how many units metric ``name`` is a mean of, where it has units of its own."""
    return name + COUNT_SUFFIX


def counts_of(metrics: Metrics) -> dict[str, jax.Array]:
    """The counts of ``metrics``' (sum, count) pairs, keyed by `count_key`."""
    return {count_key(k): v[1] for k, v in metrics.items() if isinstance(v, tuple) and not extreme(k)}


def present(means: dict[str, float]) -> dict[str, float]:
    """Host ``means`` (a step's, or a window's: each metric with units of its own beside its count, `count_key`)
    without the counts, and without each metric that counted no units: a mean of nothing is absent, not 0."""
    return {k: v for k, v in means.items()
            if not k.endswith(COUNT_SUFFIX) and means.get(count_key(k), 1.0) > 0}


def with_margins(means: dict[str, float]) -> dict[str, float]:
    """``means`` with ``rewards/margins`` (chosen less rejected, TRL's KTOTrainer's) where it holds both rewards but
    no margin: KTO's rewards are means over rows of their own, so the margin is known only where both are."""
    chosen, rejected = (means.get(f"rewards/{side}") for side in ("chosen", "rejected"))
    if MARGINS in means or chosen is None or rejected is None:
        return means
    return {**means, MARGINS: chosen - rejected}


def combine_metrics(a: Metrics, b: Metrics) -> Metrics:
    """Two parts' metrics as the whole's: sums added, extremes by their max (min)."""
    out: Metrics = {}
    for k, v in a.items():
        how = extreme(k)
        out[k] = how[0](v, b[k]) if how is not None else jax.tree.map(jnp.add, v, b[k])
    return out


def metrics_identity(metrics: Metrics) -> Metrics:
    """Zeros shaped like ``metrics`` (the infinities an extreme starts from): what `combine_metrics` starts at."""
    return {k: jax.tree.map(lambda x, k=k: jnp.full(jnp.shape(x), extreme(k)[1] if extreme(k) else 0,
                                                    jnp.result_type(x)), v) for k, v in metrics.items()}


Carry = dict[str, jax.Array]  # an objective's scalars from one update to the next, by name


def initial_carry(objective: Any) -> dict[str, float]:
    """What ``objective`` carries before its first update ({} for most: see the module)."""
    init = getattr(objective, "init_carry", None)
    return {} if init is None else dict(init())


@dataclass(frozen=True)
class Reference:
    """The reference model as a step sees it."""

    # (N, T) rows[, temperature] -> (N, T) float32 log p(targets) of the reference model (of logits / temperature);
    # None when its log-probs are precomputed (``ref_logps`` in the batch)
    logps: Callable[..., jax.Array] | None
    is_policy: jax.Array  # scalar bool: the policy's weights are the reference's (exactly)
    # (N, T) rows -> (N, T, V) float32 log-softmax of the reference's logits: a teacher's whole distributions (gkd)
    log_softmax: Callable[[Batch], jax.Array] | None = None

    def __call__(self, rows: Batch, temperature: float = 1.0) -> jax.Array:
        if self.logps is None:
            raise ValueError("the reference's log-probs were precomputed, but the batch carries none (ref_logps)")
        return self.logps(rows, temperature)


def pinned(policy: jax.Array, ref: jax.Array, reference: Reference | None) -> jax.Array:
    """``policy`` log-probs valued as ``ref``'s wherever the policy is the reference (their difference is then
    rounding noise of two programs, not a difference of models), with ``policy``'s gradient either way."""
    if reference is None:
        return policy
    value = jnp.where(reference.is_policy, ref, policy)
    return jax.lax.stop_gradient(value) + (policy - jax.lax.stop_gradient(policy))


class Unprepared:
    """For an objective whose passes need nothing computed beforehand: `prepare` hands the batch on as it is."""

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        return batch


class BetaOnly(Unprepared):
    """For an objective whose only key is ``objective.beta`` (its default per objective: ``beta_value``)."""

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig):
        return cls(beta=cfg.beta_value)


class Objective(Protocol):
    name: str
    metric_names: tuple[str, ...]  # the keys of the metrics it returns (logged as they are)
    passes: int  # optimizer updates on each batch
    prepares: bool  # `prepare` runs before every step, not only before several passes

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> Objective:
        """The objective with the ``objective`` section's keys."""
        ...

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """Before the first of several passes (or every step, with ``prepares``), on the whole batch: what the passes
        need of the weights as they were (and of the reference)."""
        ...

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]: ...
