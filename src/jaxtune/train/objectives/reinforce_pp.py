"""REINFORCE++ (Hu et al., arXiv 2501.03262, OpenRLHF's ``reinforce++``): GRPO's rollout (the same sampler, rewards
and rows) with a baseline of the whole batch instead of each group, and PPO's clipped token loss.

Advantages. `ReinforcePP.advantages`, called by the rollout on every process's completions of the step: each
completion's reward less the mean over the step's scorable completions, divided by their std + 1e-4 (Bessel-corrected,
as TRL's ``nanstd``). A completion every reward function declined is unscorable: left out of the mean and std, its
advantage 0. It is the group baseline with the whole step one group (`advantages.group_advantages` with the batch as
the group and ``scale="batch"``), so it needs 2 completions in the step, from one prompt or several, and no group of
its own: ``num_generations`` 1 is allowed.

Loss, per completion token, with r = π(token) / π_old(token) of the tempered distribution (π_old the policy that
sampled: the same weights on one on-policy pass, ``old_logps`` before several passes, the sampler's when the rollout
lags, as every clipped objective's, `policy_gradient.old_logps`)::

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)  [+ beta * KL_t, k3: `policy_gradient.k3_kl`]

averaged over every completion token of the step. Metrics (TRL's names): ``kl`` (mean per completion token),
``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` (shares of completion tokens), and the sampler's agreement
(``sampler_logp_diff/mean``, ``/max``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives import policy_gradient as pg
from jaxtune.train.objectives.advantages import Rewarded, group_advantages
from jaxtune.train.objectives.base import Metrics, Reference
from jaxtune.train.state import Batch, Forward


@dataclass(frozen=True)
class ReinforcePP(pg.Clipped):
    name: str = "reinforce_pp"
    prepares: bool = False  # the old log-probs are needed only before several passes
    metric_names: tuple[str, ...] = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> ReinforcePP:
        return cls(**cls.clipped_keys(cfg))

    @staticmethod
    def advantages(cfg: ObjectiveConfig, rewarded: Rewarded) -> tuple[np.ndarray, np.ndarray]:
        """Each completion's reward less the step's mean, over the step's std + 1e-4 (unscorable: 0), and whether
        that std is 0."""
        return group_advantages(rewarded.scored, rewarded.n, "batch")

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """Before the first of several passes: the sampling policy's log-probs, fixed for every pass."""
        return pg.with_old_logps(forward, weights, batch, self.temperature, self.old_from_sampler)

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        mask = batch["loss_mask"]
        logps = self.logps(forward, weights, batch, key)
        ratio = jnp.exp(logps - pg.old_logps(batch, logps, self.lag_corrected))
        adv = pg.token_advantages(batch)
        bounds = pg.ClipBounds.of(self.epsilon, self.epsilon_high)
        per_token = pg.clipped_surrogate(ratio, adv, bounds)
        tokens = jnp.sum(mask)
        metrics = pg.sampler_agreement(batch, logps)
        kl = jnp.zeros_like(logps)
        if self.beta > 0:
            kl = pg.k3_kl(logps, batch, reference, self.temperature, self.name)
            per_token = per_token + self.beta * kl
        metrics["kl"] = (jnp.sum(jax.lax.stop_gradient(kl) * mask), tokens)
        metrics.update(pg.clip_metrics(ratio, jnp.broadcast_to(adv, ratio.shape), bounds, tokens, mask))
        return jnp.sum(per_token * mask), tokens, metrics
