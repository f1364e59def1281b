"""RLOO (REINFORCE leave-one-out, TRL's ``RLOOTrainer``): GRPO's rollout (the same sampler, rewards and rows), another
baseline and a per-sequence loss.

Advantages. The rollout gives each completion its reward less the mean reward of its group's other scorable
completions (`jaxtune.train.rewards.leave_one_out_advantages`; a completion every reward function declined is
unscorable: NaN, left out of the baselines). `RLOO.prepare`, on the whole batch before the step's first pass, puts
the KL to the reference into the reward (``beta`` > 0): kl_i = Σ_t (old_t - ref_t) over completion i's tokens, the
first-order estimate of the RLOO paper, with old the log-probs of the policy that sampled (the sampler's, or the
trainer's forward: ``old_logps``). The baseline being linear in the rewards, the advantage of r_i - β kl_i is
A_i - β (kl_i - mean of kl over the group's other scorable completions). With ``normalize_advantages`` the advantages
are then normalised over the whole batch ((A - mean) / (std + 1e-4), NaN left out, `trl.trainer.utils.nanstd`'s
Bessel-corrected std); unscorable completions end at 0.

Loss, per completion: with ρ = exp(Σ_t logp_t - Σ_t old_t) its sequence ratio, -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high)
A), averaged over completions. Metrics (TRL's names): ``kl`` (per completion token, of old - ref), ``clip_ratio/
low_mean``, ``/high_mean``, ``/region_mean`` (the share of completions whose ratio was clipped), and the sampler's
agreement with the trainer (``sampler_logp_diff/mean``, ``/max``) as for GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.config.kinds import SAMPLER_LOGPS_KEY
from jaxtune.train.objectives.base import Metrics, Reference
from jaxtune.train.objectives.grpo import GRPO, ROW_KEYS
from jaxtune.train.state import Batch, Forward

SEQUENCE_KL_KEY = "sequence_kl"  # what `RLOO.prepare` adds: each completion's Σ_t (old - ref), for the kl metric


@dataclass(frozen=True)
class RLOO(GRPO):
    name: str = "rloo"
    num_generations: int = 8
    normalize_advantages: bool = False
    prepares: bool = True

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> RLOO:
        return cls(beta=cfg.beta_value, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                   temperature=cfg.temperature, max_completion_length=cfg.max_completion_length, passes=cfg.passes,
                   old_from_sampler=cfg.old_logps == "sampler", num_generations=cfg.num_generations,
                   normalize_advantages=cfg.normalize_advantages)

    @staticmethod
    def completion_sums(batch: Batch) -> tuple[jax.Array, Any]:
        """Each completion's advantage, (rows, C), and ``per(x)``: x (rows, T) summed over each completion's tokens,
        (rows, C) (C = 1: a row per completion; C = G: a group in one row)."""
        _, completions = GRPO.token_advantages(batch)
        adv = batch["advantages"].reshape(completions.shape[:2])
        return adv, lambda x: jnp.sum(x[:, None, :] * completions, -1)

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """The final advantages on the whole batch: the KL to the reference in the reward (``beta`` > 0), the
        normalisation, unscorable completions at 0; and before several passes the old log-probs (`GRPO.prepare`)."""
        if self.passes > 1:
            batch = super().prepare(forward, weights, batch)
        adv, per = self.completion_sums(batch)
        mask = batch["loss_mask"]
        if self.beta > 0:
            if reference is None:
                raise ValueError("rloo with beta > 0 needs the reference model's log-probs")
            if "old_logps" in batch:
                old = batch["old_logps"]
            elif self.old_from_sampler and SAMPLER_LOGPS_KEY in batch:
                old = batch[SAMPLER_LOGPS_KEY]
            else:
                old = jax.lax.stop_gradient(self.logps(forward, weights, batch, None))
            ref = reference({k: batch[k] for k in ROW_KEYS if k in batch}, self.temperature)
            kl = jnp.where(reference.is_policy, 0.0, per((old - ref) * mask))  # exactly 0 while policy = reference
            groups = adv.reshape(-1, self.num_generations)  # each prompt's completions (contiguous rows, or a row)
            kl_groups = kl.reshape(groups.shape)
            scorable = ~jnp.isnan(groups)
            kl_sum = jnp.sum(jnp.where(scorable, kl_groups, 0.0), axis=1, keepdims=True)
            others = (kl_sum - kl_groups) / (jnp.sum(scorable, axis=1, keepdims=True) - 1)
            adv = (groups - self.beta * (kl_groups - others)).reshape(adv.shape)
            batch = {**batch, SEQUENCE_KL_KEY: kl}
        if self.normalize_advantages:
            scorable = ~jnp.isnan(adv)
            n = jnp.sum(scorable)
            mean = jnp.sum(jnp.where(scorable, adv, 0.0)) / n
            var = jnp.sum(jnp.where(scorable, (adv - mean) ** 2, 0.0)) / (n - 1)
            adv = (adv - mean) / (jnp.sqrt(var) + 1e-4)
        adv = jnp.nan_to_num(adv, nan=0.0)
        return {**batch, "advantages": adv.reshape(batch["advantages"].shape)}

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        mask = batch["loss_mask"]
        logps = self.logps(forward, weights, batch, key)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        adv, per = self.completion_sums(batch)
        ratio = jnp.exp(per((logps - old) * mask))  # (rows, C): each completion's sequence ratio
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        clipped = jnp.clip(ratio, 1.0 - self.epsilon, 1.0 + high)
        losses = -jnp.minimum(ratio * adv, clipped * adv)
        n = jnp.asarray(adv.size, jnp.float32)
        metrics: Metrics = {}
        _, completions = GRPO.token_advantages(batch)
        self.sampler_correction(batch, logps, old, completions, metrics)
        tokens = jnp.sum(mask)
        kl = jnp.sum(batch[SEQUENCE_KL_KEY]) if SEQUENCE_KL_KEY in batch else jnp.zeros((), jnp.float32)
        metrics["kl"] = (kl, tokens)
        fixed = jax.lax.stop_gradient(ratio)
        low = ((fixed < 1.0 - self.epsilon) & (adv < 0)).astype(jnp.float32)
        up = ((fixed > 1.0 + high) & (adv > 0)).astype(jnp.float32)
        metrics["clip_ratio/low_mean"] = (jnp.sum(low), n)
        metrics["clip_ratio/high_mean"] = (jnp.sum(up), n)
        metrics["clip_ratio/region_mean"] = (jnp.sum(jnp.maximum(low, up)), n)
        return jnp.sum(losses), n, metrics
