"""A reward model on preference pairs: TRL's ``RewardTrainer`` (Bradley-Terry), on a model with a score head.

The batch is the preference kind's (`jaxtune.train.objectives.preference`: (B, 2, T) rows, chosen then rejected,
``inputs`` the sequence less its last token, ``targets`` the sequence less its first). A sequence's reward is the
score head at its last real token, as transformers' *ForSequenceClassification reads it (the last token that is
not padding): the rows are rebuilt whole, first input then every target ((2B, T + 1) and up to a multiple of 4: the
last token, an end of turn, is never an input of the language-model rows), and scored in one forward under the
causal mask alone; with ``data.share_prompts`` (the default) a pair's row holds its prompt once and each branch's
last token one more position (`shared_sequences`). With r_c, r_r a pair's rewards and m its ``margin`` (TRL's
column; the batch's (B, 2) ``margin``, 0 where a row gives none)::

    loss = -log σ(r_c - r_r - m)  [+ center_rewards_coefficient · (r_c + r_r)²]

averaged over pairs (a padding pair, with no token, counts 0). Metrics (TRL's names): ``accuracy`` (r_c > r_r),
``margin`` (r_c - r_r), ``mean_reward`` (over both sequences) per pair; ``reward/min`` and ``reward/max`` over every
real sequence (TRL's ``min_reward``, ``max_reward``). Checked against TRL in ``tests/train/test_reward_model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtune.config import ObjectiveConfig
from jaxtune.config.kinds import BRANCH_KEY
from jaxtune.train.objectives.base import Metrics, Reference, Unprepared
from jaxtune.train.state import Batch, Forward

MARGIN_KEY = "margin"  # (B, 2): each pair's margin on both of its sequences (0 where its row gives none)


def whole_sequences(batch: Batch) -> tuple[Batch, jax.Array]:
    """The pair batch's sequences whole, as (2B, W) rows (chosen of pair b at row 2b, rejected at 2b + 1), W the
    T + 1 positions rounded up to a multiple of 4: ``inputs`` the first input then every target, then padding, and
    ``positions``; and (2B,) the index of each row's last real token. One sequence per row from position 0, so the
    plain causal mask is its mask (the padding only follows it): no segment ids, and the model's causal attention
    skips the masked blocks (a multiple of 4 positions: its query blocks)."""
    if BRANCH_KEY in batch:
        return shared_sequences(batch)
    flat = {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in ("inputs", "targets", "segment_ids")}
    segments = jnp.concatenate([flat["segment_ids"][:, :1], flat["segment_ids"]], axis=1)
    tokens = jnp.concatenate([flat["inputs"][:, :1], flat["targets"]], axis=1)
    width = -(-tokens.shape[1] // 4) * 4
    tokens = jnp.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    rows = {"inputs": tokens, "positions": jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape)}
    last = jnp.max(jnp.where(segments > 0, jnp.arange(segments.shape[1]), 0), axis=1)
    return rows, last


def shared_sequences(batch: Batch) -> tuple[Batch, jax.Array]:
    """`whole_sequences` of pairs laid out with their prompt shared ((B, L) rows: the prompt once, then the chosen
    completion (branch 1) and the rejected one (branch 2), `jaxtune.data.encoded.shared_row`): each branch's last
    token, a target only, is appended as one more position of its branch (its position number the next, its segment
    the row's), where the branch mask lets it see the prompt and its own completion, as in its sequence alone. The
    rows padded to a multiple of 4 positions; and (B, 2) the indices of the two appended positions."""
    inputs, targets, positions = batch["inputs"], batch["targets"], batch["positions"]
    segments, branches = batch["segment_ids"], batch[BRANCH_KEY]
    b, length = inputs.shape
    slots = jnp.arange(length)
    ends = [jnp.max(jnp.where((branches == k) & (segments > 0), slots, 0), axis=1)[:, None] for k in (1, 2)]
    pick = lambda x, at: jnp.take_along_axis(x, at, axis=1)
    width = -(-(length + 2) // 4) * 4
    pad = lambda x, extra: jnp.pad(jnp.concatenate([x, *extra], axis=1), ((0, 0), (0, width - length - 2)))
    ones = jnp.ones((b, 1), segments.dtype)
    rows = {"inputs": pad(inputs, [pick(targets, at) for at in ends]),
            "positions": pad(positions, [pick(positions, at) + 1 for at in ends]),
            "segment_ids": pad(segments, [ones, ones]),
            BRANCH_KEY: pad(branches, [ones, 2 * ones])}
    return rows, jnp.broadcast_to(jnp.array([length, length + 1]), (b, 2))


@dataclass(frozen=True)
class RewardModel(Unprepared):
    name: str = "reward"
    center_rewards_coefficient: float | None = None
    passes: int = 1
    prepares: bool = False
    metric_names: tuple[str, ...] = ("accuracy", "margin", "mean_reward", "reward/min", "reward/max")

    @classmethod
    def from_config(cls, cfg: ObjectiveConfig) -> RewardModel:
        return cls(center_rewards_coefficient=cfg.center_rewards_coefficient)

    def rewards(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None) -> jax.Array:
        """(B, 2) float32: each pair's chosen and rejected rewards, the score at each sequence's last token."""
        rows, last = whole_sequences(batch)
        scores = forward.scores(weights, rows, key)  # (2B, W), or (B, W) with shared prompts
        return jnp.take_along_axis(scores, last.reshape(scores.shape[0], -1), axis=1).reshape(-1, 2)

    def __call__(self, forward: Forward, weights: Any, batch: Batch, key: jax.Array | None,
                 reference: Reference | None = None) -> tuple[jax.Array, jax.Array, Metrics]:
        rewards = self.rewards(forward, weights, batch, key)
        real = (jnp.sum(batch["segment_ids"].reshape(rewards.shape[0], -1), axis=1) > 0).astype(jnp.float32)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        margin = batch[MARGIN_KEY][:, 0] if MARGIN_KEY in batch else jnp.zeros_like(chosen)
        loss = -jax.nn.log_sigmoid(chosen - rejected - margin)
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * (chosen + rejected) ** 2
        fixed = jax.lax.stop_gradient(rewards)
        diff = fixed[:, 0] - fixed[:, 1]
        on = real[:, None] > 0
        metrics: Metrics = {
            "accuracy": jnp.sum((diff > 0) * real),
            "margin": jnp.sum(diff * real),
            "mean_reward": jnp.sum(jnp.mean(fixed, axis=1) * real),
            "reward/min": jnp.min(jnp.where(on, fixed, jnp.inf)),
            "reward/max": jnp.max(jnp.where(on, fixed, -jnp.inf)),
        }
        return jnp.sum(loss * real), jnp.sum(real), metrics
