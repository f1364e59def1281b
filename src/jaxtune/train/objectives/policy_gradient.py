"""What the policy-gradient objectives on sampled completions (GRPO, RLOO) share, as pure functions of their arrays.

Both read the rollout's rows (`jaxtune.rollout.rollout`): a row per completion, or with shared prompts a group in one
row (``branch_ids``: the prompt 0, then each completion 1..G), ``advantages`` (N,) or (prompts, G). Both compare the
policy's log-probs with those of the policy that sampled (the old policy: `old_logps`), clip a ratio r of the two to
[1 - epsilon, 1 + epsilon_high] (`ClipBounds`) in a clipped surrogate -min(r A, clip(r) A), and report how many ratios
the clip cut (`clip_metrics`) and how far the sampler's log-probs are from the trainer's (`sampler_agreement`). The KL
to the reference is estimated per token as k1 (old - ref, `k1_kl`: RLOO's, in the reward) or k3 (`k3_kl`: GRPO's, in the
loss), each completion's advantage laid on its tokens by `token_advantages`. GRPO's ratio is per token, RLOO's per
completion. When the rollout lags (``max_staleness``) the old policy is the one that sampled, not the weights being
trained: `old_logps` then takes the sampler's log-probs, for every clipped objective alike (unless an importance weight
corrects for the sampler instead: GRPO's ``importance_sampling``, which keeps the trainer's as the old policy's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.config.kinds import BRANCH_KEY, BRANCH_SLOTS_KEY, SAMPLER_LOGPS_KEY
from jaxtune.train.objectives.base import Metrics, Reference, pinned
from jaxtune.train.state import Batch, Forward

# The rollout's arrays that a forward pass reads (the policy's, the reference's; GKD's teacher's too).
ROW_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask", BRANCH_KEY, BRANCH_SLOTS_KEY)
OLD_LOGPS_KEY = "old_logps"  # what `with_old_logps` adds: the sampling policy's (N, T) log-probs, fixed for each pass


def rows(batch: Batch) -> Batch:
    """The batch's arrays a forward pass reads (`ROW_KEYS`)."""
    return {k: batch[k] for k in ROW_KEYS if k in batch}


def tempered_logps(forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                   temperature: float) -> jax.Array:
    """(N, T) log-probs of the batch's targets under the policy's logits / ``temperature`` (the distribution the
    completions were sampled from)."""
    return forward.token_logps(weights, rows(batch), key, temperature)


def reference_logps(reference: Reference, batch: Batch, temperature: float) -> jax.Array:
    """(N, T) log-probs of the batch's targets under the reference's tempered distribution."""
    return reference(rows(batch), temperature)


def sampling_logps(forward: Forward, weights: Any, batch: Batch, temperature: float,
                   from_sampler: bool) -> jax.Array:
    """(N, T) log-probs of the policy that sampled, without gradient: the sampler's own (``from_sampler``, when the
    batch carries them: no forward pass), else the trainer's forward with ``weights`` (the weights that sampled)."""
    if from_sampler and SAMPLER_LOGPS_KEY in batch:
        return batch[SAMPLER_LOGPS_KEY]
    return jax.lax.stop_gradient(tempered_logps(forward, weights, batch, None, temperature))


def with_old_logps(forward: Forward, weights: Any, batch: Batch, temperature: float, from_sampler: bool) -> Batch:
    """The batch with the sampling policy's log-probs (`sampling_logps`) as ``old_logps``: what every pass over it
    compares the policy with."""
    return {**batch, OLD_LOGPS_KEY: sampling_logps(forward, weights, batch, temperature, from_sampler)}


def lag_corrected(cfg: Any) -> bool:
    """Whether a single pass's old policy is the sampler's (`old_logps`'s ``from_sampler``): the rollout lags
    (``objective.max_staleness`` >= 1) and the sampler's log-probs are the old policy's (``old_logps: sampler``)."""
    return bool(getattr(cfg, "max_staleness", 0)) and getattr(cfg, "old_logps", None) == "sampler"


def old_logps(batch: Batch, logps: jax.Array, from_sampler: bool = False) -> jax.Array:
    """The old policy's (N, T) log-probs: the batch's ``old_logps`` when prepared (several passes); else, where the
    rollout lags and the sampler's log-probs stand for the old policy (``from_sampler``, `lag_corrected`), the
    sampler's, so that one pass is corrected for the lag by the ratio as later passes are; else the policy's own
    ``logps`` without gradient (one pass on-policy: the weights are those that sampled, so every ratio is 1)."""
    if OLD_LOGPS_KEY in batch:
        return batch[OLD_LOGPS_KEY]
    if from_sampler:
        if SAMPLER_LOGPS_KEY not in batch:
            raise ValueError("the rollout lags but the batch carries no sampler log-probs to correct the ratio with")
        return batch[SAMPLER_LOGPS_KEY]
    return jax.lax.stop_gradient(logps)


@dataclass(frozen=True)
class Clipped:
    """The keys every clipped policy-gradient objective has (GRPO, RLOO, REINFORCE++ subclass it), as `clipped_keys`
    reads them from its config section, and its tempered log-probs."""

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    temperature: float = 1.0
    max_completion_length: int = 128
    passes: int = 1  # optimisation passes over each batch (TRL's num_iterations)
    old_from_sampler: bool = False  # the batch's sampler log-probs are the old policy's
    lag_corrected: bool = False  # the rollout lags: one pass's old policy is the sampler's (`lag_corrected`)

    @staticmethod
    def clipped_keys(cfg: Any) -> dict[str, Any]:
        """This base's fields from a `ClippedPolicy` config section."""
        return {"beta": cfg.beta_value, "epsilon": cfg.epsilon, "epsilon_high": cfg.epsilon_high,
                "temperature": cfg.temperature, "max_completion_length": cfg.max_completion_length,
                "passes": cfg.passes, "old_from_sampler": cfg.old_logps == "sampler",
                "lag_corrected": lag_corrected(cfg)}

    def logps(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None) -> jax.Array:
        """(N, T) log-probs of the batch's targets under the tempered policy."""
        return tempered_logps(forward, weights, batch, key, self.temperature)


def completion_masks(batch: Batch) -> jax.Array:
    """(rows, C, T) float32: which tokens of each row belong to each of its C completions (C = 1: a row per
    completion, all ones, its ``loss_mask`` picks the tokens; C = G: a group in one row, by ``branch_ids``)."""
    adv = batch["advantages"]
    if BRANCH_KEY not in batch:  # (N,) per row
        return jnp.ones((adv.shape[0], 1, 1), jnp.float32)
    branch = batch[BRANCH_KEY]  # (B, T): 0 the prompt, k the k-th completion; advantages (B, G)
    return (branch[:, None, :] == jnp.arange(1, adv.shape[1] + 1)[None, :, None]).astype(jnp.float32)


def per_completion(x: jax.Array, completions: jax.Array) -> jax.Array:
    """(rows, T) summed over each completion's tokens: (rows, C), with ``completions`` from `completion_masks`."""
    return jnp.sum(x[:, None, :] * completions, -1)


def completion_means(masked: jax.Array, mask: jax.Array, completions: jax.Array) -> jax.Array:
    """(rows, C): each completion's mean of (rows, T) ``masked``, which is 0 off the tokens ``mask`` keeps (a
    completion without tokens: 0)."""
    return per_completion(masked, completions) / jnp.maximum(per_completion(mask, completions), 1.0)


def on_tokens(per: jax.Array, completions: jax.Array) -> jax.Array:
    """(rows, C) values, one per completion, on each completion's tokens: (rows, T), or (rows, 1) for a row per
    completion (broadcast over its tokens)."""
    return jnp.sum(per[:, :, None] * completions, 1)


def token_advantages(batch: Batch) -> jax.Array:
    """Each token's completion's advantage, shaped like the token arrays ((N, 1) for a row per completion, (B, T)
    for a group in one row, by ``branch_ids``)."""
    adv = batch["advantages"]
    if BRANCH_KEY not in batch:  # (N,) per row
        return adv[:, None]
    branch = batch[BRANCH_KEY]  # (B, T): 0 the prompt, k the k-th completion; advantages (B, G)
    return jnp.take_along_axis(adv, jnp.clip(branch - 1, 0, adv.shape[1] - 1), axis=1)


def k1_kl(old: jax.Array, reference: Reference, batch: Batch, temperature: float) -> jax.Array:
    """(N, T) k1 estimate of KL(π_old || π_ref) per token, old - ref (RLOO's penalty in the reward, summed over a
    completion's tokens), from the old policy's log-probs ``old``; exactly 0 while the policy is the reference."""
    return jnp.where(reference.is_policy, 0.0, old - reference_logps(reference, batch, temperature))


def k3_kl(logps: jax.Array, batch: Batch, reference: Reference | None, temperature: float, name: str) -> jax.Array:
    """(N, T) k3 estimate of KL(π || π_ref) per token, exp(ref - logp) - (ref - logp) - 1 (>= 0, with the policy's
    gradient), from the policy's tempered log-probs ``logps``; exactly 0 while the policy is the reference. ``name``:
    the objective, said where no reference was given."""
    if reference is None:
        raise ValueError(f"{name} with beta > 0 needs the reference model's log-probs")
    ref = reference_logps(reference, batch, temperature)
    delta = ref - pinned(logps, ref, reference)
    return jnp.exp(delta) - delta - 1.0


def completion_advantages(batch: Batch, completions: jax.Array) -> jax.Array:
    """Each completion's advantage as (rows, C), C from ``completions`` (`completion_masks`)."""
    return batch["advantages"].reshape(completions.shape[:2])


class ClipBounds(NamedTuple):
    """Where the ratio is clipped: [1 - epsilon, 1 + epsilon_high] (epsilon_high None: epsilon, a symmetric clip)."""

    low: float
    high: float

    @classmethod
    def of(cls, epsilon: float, epsilon_high: float | None) -> ClipBounds:
        return cls(1.0 - epsilon, 1.0 + (epsilon if epsilon_high is None else epsilon_high))


def clipped_surrogate(ratio: jax.Array, adv: jax.Array, bounds: ClipBounds, delta: float | None = None) -> jax.Array:
    """-min(r A, clip(r, low, high) A), elementwise: PPO's pessimistic bound, the loss of each ratio. ``delta``
    (two-sided clipping): the unclipped term's r capped at delta, which bounds a negative advantage's loss."""
    clipped = jnp.clip(ratio, bounds.low, bounds.high)
    unclipped = ratio if delta is None else jnp.minimum(ratio, delta)
    return -jnp.minimum(unclipped * adv, clipped * adv)


def clip_metrics(ratio: jax.Array, adv: jax.Array, bounds: ClipBounds, count: jax.Array,
                 mask: jax.Array | None = None) -> Metrics:
    """The share of ratios the clip cut (TRL's names): below ``low`` where A < 0 (``clip_ratio/low_mean``), above
    ``high`` where A > 0 (``/high_mean``), either (``/region_mean``), as (sum, ``count``) over the ratios ``mask``
    keeps (None: all)."""
    fixed = jax.lax.stop_gradient(ratio)
    low = ((fixed < bounds.low) & (adv < 0)).astype(jnp.float32)
    high = ((fixed > bounds.high) & (adv > 0)).astype(jnp.float32)
    total = jnp.sum if mask is None else (lambda x: jnp.sum(x * mask))
    return {"clip_ratio/low_mean": (total(low), count), "clip_ratio/high_mean": (total(high), count),
            "clip_ratio/region_mean": (total(jnp.maximum(low, high)), count)}


def sampler_agreement(batch: Batch, logps: jax.Array) -> Metrics:
    """How far the trainer's log-probs ``logps`` are from the sampler's, over completion tokens
    (``sampler_logp_diff/mean`` and ``/max``); none when the batch carries no sampler log-probs."""
    if SAMPLER_LOGPS_KEY not in batch:
        return {}
    mask = batch["loss_mask"]
    diff = jnp.abs(jax.lax.stop_gradient(logps) - batch[SAMPLER_LOGPS_KEY]) * mask
    return {"sampler_logp_diff/mean": (jnp.sum(diff), jnp.sum(mask)), "sampler_logp_diff/max": jnp.max(diff)}
