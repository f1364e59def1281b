"""Preference objectives on pairs: DPO (against a reference model) and the reference-free SimPO and ORPO.

A batch holds pairs: every array is (B, 2, T), row 0 the chosen completion and row 1 the rejected one, each after the
same prompt (`jaxtune.data.preference`); ``loss_mask`` marks the completion's targets. Both rows of every pair go
through the model in one forward, as (2B, T). With ``data.share_prompts`` a pair is one (B, T) row instead, its prompt
once and then both completions (``branch_ids`` 1 and 2), so the prompt is computed once per pair. A sequence's
log-prob is the sum of its completion tokens' log-probs (SimPO and ORPO: their mean, as TRL's ``average_log_prob``).
The unit counted is the pair: a padding pair (no completion token, in a held-out batch's tail) counts 0.

The formulas and metric names are TRL's (``DPOTrainer``, ``CPOTrainer`` with ``loss_type=simpo``, ``ORPOTrainer``),
checked against TRL in ``tests/train/test_preference_objectives.py`` (which pins its version). With c, r the policy's
and c_ref, r_ref the reference's sequence log-probs, n_c, n_r the completions' token counts, Δ = (c - c_ref) -
(r - r_ref):

* dpo sigmoid: -(1 - ε) log σ(βΔ) - ε log σ(-βΔ) (ε: ``label_smoothing``, conservative DPO; ε = 0 is TRL's sigmoid)
* dpo hinge: max(0, 1 - βΔ)
* dpo ipo: ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / 2β)²  (TRL's per-token normalisation); sigmoid_norm:
  -log σ(β((c - c_ref) / n_c - (r - r_ref) / n_r))
* dpo's other TRL loss types, with ρ_c = c - c_ref, ρ_r = r - r_ref: robust (-(1-ε) log σ(βΔ) + ε log σ(-βΔ)) /
  (1 - 2ε); bco_pair -log σ(βρ_c) - log σ(-βρ_r); sppo_hard (ρ_c - 1/2β)² + (ρ_r + 1/2β)²; nca_pair -log σ(βρ_c)
  - ½ log σ(-βρ_c) - ½ log σ(-βρ_r); exo_pair σ(βΔ)(log σ(βΔ) - log(1-ε)) + σ(-βΔ)(log σ(-βΔ) - log ε); apo_zero
  1 - σ(βρ_c) + σ(βρ_r); apo_down σ(βρ_c) + 1 - σ(βΔ); discopop -log σ(βΔ)(1 - m) + exp(-βΔ) m, m = σ(βΔ/τ); aot
  and aot_unpaired the smoothed sigmoid of the sorted c - r minus the sorted c_ref - r_ref (sorted ρ_c minus sorted
  ρ_r), sorted over the micro-batch's real pairs (TRL: the device's batch); sft the chosen completion's mean NLL per
  pair (TRL: the token mean over the batch's chosen completions; equal when they are of one length). A list of loss
  types is Σ w_k loss_k per pair (TRL's ``loss_weights``).
* simpo: as dpo sigmoid on c/n_c - r/n_r - γ/β, without a reference
* orpo: -c/n_c - β log σ(log odds(c/n_c) - log odds(r/n_r)), odds(p) = p / (1 - p). The NLL term here is each
  pair's mean NLL over its chosen completion, averaged over pairs (the ORPO paper's SFT term, and the unit the step
  accumulates over micro-batches); TRL's is the cross-entropy over every token of the batch's chosen sequences,
  prompt included (``ORPOTrainer.concatenated_forward``). The odds-ratio term and the metrics are TRL's.

Metrics (means per pair): ``rewards/chosen``, ``rewards/rejected`` (β(c - c_ref), or β c/n_c without a reference),
``rewards/accuracies`` (chosen reward strictly above rejected), ``rewards/margins``, ``logps/chosen``,
``logps/rejected``; orpo also ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.config.kinds import BRANCH_KEY
from jaxtune.config.kinds import OBJECTIVES as DECLARED
from jaxtune.train.objectives.base import BetaOnly, Metrics, Reference, pinned
from jaxtune.train.state import Batch, Forward

REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")
_SEQUENCE_KEYS = ("inputs", "targets", "positions", "segment_ids")


def flat_pairs(batch: Batch) -> Batch:
    """The model's rows of a pair batch: (B, 2, T) pair arrays -> (2B, T) rows, chosen and rejected of pair b at rows
    2b and 2b + 1; pairs laid out with their prompt shared (``branch_ids``) are (B, T) rows already."""
    if BRANCH_KEY in batch:
        return {k: batch[k] for k in (*_SEQUENCE_KEYS, BRANCH_KEY) if k in batch}
    return {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in _SEQUENCE_KEYS if k in batch}


def pair_logps(token_logps: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """The token log-probs of `flat_pairs`' rows -> (summed completion log-probs, completion token counts), each
    (B, 2): chosen, rejected. A shared-prompt row's chosen tokens are branch 1, its rejected ones branch 2."""
    mask = batch["loss_mask"].astype(jnp.float32)
    if BRANCH_KEY in batch:
        branch = batch[BRANCH_KEY]
        sides = jnp.stack([mask * (branch == k) for k in (1, 2)], axis=1)  # (B, 2, T)
        return jnp.sum(token_logps[:, None, :] * sides, axis=-1), jnp.sum(sides, axis=-1)
    return jnp.sum(token_logps.reshape(mask.shape) * mask, axis=-1), jnp.sum(mask, axis=-1)


def _smoothed_sigmoid(z: jax.Array, eps: float) -> jax.Array:
    return -(1.0 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


@dataclass(frozen=True)
class PreferenceObjective(BetaOnly):
    """The shared part: one forward of both rows of every pair, the pairs' log-probs, what counts."""

    beta: float
    name: str = ""
    metric_names: tuple[str, ...] = REWARD_METRICS
    passes: int = 1
    prepares: bool = False

    @property
    def uses_reference(self) -> bool:
        """Whether its loss reads the reference's log-probs: its record's companion."""
        return DECLARED[self.name].companion == "reference"

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        logps, counts = pair_logps(forward.token_logps(weights, flat_pairs(batch), key), batch)
        valid = jnp.all(counts > 0, axis=-1)  # (B,): a padding pair counts 0
        # A padding pair's values are replaced by harmless ones before the losses (log1mexp(0) is -inf), so neither
        # its loss nor its gradient can turn into NaN.
        safe = lambda x, fill: jnp.where(valid[:, None], x, fill)
        ref = None
        if self.uses_reference:
            ref = safe(self._reference_logps(batch, reference), -1.0)
            logps = pinned(logps, ref, reference)  # exactly the reference's while the policy is the reference
        logps, counts = safe(logps, -1.0), safe(counts, 1.0)
        losses, metrics = self.pair_losses(logps, counts, ref, valid)
        total = lambda x: jnp.sum(jnp.where(valid, x, 0.0))
        return total(losses), jnp.sum(valid.astype(jnp.float32)), {k: total(v) for k, v in metrics.items()}

    @staticmethod
    def _reference_logps(batch: Batch, reference: Reference | None) -> jax.Array:
        """(B, 2): precomputed in the batch (``ref_logps``), else from the reference model (no gradient)."""
        if "ref_logps" in batch:
            return batch["ref_logps"].astype(jnp.float32)
        if reference is None or reference.logps is None:
            raise ValueError("this objective compares with a reference model, but the step has none and the batch "
                             "carries no ref_logps")
        return pair_logps(jax.lax.stop_gradient(reference(flat_pairs(batch))), batch)[0]

    def pair_losses(self, logps: jax.Array, counts: jax.Array, ref: jax.Array | None,
                    valid: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(B, 2) sequence log-probs, token counts and reference log-probs, and which pairs are real (B,) -> per-pair
        losses (B,) and per-pair metrics (B,) (summed over valid pairs by the caller)."""
        raise NotImplementedError


def _sorted_in_place(x: jax.Array, valid: jax.Array) -> jax.Array:
    """``x`` (B,) sorted ascending over the valid entries, which come first (the padding pairs' after them)."""
    return jnp.sort(jnp.where(valid, x, jnp.inf))


def _to_valid_slots(values: jax.Array, valid: jax.Array) -> jax.Array:
    """Per-position values whose first k (k valid pairs) belong to the valid pairs, put at the valid pairs' indices
    (the caller sums over them), the rest at the padding pairs'."""
    order = jnp.argsort(~valid, stable=True)  # the valid pairs' indices first
    return jnp.zeros_like(values).at[order].set(values)


@dataclass(frozen=True)
class DPO(PreferenceObjective):
    """DPO with TRL's loss types (`loss_terms`), one or a weighted sum: per pair, ``Σ w_k loss_k``, whose mean over
    pairs is TRL's ``Σ w_k mean(loss_k)``."""

    name: str = "dpo"
    loss_types: tuple[tuple[str, float], ...] = (("sigmoid", 1.0),)  # (loss type, weight)
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> DPO:
        return cls(beta=cfg.beta_value, loss_types=cfg.weighted_loss_types, label_smoothing=cfg.label_smoothing,
                   discopop_tau=cfg.discopop_tau)

    def pair_losses(self, logps, counts, ref, valid):
        ratios = logps - ref  # (B, 2): log π/π_ref of chosen, rejected
        losses = sum(w * self.loss_term(t, logps, counts, ref, valid) for t, w in self.loss_types)
        rewards = self.beta * jax.lax.stop_gradient(ratios)
        return losses, _per_pair(rewards, jax.lax.stop_gradient(logps))

    def loss_term(self, loss_type: str, logps: jax.Array, counts: jax.Array, ref: jax.Array,
                  valid: jax.Array) -> jax.Array:
        """One loss type's per-pair losses (B,), as TRL's ``DPOTrainer._compute_loss`` computes them."""
        b, eps = self.beta, self.label_smoothing
        ratios = logps - ref
        chosen, rejected = ratios[:, 0], ratios[:, 1]
        delta = chosen - rejected
        log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid
        if loss_type == "sigmoid":
            return _smoothed_sigmoid(b * delta, eps)
        if loss_type == "hinge":
            return jax.nn.relu(1.0 - b * delta)
        if loss_type in ("ipo", "sigmoid_norm"):  # on per-token log-ratios
            per_token = ratios / counts
            z = per_token[:, 0] - per_token[:, 1]
            return (z - 1.0 / (2.0 * b)) ** 2 if loss_type == "ipo" else -log_sigmoid(b * z)
        if loss_type == "robust":
            return (-(1 - eps) * log_sigmoid(b * delta) + eps * log_sigmoid(-b * delta)) / (1 - 2 * eps)
        if loss_type == "exo_pair":
            return (sigmoid(b * delta) * (log_sigmoid(b * delta) - jnp.log1p(-eps))
                    + sigmoid(-b * delta) * (log_sigmoid(-b * delta) - jnp.log(eps)))
        if loss_type == "nca_pair":
            return -log_sigmoid(b * chosen) - 0.5 * log_sigmoid(-b * chosen) - 0.5 * log_sigmoid(-b * rejected)
        if loss_type == "bco_pair":
            return -log_sigmoid(b * chosen) - log_sigmoid(-b * rejected)
        if loss_type == "sppo_hard":
            return (chosen - 0.5 / b) ** 2 + (rejected + 0.5 / b) ** 2
        if loss_type in ("aot", "aot_unpaired"):  # sorted over the micro-batch's pairs, the padding ones left out
            if loss_type == "aot":
                z = (_sorted_in_place(logps[:, 0] - logps[:, 1], valid)
                     - _sorted_in_place(ref[:, 0] - ref[:, 1], valid))
            else:
                z = _sorted_in_place(chosen, valid) - _sorted_in_place(rejected, valid)
            z = jnp.where(jnp.arange(z.shape[0]) < jnp.sum(valid), z, 0.0)
            return _to_valid_slots(_smoothed_sigmoid(b * z, eps), valid)
        if loss_type == "apo_zero":
            return (1 - sigmoid(b * chosen)) + sigmoid(b * rejected)
        if loss_type == "apo_down":
            return sigmoid(b * chosen) + (1 - sigmoid(b * delta))
        if loss_type == "discopop":
            z = b * delta
            mix = sigmoid(z / self.discopop_tau)
            return -log_sigmoid(z) * (1 - mix) + jnp.exp(-z) * mix
        if loss_type == "sft":  # each pair's mean NLL over its chosen completion (TRL: the batch's token mean)
            return -logps[:, 0] / counts[:, 0]
        raise ValueError(f"objective.loss_type={loss_type!r}")


@dataclass(frozen=True)
class SimPO(PreferenceObjective):
    name: str = "simpo"
    gamma: float = 0.5
    label_smoothing: float = 0.0

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> SimPO:
        return cls(beta=cfg.beta_value, gamma=cfg.gamma, label_smoothing=cfg.label_smoothing)

    def pair_losses(self, logps, counts, ref, valid):
        mean = logps / counts
        z = self.beta * (mean[:, 0] - mean[:, 1] - self.gamma / self.beta)
        losses = _smoothed_sigmoid(z, self.label_smoothing)
        mean = jax.lax.stop_gradient(mean)
        return losses, _per_pair(self.beta * mean, mean)


@dataclass(frozen=True)
class ORPO(PreferenceObjective):
    name: str = "orpo"
    metric_names: tuple[str, ...] = (*REWARD_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def pair_losses(self, logps, counts, ref, valid):
        # A mean log-prob of exactly 0 (every token certain) has infinite odds; TRL's loss is NaN there, ours stays
        # finite by capping it just below 0 (no effect on pairs of any real model's uncertainty).
        mean = jnp.minimum(logps / counts, -1e-6)
        log_odds = (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll = -mean[:, 0]
        losses = nll - self.beta * ratio
        fixed = jax.lax.stop_gradient
        metrics = _per_pair(self.beta * fixed(mean), fixed(mean))
        return losses, {**metrics, "nll_loss": fixed(nll), "log_odds_ratio": fixed(ratio),
                        "log_odds_chosen": fixed(log_odds)}


def _per_pair(rewards: jax.Array, logps: jax.Array) -> dict[str, jax.Array]:
    """Per-pair (B,) values of TRL's reward metrics from (B, 2) rewards and log-probs."""
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return {"rewards/chosen": chosen, "rewards/rejected": rejected,
            "rewards/accuracies": (chosen > rejected).astype(jnp.float32), "rewards/margins": chosen - rejected,
            "logps/chosen": logps[:, 0], "logps/rejected": logps[:, 1]}

