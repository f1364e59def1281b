"""KTO (Kahneman-Tversky optimisation, TRL's ``KTOTrainer``) on unpaired rows: each a completion labelled desirable
or undesirable (`jaxtune.data.unpaired`), against a frozen reference model.

A batch holds items (B, 2, T): row 0 the row's sequence, row 1 its KL sequence (its prompt with another row's
completion), and ``labels`` (B, 2). With ρ = log π(completion) - log π_ref(completion) summed over the completion's
tokens and z the KL baseline::

    desirable:   desirable_weight   * (1 - σ(β (ρ - z)))
    undesirable: undesirable_weight * (1 - σ(β (z - ρ)))

averaged over the rows (TRL's ``losses.nanmean()``). z = max(0, mean over the batch's KL sequences of log π - log
π_ref), without gradient, computed once per step on the whole batch before micro-batches split it (`KTO.prepare`;
TRL: per device batch, then averaged over processes). ``loss_type: apo_zero_unpaired`` (TRL's): 1 - σ(βρ) for
desirable rows and σ(βρ) for undesirable ones, no KL. Metrics (TRL's names, means over their rows):
``rewards/chosen`` and ``logps/chosen`` over the desirable rows (βρ, log π), ``rewards/rejected`` and
``logps/rejected`` over the undesirable ones, and ``kl``; each a (sum, count) pair, so a label without rows in a batch
adds nothing to a mean and is not logged where no step had any, and ``rewards/margins`` (chosen less rejected) is
logged where both are (`jaxtune.train.objectives.base.with_margins`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives.base import Metrics, Reference, pinned
from jaxtune.train.state import Batch, Forward

_ROW_KEYS = ("inputs", "targets", "positions", "segment_ids")
KL_KEY = "kto_kl"  # what `KTO.prepare` adds: the step's KL baseline, one value per item (B, 2)


def _row(batch: Batch, k: int) -> tuple[Batch, jax.Array]:
    """Row ``k`` of every item (0: its sequence, 1: its KL sequence) as (B, T) rows, and their loss mask."""
    return {key: batch[key][:, k] for key in _ROW_KEYS if key in batch}, batch["loss_mask"][:, k].astype(jnp.float32)


@dataclass(frozen=True)
class KTO:
    name: str = "kto"
    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    metric_names: tuple[str, ...] = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")
    passes: int = 1
    prepares: bool = True

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> KTO:
        return cls(beta=cfg.beta_value, loss_type=cfg.loss_type_value, desirable_weight=cfg.desirable_weight,
                   undesirable_weight=cfg.undesirable_weight)

    @property
    def estimates_kl(self) -> bool:
        return self.loss_type == "kto"

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """The KL baseline z of the whole batch, from its KL sequences (0 for apo_zero_unpaired)."""
        if not self.estimates_kl:
            return batch
        if reference is None:
            raise ValueError("kto needs the reference model's log-probs")
        rows, mask = _row(batch, 1)
        policy = jnp.sum(jax.lax.stop_gradient(forward.token_logps(weights, rows, None)) * mask, axis=-1)
        ref = _reference_logps(batch, 1, rows, mask, reference)
        real = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)  # a padding item (a held-out batch's tail) has none
        kl = jnp.sum((policy - ref) * real) / jnp.maximum(jnp.sum(real), 1.0)
        kl = jnp.where(reference.is_policy, 0.0, jnp.maximum(kl, 0.0))  # exactly 0 while the policy is the reference
        return {**batch, KL_KEY: jnp.broadcast_to(kl, batch["labels"].shape)}

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        if reference is None:
            raise ValueError("kto needs the reference model's log-probs")
        rows, mask = _row(batch, 0)
        logps = jnp.sum(forward.token_logps(weights, rows, key) * mask, axis=-1)  # (B,)
        ref = _reference_logps(batch, 0, rows, mask, reference)
        logps = pinned(logps, ref, reference)
        ratio = logps - ref
        real = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
        desirable = (batch["labels"][:, 0] > 0.5).astype(jnp.float32) * real
        undesirable = real - desirable
        z = batch[KL_KEY][:, 0] if KL_KEY in batch else jnp.zeros_like(ratio)
        b = self.beta
        if self.estimates_kl:
            wanted, unwanted = 1.0 - jax.nn.sigmoid(b * (ratio - z)), 1.0 - jax.nn.sigmoid(b * (z - ratio))
        else:  # apo_zero_unpaired
            wanted, unwanted = 1.0 - jax.nn.sigmoid(b * ratio), jax.nn.sigmoid(b * ratio)
        losses = self.desirable_weight * wanted * desirable + self.undesirable_weight * unwanted * undesirable
        fixed = jax.lax.stop_gradient
        rewards, own = b * fixed(ratio), fixed(logps)
        n_wanted, n_unwanted, n = jnp.sum(desirable), jnp.sum(undesirable), jnp.sum(real)
        metrics: Metrics = {
            "rewards/chosen": (jnp.sum(rewards * desirable), n_wanted),
            "rewards/rejected": (jnp.sum(rewards * undesirable), n_unwanted),
            "logps/chosen": (jnp.sum(own * desirable), n_wanted),
            "logps/rejected": (jnp.sum(own * undesirable), n_unwanted),
            "kl": (jnp.sum(fixed(z) * real), n),
        }
        return jnp.sum(losses), n, metrics


def _reference_logps(batch: Batch, k: int, rows: Batch, mask: jax.Array, reference: Reference) -> jax.Array:
    """(B,) the reference's summed completion log-probs of each item's sequence ``k`` (0: the row, 1: its KL row):
    precomputed in the batch (``ref_logps``, objective.precompute_ref_logps), else from the reference model."""
    if "ref_logps" in batch:
        return batch["ref_logps"][:, k].astype(jnp.float32)
    return jnp.sum(reference(rows) * mask, axis=-1)
