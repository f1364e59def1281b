"""GRPO (group relative policy optimisation): the policy-gradient loss on completions the loop sampled itself.

The batch (`jaxtune.rollout.rollout`) holds ``num_generations`` completions of each prompt as (N, T) rows (prompt then
completion, ``loss_mask`` on the completion's tokens and its end token) and each completion's ``advantages`` (N,):
its reward minus its group's mean, divided by the group's std unless ``scale_rewards`` is off. With shared prompts a
group is one row (``branch_ids``: the prompt once, then each completion) and ``advantages`` are (prompts, G); every
sum below is then per branch, so the losses are the separate rows'.

Per completion token, with the log-probs of the tempered distribution the tokens were sampled from
(logits / ``temperature``) and r = π(token) / π_old(token)::

    loss_t = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)  [+ beta * r * KL_t]
    KL_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                 (k3; r: TRL's bias correction)

π_old is the policy that sampled: the same weights on the first pass (r = 1, its gradient the plain policy
gradient), the weights before the step's first update on later passes (``num_iterations`` > 1: the batch's
``old_logps``, from `GRPO.prepare`). ``beta`` = 0 needs no reference model.

``importance_sampling_level`` (TRL's) is where r is taken: per token (``token``), or once per completion, GSPO's
s = exp(mean over its tokens of log π - log π_old) on each of its tokens, in the clip and the KL term alike; its
gradient flows through that mean (``sequence``, as TRL) or is each token's own, s_t = sg[s] · π(token) / sg[π(token)]
(``sequence_token``, the GSPO paper's GSPO-token: the same values). With one advantage per completion the two
policy terms have the same gradient (the paper's remark); the KL term's weight tells them apart. The clip metrics
then count completions, as TRL's do. GSPO averages as ``grpo``; the loss types that sum token losses weigh each
completion by its length.

How the token losses are averaged (``loss_type``, TRL's names): ``grpo``, each completion's mean, then the mean over
completions; ``dapo``, the mean over every completion token of the batch; ``dr_grpo``, the sum over completion tokens
divided by (completions × ``max_completion_length``); ``luspo`` (LUSPO, made for a ``sequence`` ratio: GSPO's loss
with each completion counted by its length), each completion's sum, then the mean over completions. Each is a sum and
a count here, so micro-batches add up to the whole batch's value. ``bnpo`` is TRL's name for a token mean per
micro-batch (then the mean over micro-batches); here micro-batches add their sums and counts exactly, so its token mean
is the whole batch's: ``dapo``'s, and TRL's ``bnpo`` when the batch is one micro-batch. It is accepted under its name
for configs written for TRL, and computed as ``dapo``.

``cispo`` (MiniMax-M1's CISPO, as ScaleRL and TRL run it) clips the importance weight instead of the update: every
token keeps its gradient, weighted by its ratio capped at ``epsilon_high`` (an absolute cap, ε_max, not 1 + ε) and
held constant, ``loss_t = -stop_gradient(min(r, epsilon_high)) * A * log π(token)``, averaged as ``dapo``; its metric
``cispo_clip_ratio`` is the share of completion tokens with a positive advantage whose ratio was capped.

``sapo`` (SAPO, as TRL runs it) replaces the clip by a soft gate: ``loss_t = -(4 / τ) · σ(τ (r - 1)) · A``, with
τ = ``sapo_temperature_pos`` where A > 0 and ``sapo_temperature_neg`` elsewhere. At r = 1 its gradient is PPO's
(the gate's slope there is 4 σ'(0) = 1); away from 1 the gradient fades smoothly instead of stopping at the clip,
faster for the larger τ (negative advantages get the larger by default: their updates destabilise more). Averaged as
``grpo``; nothing is clipped, so it logs no clip ratios.

``vespo`` (VESPO, as TRL runs it) weighs each token's log-prob by a smooth function of its completion's sequence
ratio w = Π_t r_t (times the sampler's token weights when ``importance_sampling`` corrects for them, instead of
multiplying the loss): ``loss_t = -φ(w) · A · log π(token)``, φ(w) = e^λ w^k e^(-λ w) held constant, 1 at w = 1 and
falling on both sides (k how fast below 1, λ above), with ``vespo_k_pos``/``vespo_lambda_pos`` where A >= 0 and
``vespo_k_neg``/``vespo_lambda_neg`` where A < 0. It replaces the clip, so it logs the mean φ per completion
(``vespo/phi_seq_mean``) instead of clip ratios; averaged as ``dapo``; ``importance_sampling_level`` then weighs only
the KL term.

``off_policy_mask_threshold`` (TRL's OPSM) drops from the policy loss each completion with A < 0 whose mean over
its tokens of log π_sampler - log π exceeds it. ``top_entropy_quantile`` ρ < 1 keeps in the policy loss only the
tokens whose entropy H_t (of the tempered distribution) is at least the (1 - ρ) quantile of the (micro-)batch's
completion tokens'; ``entropy_coef`` c subtracts c · mean H_t over the tokens the policy loss acts on, whatever the
normalisation (the step divides the sum by the count, so the sum takes c · mean H · count). The entropy is computed
only when either is on, and then logged as ``entropy``.

``use_adaptive_entropy`` (Skywork-OR1's adaptive entropy control, TRL's rule) makes c state: the train state carries
it from update to update (`base.initial_carry`; a resumed run goes on with the same c), starting at ``entropy_coef``.
After each optimizer update, H, the mean entropy over the tokens the policy loss acted on in the whole batch (every
micro-batch and process), moves c by ``entropy_coef_delta`` within [``entropy_coef_min``, ``entropy_coef_max``]: up
where H <= ``entropy_target``, down elsewhere. An update applies c only when the H of the update before was at or
below the target (none on the first); ``entropy_coef`` logs c after the update. A batch with no completion token
measures nothing and leaves c as it was. Held-out batches read the initial carry, so their loss is the policy loss.

``delta`` (INTELLECT-2's two-sided clipping, TRL's key) caps the unclipped term's ratio, -min(min(r, delta) A,
clip(r) A), so a negative advantage's loss stays bounded however far r runs above 1; the clip metrics are the plain
ratio's. ``kl_bias_correction`` off (TRL's ``use_bias_correction_kl=False``) drops the ratio from the KL term.

Metrics (TRL's names): ``kl`` (mean per completion token, of r * KL_t as in the loss), ``clip_ratio/low_mean``,
``clip_ratio/high_mean`` and ``clip_ratio/region_mean`` (the share of completion tokens, or of completions at
sequence level, whose ratio was clipped below, above, either). What RLOO does the same way (the old log-probs, the
clip, its metrics) is `policy_gradient`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.config import OBJECTIVES, ObjectiveConfig
from jaxtune.config.kinds import SAMPLER_LOGPS_KEY
from jaxtune.train.objectives import policy_gradient as pg
from jaxtune.train.objectives.advantages import Rewarded, group_advantages, normalized_then_summed
from jaxtune.train.objectives.base import Metrics, Reference
from jaxtune.train.state import Batch, Forward

LOSS_TYPES = OBJECTIVES["grpo"].loss_types
# VESPO's log sequence ratio is cut to [log 1e-8, 20] (TRL's bounds), its token log-ratios to ±20: the weight stays
# finite, and a sampler weight masked to 0 counts as 1e-8, not -inf.
LOG_FLOOR, LOG_CEILING = math.log(1e-8), 20.0
# Adaptive entropy control's carry (`GRPO.init_carry`): the weight c, and the entropy the last update measured
ENTROPY_COEF, LAST_ENTROPY = "adaptive_entropy/coef", "adaptive_entropy/last_entropy"
POLICY_TOKENS_ENTROPY = "entropy/policy_tokens"  # its measure when only the high-entropy tokens carry the loss


class Ratio(NamedTuple):
    """The policy ratio π / π_old at ``importance_sampling_level``: ``tokens``, what each token's loss weighs ((N, T),
    or (N, 1) where a row's completion has one); and where its clip metrics count it, as TRL's: ``units`` with their
    advantages ``adv``, those ``mask`` keeps (None: every one), ``count`` of them: each completion token, or each
    completion ((rows, C)) at sequence level."""

    tokens: jax.Array
    units: jax.Array
    adv: jax.Array
    mask: jax.Array | None
    count: jax.Array

    def share(self, hit: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The share of counted units where ``hit`` (bool, shaped like ``units``), as (sum, count)."""
        fixed = jax.lax.stop_gradient(hit.astype(jnp.float32))
        return jnp.sum(fixed) if self.mask is None else jnp.sum(fixed * self.mask), self.count


@dataclass(frozen=True)
class GRPO(pg.Clipped):
    name: str = "grpo"
    loss_type: str = "dapo"
    prepares: bool = False  # the old log-probs are needed only before several passes
    importance_sampling: str = "off"  # TRL's vllm_importance_sampling_mode, or off
    importance_sampling_max: float | None = 3.0
    importance_sampling_min: float | None = None
    importance_sampling_level: str = "token"  # TRL's: where the policy ratio is taken (see the module)
    sapo_temperature_pos: float = 1.0  # sapo's gate temperature where A > 0
    sapo_temperature_neg: float = 1.05  # and where A <= 0
    vespo_k_pos: float = 2.0  # vespo's gamma weight where A >= 0: power k, decay lambda
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # and where A < 0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None  # OPSM: drop A < 0 completions whose sampler KL exceeds this
    top_entropy_quantile: float = 1.0  # < 1: only the tokens of the top fraction of entropy carry the policy loss
    delta: float | None = None  # two-sided clipping: the unclipped ratio's cap
    kl_bias_correction: bool = True  # the KL term weighted by the ratio (TRL's use_bias_correction_kl)
    entropy_coef: float = 0.0  # the entropy bonus's weight (with adaptive_entropy: its initial value)
    adaptive_entropy: bool = False  # the weight moves with the entropy measured (see the module)
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> GRPO:
        return cls(**cls.clipped_keys(cfg), loss_type=cfg.loss_type_value,
                   importance_sampling=cfg.importance_sampling,
                   importance_sampling_max=cfg.importance_sampling_max,
                   importance_sampling_min=cfg.importance_sampling_min,
                   importance_sampling_level=cfg.importance_sampling_level,
                   sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                   vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                   vespo_lambda_neg=cfg.vespo_lambda_neg, off_policy_mask_threshold=cfg.off_policy_mask_threshold,
                   top_entropy_quantile=cfg.top_entropy_quantile, entropy_coef=cfg.entropy_coef,
                   adaptive_entropy=cfg.use_adaptive_entropy, entropy_coef_min=cfg.entropy_coef_min,
                   entropy_coef_max=cfg.entropy_coef_max, entropy_coef_delta=cfg.entropy_coef_delta,
                   entropy_target=cfg.entropy_target, delta=cfg.delta,
                   kl_bias_correction=cfg.use_bias_correction_kl)

    @staticmethod
    def advantages(cfg: ObjectiveConfig, rewarded: Rewarded) -> tuple[np.ndarray, np.ndarray]:
        """Each completion's advantage and whether the std it was scaled by is 0: the reward less its group's mean,
        over the std ``scale_rewards`` names; or GDPO's per-function normalisation then sum
        (``multi_objective_aggregation: normalize_then_sum``)."""
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            return normalized_then_summed(rewarded.per_function, rewarded.weights, rewarded.group)
        return group_advantages(rewarded.scored, rewarded.group, cfg.scale_rewards)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"objective.loss_type={self.loss_type!r}: grpo takes one of {', '.join(LOSS_TYPES)}")

    @property
    def bonus(self) -> bool:
        """Whether the loss has an entropy bonus (a weight, or one that adapts)."""
        return self.entropy_coef != 0.0 or self.adaptive_entropy

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss reads each token's entropy (the entropy mask or bonus): only then is it computed."""
        return self.top_entropy_quantile < 1.0 or self.bonus

    @property
    def measured_entropy(self) -> str:
        """The metric adaptive entropy control reads: the mean entropy over the tokens the policy loss acts on."""
        return "entropy" if self.top_entropy_quantile >= 1.0 else POLICY_TOKENS_ENTROPY

    @property
    def metric_names(self) -> tuple[str, ...]:
        entropy = ("entropy",) if self.needs_entropy else ()
        entropy += ("policy_loss", "entropy_coef") if self.bonus else ()
        entropy += (POLICY_TOKENS_ENTROPY,) if self.adaptive_entropy and self.measured_entropy != "entropy" else ()
        if self.loss_type == "sapo":  # a gate, nothing clipped
            return ("kl", *entropy)
        if self.loss_type == "vespo":
            return ("kl", "vespo/phi_seq_mean", *entropy)
        clipped = ("cispo_clip_ratio",) if self.loss_type == "cispo" else (
            "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
        return ("kl", *clipped, *entropy)

    def ratio(self, logps: jax.Array, old: jax.Array, batch: Batch, adv: jax.Array, completions: jax.Array,
              tokens: jax.Array) -> Ratio:
        """π / π_old at ``importance_sampling_level``: each token's, or each completion's exp of its tokens' mean
        log-ratio (GSPO's s), whose gradient flows through that mean (``sequence``) or is each token's own
        (``sequence_token``: sg[s] · π(token) / sg[π(token)]). ``adv`` the tokens' advantages, ``tokens`` their
        count."""
        mask = batch["loss_mask"]
        if self.importance_sampling_level == "token":
            ratio = jnp.exp(logps - old)
            return Ratio(ratio, ratio, adv, mask, tokens)
        per = jnp.exp(pg.completion_means((logps - old) * mask, mask, completions))  # (rows, C)
        on_tokens = pg.on_tokens(per, completions)
        if self.importance_sampling_level == "sequence_token":
            on_tokens = jax.lax.stop_gradient(on_tokens) * jnp.exp(logps - jax.lax.stop_gradient(logps))
        per_adv = pg.completion_advantages(batch, completions)
        return Ratio(on_tokens, per, per_adv, None, jnp.asarray(per_adv.size, jnp.float32))

    def surrogate(self, logps: jax.Array, ratio: Ratio, adv: jax.Array) -> tuple[jax.Array, Metrics]:
        """Each token's policy-gradient loss before the KL term, and its clip metrics: PPO's clipped ratio, CISPO's
        capped weight on the log-prob, or SAPO's gate (see the module)."""
        if self.loss_type == "sapo":
            tau = jnp.where(adv > 0, self.sapo_temperature_pos, self.sapo_temperature_neg)
            return -jax.nn.sigmoid(tau * (ratio.tokens - 1.0)) * (4.0 / tau) * adv, {}
        if self.loss_type == "cispo":
            cap = self.epsilon_high
            per_token = -jax.lax.stop_gradient(jnp.minimum(ratio.tokens, cap)) * adv * logps
            return per_token, {"cispo_clip_ratio": ratio.share((ratio.units > cap) & (ratio.adv > 0))}
        bounds = pg.ClipBounds.of(self.epsilon, self.epsilon_high)
        return pg.clipped_surrogate(ratio.tokens, adv, bounds, self.delta), pg.clip_metrics(
            ratio.units, ratio.adv, bounds, ratio.count, ratio.mask)

    def gamma_weighted(self, logps: jax.Array, old: jax.Array, adv: jax.Array, batch: Batch, completions: jax.Array,
                       weight: jax.Array | None) -> tuple[jax.Array, Metrics]:
        """VESPO's loss per token, -φ(w) · A · log π(token), and ``vespo/phi_seq_mean``: φ(w) = e^λ w^k e^(-λ w), held
        constant, of its completion's sequence ratio w = Π π / π_old over its tokens, times the sampler's token
        weights ``weight`` (if any); k and λ by the sign of A (``adv``, the tokens')."""
        mask = batch["loss_mask"]
        log_ratio = jnp.clip(jax.lax.stop_gradient(logps) - old, -LOG_CEILING, LOG_CEILING) * mask
        log_w = pg.per_completion(log_ratio, completions)  # (rows, C)
        if weight is not None:
            log_w = log_w + pg.per_completion(jnp.clip(jnp.log(weight), LOG_FLOOR, LOG_CEILING) * mask, completions)
        log_w = jnp.clip(log_w, LOG_FLOOR, LOG_CEILING)
        gains = pg.completion_advantages(batch, completions) >= 0
        k = jnp.where(gains, self.vespo_k_pos, self.vespo_k_neg)
        lam = jnp.where(gains, self.vespo_lambda_pos, self.vespo_lambda_neg)
        phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))  # (rows, C); 1 at w = 1
        per_token = -pg.on_tokens(phi, completions) * adv * logps
        return per_token, {"vespo/phi_seq_mean": (jnp.sum(phi), jnp.asarray(phi.size, jnp.float32))}

    def off_policy_mask(self, logps: jax.Array, old: jax.Array, batch: Batch, completions: jax.Array) -> jax.Array:
        """OPSM (DeepSeek-V3.2's off-policy sequence mask, TRL's rule): 0 on the tokens of each completion whose
        advantage is < 0 and whose mean over its tokens of log π_sampler - log π (held constant; a NaN gap counts as 0)
        exceeds ``off_policy_mask_threshold``, else 1. π_sampler is the sampler's own log-probs when the batch carries
        them, else ``old``: both the drift of the weights since sampling and the sampler's own mismatch."""
        mask = batch["loss_mask"]
        sampler = batch.get(SAMPLER_LOGPS_KEY, old)
        gap = jnp.nan_to_num(sampler - jax.lax.stop_gradient(logps), nan=0.0) * mask
        drift = pg.completion_means(gap, mask, completions)  # (rows, C)
        keep = (pg.completion_advantages(batch, completions) >= 0) | (drift <= self.off_policy_mask_threshold)
        return pg.on_tokens(keep.astype(jnp.float32), completions)

    def logps_and_entropy(self, forward: Forward, weights: Any, batch: Batch,
                          key: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """`logps`, and each position's (N, T) entropy of the tempered distribution, from the same logits, when the
        loss reads it (`needs_entropy`; else None, and the program computes none)."""
        if not self.needs_entropy:
            return self.logps(forward, weights, batch, key), None
        return forward.token_logps_and_entropy(weights, pg.rows(batch), key, self.temperature)

    def high_entropy_mask(self, entropy: jax.Array, mask: jax.Array) -> jax.Array:
        """1 on the completion tokens whose entropy is at least the (1 - ``top_entropy_quantile``) quantile (linear
        interpolation) of the entropies of the batch's completion tokens (the micro-batch the loss sees, across
        devices), 0 elsewhere (TRL's rule)."""
        fixed = jax.lax.stop_gradient(entropy)
        cut = jnp.nanquantile(jnp.where(mask > 0, fixed, jnp.nan), 1.0 - self.top_entropy_quantile)
        return ((fixed >= cut) & (mask > 0)).astype(jnp.float32)

    def entropy_bonus(self, coef: jax.Array | float, entropy: jax.Array, on: jax.Array,
                      count: jax.Array) -> jax.Array:
        """What the bonus takes off the summed loss: ``coef`` times the mean entropy over the tokens ``on`` (the
        completion tokens the policy loss acts on), times ``count``, so that the step's division by the count leaves
        L_policy - coef * H (TRL's, whatever the loss type's normalisation)."""
        return coef * jnp.sum(entropy * on) / jnp.maximum(jnp.sum(on), 1.0) * count

    def init_carry(self) -> dict[str, float]:
        """Adaptive entropy control's state before the first update: c, and no entropy measured yet (+inf)."""
        return {ENTROPY_COEF: self.entropy_coef, LAST_ENTROPY: math.inf} if self.adaptive_entropy else {}

    def applied_entropy_coef(self, batch: Batch) -> jax.Array | float:
        """The bonus's weight this update: ``entropy_coef``, or the carried c where the entropy the update before
        measured was at or below ``entropy_target`` (else 0)."""
        if not self.adaptive_entropy:
            return self.entropy_coef
        return jnp.where(batch[LAST_ENTROPY] <= self.entropy_target, batch[ENTROPY_COEF], 0.0)

    def advance(self, carry: dict[str, jax.Array], means: dict[str, jax.Array]) -> tuple[dict[str, jax.Array],
                                                                                        dict[str, jax.Array]]:
        """After an update (``means``: its metrics over the whole batch): c one ``entropy_coef_delta`` up where the
        entropy the loss acted on was at or below ``entropy_target``, else down, within [min, max], and that entropy
        remembered; nothing moves where no token was measured. Logs the new c as ``entropy_coef``."""
        if not self.adaptive_entropy:
            return carry, {}
        h, coef = means[self.measured_entropy], carry[ENTROPY_COEF]
        moved = jnp.where(h <= self.entropy_target, jnp.minimum(coef + self.entropy_coef_delta, self.entropy_coef_max),
                          jnp.maximum(coef - self.entropy_coef_delta, self.entropy_coef_min))
        seen = jnp.isfinite(h)
        carry = {ENTROPY_COEF: jnp.where(seen, moved, coef), LAST_ENTROPY: jnp.where(seen, h, carry[LAST_ENTROPY])}
        return carry, {"entropy_coef": carry[ENTROPY_COEF]}

    def averaged(self, per_token: jax.Array, batch: Batch, completions: jax.Array,
                 tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The token losses as (sum, count) by ``loss_type`` (see the module)."""
        mask = batch["loss_mask"]
        summed = per_token * mask
        n = jnp.asarray(batch["advantages"].size, jnp.float32)  # completions
        if self.loss_type in ("grpo", "sapo"):  # each completion's mean token loss
            return jnp.sum(pg.completion_means(summed, mask, completions)), n
        if self.loss_type == "dr_grpo":
            return jnp.sum(summed), n * self.max_completion_length
        if self.loss_type == "luspo":  # each completion's summed token loss
            return jnp.sum(summed), n
        return jnp.sum(summed), tokens  # dapo, bnpo (see the module), cispo, vespo

    def prepare(self, forward: Forward, weights: Any, batch: Batch, reference: Reference | None = None) -> Batch:
        """Before the first of several passes: the sampling policy's log-probs, fixed for every pass (``old_logps``):
        the sampler's own (``old_from_sampler``, no forward pass) or the trainer's forward with the weights as they
        were."""
        return pg.with_old_logps(forward, weights, batch, self.temperature, self.old_from_sampler)

    def importance_weight(self, batch: Batch, old: jax.Array, completions: jax.Array) -> tuple[jax.Array, Metrics]:
        """With ``importance_sampling`` (and the sampler's log-probs in the batch), the weight of each token's loss:
        r = exp(old - sampler) per token, or per completion (the mean over its tokens), truncated to or masked outside
        [min, max] (TRL's modes), ``old`` being the trainer's log-probs of the policy that sampled; and its
        ``importance_sampling_ratio/mean``, ``/min`` and ``/max`` over completion tokens, and ``/cut_fraction``: the
        share of those whose ratio fell outside [min, max] (truncated, or masked)."""
        mask, sampler = batch["loss_mask"], batch[SAMPLER_LOGPS_KEY]
        gap = jax.lax.stop_gradient(old - sampler) * mask
        if self.importance_sampling.startswith("sequence"):  # each completion's mean gap, on its tokens
            # (the geometric mean of its token ratios, as GSPO's sequence ratio: a sum's spread would grow with the
            # completion's length, and the cap would cut most long completions)
            gap = pg.on_tokens(pg.completion_means(gap, mask, completions), completions)
        ratio = jnp.exp(gap)
        lo = -jnp.inf if self.importance_sampling_min is None else self.importance_sampling_min
        hi = jnp.inf if self.importance_sampling_max is None else self.importance_sampling_max
        cut = ((ratio < lo) | (ratio > hi)) * mask
        if self.importance_sampling.endswith("truncate"):
            ratio = jnp.clip(ratio, lo, hi)
        else:
            ratio = jnp.where((ratio < lo) | (ratio > hi), 0.0, ratio)
        metrics: Metrics = {
            "importance_sampling_ratio/mean": (jnp.sum(ratio * mask), jnp.sum(mask)),
            "importance_sampling_ratio/min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
            "importance_sampling_ratio/max": jnp.max(jnp.where(mask > 0, ratio, -jnp.inf)),
            "importance_sampling_ratio/cut_fraction": (jnp.sum(cut), jnp.sum(mask)),
        }
        return ratio, metrics

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        mask = batch["loss_mask"]
        logps, entropy = self.logps_and_entropy(forward, weights, batch, key)
        old = pg.old_logps(batch, logps, self.lag_corrected)
        adv, completions = pg.token_advantages(batch), pg.completion_masks(batch)
        tokens = jnp.sum(mask)
        ratio = self.ratio(logps, old, batch, adv, completions, tokens)
        metrics, weight = pg.sampler_agreement(batch, logps), None
        if metrics and self.importance_sampling != "off":
            weight, weight_metrics = self.importance_weight(batch, old, completions)
            metrics.update(weight_metrics)
        if self.loss_type == "vespo":  # the sampler's weights enter its sequence ratio (TRL's), not the loss
            per_token, policy_metrics = self.gamma_weighted(logps, old, adv, batch, completions, weight)
        else:
            per_token, policy_metrics = self.surrogate(logps, ratio, adv)
            per_token = per_token if weight is None else per_token * weight
        if self.off_policy_mask_threshold is not None:
            per_token = per_token * self.off_policy_mask(logps, old, batch, completions)
        high = None if self.top_entropy_quantile >= 1.0 else self.high_entropy_mask(entropy, mask)
        per_token = per_token if high is None else per_token * high
        if self.beta > 0:
            kl = pg.k3_kl(logps, batch, reference, self.temperature, self.name)
            kl = kl * ratio.tokens if self.kl_bias_correction else kl  # TRL's bias correction: weighted by the ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = (jnp.sum(jax.lax.stop_gradient(kl) * mask), tokens)
        else:
            metrics["kl"] = (jnp.zeros((), jnp.float32), tokens)
        metrics.update(policy_metrics)
        total, count = self.averaged(per_token, batch, completions, tokens)
        if entropy is not None:
            metrics["entropy"] = (jnp.sum(jax.lax.stop_gradient(entropy) * mask), tokens)
        if self.bonus:
            on = mask if high is None else mask * high
            metrics["policy_loss"] = (jax.lax.stop_gradient(total), count)
            if not self.adaptive_entropy:  # else the step logs the carried weight after the update (`advance`)
                metrics["entropy_coef"] = (jnp.asarray(self.entropy_coef, jnp.float32), jnp.ones((), jnp.float32))
            elif high is not None:
                metrics[POLICY_TOKENS_ENTROPY] = (jnp.sum(jax.lax.stop_gradient(entropy) * on), jnp.sum(on))
            total = total - self.entropy_bonus(self.applied_entropy_coef(batch), entropy, on, count)
        return total, count, metrics
