"""RLOO (REINFORCE leave-one-out, TRL's ``RLOOTrainer``): GRPO's rollout (the same sampler, rewards and rows), another
baseline and a per-sequence loss.

Advantages. `RLOO.advantages`, called by the rollout, gives each completion its reward less the mean reward of its
group's other scorable completions (`jaxtune.train.objectives.advantages.leave_one_out_advantages`; a completion every
reward function declined is unscorable: NaN, left out of the baselines). `RLOO.prepare`, on the whole batch before the
step's first pass, puts the KL to the reference into the reward (``beta`` > 0): kl_i = Σ_t (old_t - ref_t) over
completion i's tokens, the first-order estimate of the RLOO paper, with old the log-probs of the policy that sampled
(the sampler's, or the trainer's forward: ``old_logps``). The baseline being linear in the rewards, the advantage of r_i
- β kl_i is A_i - β (kl_i - mean of kl over the group's other scorable completions). With ``normalize_advantages`` the
advantages are then normalised over the whole batch ((A - mean) / (std + 1e-4), NaN left out,
`trl.trainer.utils.nanstd`'s Bessel-corrected std); unscorable completions end at 0.

Loss, per completion: with ρ = exp(Σ_t logp_t - Σ_t old_t) its sequence ratio (old: the weights that sampled; when the
rollout lags, ``max_staleness``, the sampler's log-probs, so the ratio corrects for the lag), -min(ρ A, clip(ρ, 1 - ε, 1
+ ε_high) A), averaged over completions. Metrics (TRL's names): ``kl`` (per completion token, of old - ref),
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (the share of completions whose ratio was clipped), and the
sampler's agreement with the trainer (``sampler_logp_diff/mean``, ``/max``) as for GRPO. What it does as GRPO does (the
old log-probs, the clip, its metrics) is `policy_gradient`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives import policy_gradient as pg
from jaxtune.train.objectives.advantages import Rewarded, leave_one_out_advantages
from jaxtune.train.objectives.base import Metrics, Reference
from jaxtune.train.state import Batch, Forward

SEQUENCE_KL_KEY = "sequence_kl"  # what `RLOO.prepare` adds: each completion's Σ_t (old - ref), for the kl metric


def normalized(adv: jax.Array) -> jax.Array:
    """(A - mean) / (std + 1e-4) over the batch's scorable (not NaN) advantages, the std Bessel-corrected
    (`trl.trainer.utils.nanstd`); NaN stays NaN."""
    scorable = ~jnp.isnan(adv)
    n = jnp.sum(scorable)
    mean = jnp.sum(jnp.where(scorable, adv, 0.0)) / n
    var = jnp.sum(jnp.where(scorable, (adv - mean) ** 2, 0.0)) / (n - 1)
    return (adv - mean) / (jnp.sqrt(var) + 1e-4)


@dataclass(frozen=True)
class RLOO(pg.Clipped):
    name: str = "rloo"
    num_generations: int = 8
    normalize_advantages: bool = False
    prepares: bool = True  # the advantages need the whole batch (and the reference) before every step
    metric_names: tuple[str, ...] = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> RLOO:
        return cls(**cls.clipped_keys(cfg), num_generations=cfg.num_generations,
                   normalize_advantages=cfg.normalize_advantages)

    @staticmethod
    def advantages(cfg: ObjectiveConfig, rewarded: Rewarded) -> tuple[np.ndarray, None]:
        """Each completion's reward less the mean of its group's other scorable completions (NaN: unscorable);
        `prepare` adds the KL penalty and the normalisation on the whole batch."""
        return leave_one_out_advantages(rewarded.total, rewarded.per_function, rewarded.group), None

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """The final advantages on the whole batch: the KL to the reference in the reward (``beta`` > 0), the
        normalisation, unscorable completions at 0; and before several passes the old log-probs
        (`policy_gradient.with_old_logps`)."""
        if self.passes > 1:
            batch = pg.with_old_logps(forward, weights, batch, self.temperature, self.old_from_sampler)
        completions = pg.completion_masks(batch)
        adv = pg.completion_advantages(batch, completions)
        if self.beta > 0:
            if reference is None:
                raise ValueError("rloo with beta > 0 needs the reference model's log-probs")
            adv, kl = self.kl_penalized(forward, weights, batch, reference, adv, completions)
            batch = {**batch, SEQUENCE_KL_KEY: kl}
        if self.normalize_advantages:
            adv = normalized(adv)
        adv = jnp.nan_to_num(adv, nan=0.0)
        return {**batch, "advantages": adv.reshape(batch["advantages"].shape)}

    def kl_penalized(self, forward: Forward, weights: Any, batch: Batch, reference: Reference, adv: jax.Array,
                     completions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The advantages (rows, C) of the rewards less beta times each completion's KL to the reference,
        kl_i = Σ_t (old_t - ref_t): A_i - beta (kl_i - mean of kl over the group's other scorable completions), the
        leave-one-out baseline being linear in the rewards; and kl (rows, C)."""
        if pg.OLD_LOGPS_KEY in batch:
            old = batch[pg.OLD_LOGPS_KEY]
        else:
            old = pg.sampling_logps(forward, weights, batch, self.temperature, self.old_from_sampler)
        kl = pg.per_completion(pg.k1_kl(old, reference, batch, self.temperature) * batch["loss_mask"], completions)
        groups = adv.reshape(-1, self.num_generations)  # each prompt's completions (contiguous rows, or a row)
        kl_groups = kl.reshape(groups.shape)
        scorable = ~jnp.isnan(groups)
        kl_sum = jnp.sum(jnp.where(scorable, kl_groups, 0.0), axis=1, keepdims=True)
        others = (kl_sum - kl_groups) / (jnp.sum(scorable, axis=1, keepdims=True) - 1)
        return (groups - self.beta * (kl_groups - others)).reshape(adv.shape), kl

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        mask = batch["loss_mask"]
        logps = self.logps(forward, weights, batch, key)
        old = pg.old_logps(batch, logps, self.lag_corrected)
        completions = pg.completion_masks(batch)
        adv = pg.completion_advantages(batch, completions)
        ratio = jnp.exp(pg.per_completion((logps - old) * mask, completions))  # (rows, C): each sequence's ratio
        bounds = pg.ClipBounds.of(self.epsilon, self.epsilon_high)
        losses = pg.clipped_surrogate(ratio, adv, bounds)
        n = jnp.asarray(adv.size, jnp.float32)
        metrics = pg.sampler_agreement(batch, logps)
        tokens = jnp.sum(mask)
        kl = jnp.sum(batch[SEQUENCE_KL_KEY]) if SEQUENCE_KL_KEY in batch else jnp.zeros((), jnp.float32)
        metrics["kl"] = (kl, tokens)
        metrics.update(pg.clip_metrics(ratio, adv, bounds, n))
        return jnp.sum(losses), n, metrics
