"""The advantage estimators objectives call on a step's rewards (`Rewarded`), on the host, over every process's
completions, each prompt's ``num_generations`` contiguous: GRPO's group normalisation (`group_advantages`, with
``scale_rewards``), GDPO's aggregation (`normalized_then_summed`), RLOO's leave-one-out (`leave_one_out_advantages`),
and the informative-group test of dynamic sampling (`informative_groups`). An objective that samples says how its
advantages come from the rewards in its own ``advantages(cfg, rewarded)`` (`jaxtune.train.objectives.base`); the
rollout calls it and lays the result out in the batch. A new baseline is then a function in its objective's module.

NaN follows TRL: a reward function's None ("does not apply") is NaN in its column; a completion no function scored is
NaN in ``scored`` and left out of the means and stds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Rewarded:
    """A step's completions' rewards, every process's, each prompt's ``group`` completions contiguous."""

    per_function: np.ndarray  # (N, K): one column per reward function, NaN where it declined
    total: np.ndarray  # (N,): the weighted sum (NaN left out, TRL's nansum)
    scored: np.ndarray  # (N,): ``total`` with NaN where no function scored the completion
    weights: np.ndarray  # (K,): the functions' weights
    group: int  # completions per prompt

    @property
    def n(self) -> int:
        return int(self.total.shape[0])


def informative_groups(scored: np.ndarray, group: int) -> np.ndarray:
    """(groups,) bool: whether a group's rewards differ (std > 0), so its group-relative advantages are not all 0
    (dynamic sampling's filter)."""
    std = nanstd(np.asarray(scored, np.float64).reshape(-1, group), axis=1)[:, 0]
    return ~np.isclose(np.nan_to_num(std), 0.0)


def zero_advantages(rewarded: Rewarded) -> tuple[np.ndarray, None]:
    """No baseline: every advantage 0 (a companion, not a reward, says how good a token is; rewards are logged)."""
    return np.zeros(rewarded.n, np.float32), None


def _nanmean(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The mean over ``axis`` (kept) ignoring NaN: NaN where no value counts (no warning)."""
    count = (~np.isnan(x)).sum(axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.nansum(x, axis=axis, keepdims=True) / count, np.nan)


def nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The unbiased std over ``axis`` (kept) ignoring NaN (TRL's ``nanstd``): NaN where fewer than 2 values count."""
    count = (~np.isnan(x)).sum(axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        variance = np.nansum((x - _nanmean(x, axis)) ** 2, axis=axis, keepdims=True) / (count - 1)
    return np.sqrt(np.where(count > 1, variance, np.nan))


def _grouped(total: np.ndarray, group: int) -> np.ndarray:
    total = np.asarray(total, np.float64)
    if total.ndim != 1 or group < 1 or total.size % group:
        raise ValueError(f"group_advantages needs (n_prompts * group,) rewards; got shape {total.shape} for "
                         f"group={group}")
    return total.reshape(-1, group)  # (P, G)


SCALES = {True: "group", False: "none"}  # scale_rewards as a bool (TRL's former form)


def group_advantages(total: np.ndarray, group: int, scale: bool | str = "group") -> tuple[np.ndarray, np.ndarray]:
    """(N,) float32 advantages of (N,) total rewards, each prompt's ``group`` completions contiguous, and (N,) bool
    whether the std they were scaled by (or would have been) is 0 (TRL's ``frac_reward_zero_std``): the reward less
    its group's mean, divided by the std + 1e-4 of its group (``scale`` "group"), of the whole batch ("batch") or not
    ("none"), the unbiased std as TRL's. A NaN total (a completion no function could score) is left out of the means
    and stds and its advantage is 0, as is every advantage of a group with no scorable completion."""
    scale = SCALES.get(scale, scale) if isinstance(scale, bool) else scale
    grouped = _grouped(total, group)
    if scale != "none" and grouped.size < 2:
        raise ValueError(f"group_advantages with scale={scale} needs 2 completions or more (the std of one is "
                         "undefined)")
    std = nanstd(grouped) if scale == "batch" else nanstd(grouped, axis=1) if group > 1 else np.zeros_like(grouped)
    advantages = grouped - _nanmean(grouped, axis=1)
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = np.isclose(np.broadcast_to(std, grouped.shape), 0.0)
    return np.nan_to_num(advantages, nan=0.0).reshape(-1).astype(np.float32), zero_std.reshape(-1)


def normalized_then_summed(per_function: np.ndarray, weights: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """GDPO's aggregation (TRL's ``multi_objective_aggregation: normalize_then_sum``): each function's scores less its
    group's mean over its group's std + 1e-4 (NaN, "does not apply", left out), summed with the weights, then the sums
    normalised over the whole batch; a completion no function scored gets 0. Returns (N,) advantages and (N,) whether
    the batch's std is 0, as `group_advantages`."""
    per_function = np.asarray(per_function, np.float64)
    n, k = per_function.shape
    grouped = per_function.reshape(-1, group, k)  # (P, G, K)
    std = nanstd(grouped, axis=1) if group > 1 else np.zeros((len(grouped), 1, k))
    normalized = (grouped - _nanmean(grouped, axis=1)) / (std + 1e-4)
    summed = np.nansum(normalized * np.asarray(weights, np.float64), axis=2).reshape(-1)
    summed[np.isnan(per_function).all(axis=1)] = np.nan
    return group_advantages(summed, n, "batch")


def leave_one_out_advantages(total: np.ndarray, per_function: np.ndarray, group: int) -> np.ndarray:
    """(N,) float32 RLOO advantages (TRL's RLOOTrainer): each completion's reward less the mean of its group's other
    scorable completions, each prompt's ``group`` completions contiguous. A completion that every reward function
    declined (all NaN in ``per_function``, a TRL-form function's None) is unscorable: left out of its group's
    baselines, and its advantage NaN (zeroed once the KL penalty and the normalisation are applied)."""
    total = np.asarray(total, np.float64).copy()
    if total.ndim != 1 or group < 2 or total.size % group:
        raise ValueError(f"leave_one_out_advantages needs (n_prompts * group,) rewards with group >= 2; got shape "
                         f"{total.shape} for group={group}")
    per_function = np.asarray(per_function, np.float64).reshape(total.size, -1)
    if per_function.shape[1]:
        total[np.isnan(per_function).all(axis=1)] = np.nan
    grouped = total.reshape(-1, group)
    scorable = (~np.isnan(grouped)).sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):  # a group with one scorable completion: 0 / 0, NaN
        baselines = (np.nansum(grouped, axis=1, keepdims=True) - grouped) / (scorable - 1)
    return (grouped - baselines).reshape(-1).astype(np.float32)
