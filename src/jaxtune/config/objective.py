"""The ``objective`` section: one record per objective (`OBJECTIVES`: the batch kinds it trains on, which keys apply,
its loss types and defaults), the section's keys, and the reward functions'. A new objective is its record here (and
its keys, when it has new ones), its class in `jaxtune.train.objectives`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from jaxtune.config.base import Section
from jaxtune.config.kinds import PAIRS, PROMPTS, ROWS, WINDOWS, BatchKind


@dataclass(frozen=True)
class ObjectiveKind:
    """One objective. ``kinds``: the batch kinds it trains on. ``keys``: the ``objective.*`` keys that apply to it
    (besides ``name``). ``loss_types``: its ``objective.loss_type`` values, the default first (empty: it has none).
    ``default_beta``: ``objective.beta`` when unset. ``reference``: whether it compares with a reference model,
    ``always`` or ``when_beta`` (> 0). ``passes_key``: the key counting optimisation passes per batch, if any."""

    name: str
    kinds: tuple[BatchKind, ...]
    description: str
    keys: frozenset[str] = frozenset()
    loss_types: tuple[str, ...] = ()
    default_beta: float | None = None
    reference: Literal["never", "always", "when_beta"] = "never"
    passes_key: str | None = None

    @property
    def default_loss_type(self) -> str | None:
        return self.loss_types[0] if self.loss_types else None


_GRPO_KEYS = frozenset({"beta", "loss_type", "num_generations", "max_completion_length", "temperature", "top_p",
                        "top_k", "epsilon", "epsilon_high", "scale_rewards", "num_iterations", "rewards",
                        "reward_errors"})
OBJECTIVES: dict[str, ObjectiveKind] = {o.name: o for o in (
    ObjectiveKind("cross_entropy", (WINDOWS, ROWS), "next-token cross-entropy on the tokens with loss (pretraining "
                  "text, fine-tuning rows)"),
    ObjectiveKind("dpo", (PAIRS,), "direct preference optimisation against a frozen reference model",
                  frozenset({"beta", "loss_type", "label_smoothing", "precompute_ref_logps"}),
                  loss_types=("sigmoid", "ipo", "hinge"), default_beta=0.1, reference="always"),
    ObjectiveKind("simpo", (PAIRS,), "SimPO: length-normalised, reference-free, with a target margin",
                  frozenset({"beta", "gamma", "label_smoothing"}), default_beta=2.0),
    ObjectiveKind("orpo", (PAIRS,), "ORPO: the chosen reply's NLL plus an odds-ratio term, reference-free",
                  frozenset({"beta"}), default_beta=0.1),
    ObjectiveKind("grpo", (PROMPTS,), "group relative policy optimisation on sampled completions scored by rewards",
                  _GRPO_KEYS, loss_types=("dapo", "grpo", "dr_grpo"), default_beta=0.0, reference="when_beta",
                  passes_key="num_iterations"),
)}


def objectives_for(kind: BatchKind) -> list[str]:
    """The objectives that train on batches of ``kind``."""
    return [o.name for o in OBJECTIVES.values() if kind in o.kinds]


LOSS_TYPES = tuple(dict.fromkeys(t for o in OBJECTIVES.values() for t in o.loss_types))


# The reward functions built in (`jaxtune.train.rewards`); any other name is a user function, ``module:function``.
BUILTIN_REWARDS = ("exact_number", "regex", "format", "length")


class RewardConfig(Section):
    """One reward function of ``grpo`` (`jaxtune.train.rewards`), weighted into the total reward.

    Built in: ``exact_number`` (1 when the completion's last number equals the row's ``field``, numerically, else 0),
    ``regex`` (1 when ``pattern``'s first group, searched in the completion, equals the row's ``field``, stripped),
    ``format`` (1 when ``pattern`` matches the whole completion, stripped), ``length`` (DAPO's soft overlong penalty:
    0 up to ``max_tokens - buffer`` completion tokens, then down linearly to -1 at ``max_tokens`` and beyond). Any
    other ``name`` is a user function ``module:function`` called as ``f(prompts, completions, rows)`` (lists of the
    prompt texts, completion texts and the rows' fields) that returns one float per completion."""

    name: str
    weight: float = 1.0
    field: str = Field("answer", description="exact_number, regex: the row field holding the right answer")
    pattern: str | None = Field(None, description="regex: the pattern whose first group is the answer; format: the "
                                "pattern the whole completion must match")
    max_tokens: int | None = Field(None, ge=1, description="length: the longest completion (default "
                                   "objective.max_completion_length)")
    buffer: int | None = Field(None, ge=1, description="length: the tokens before max_tokens over which the penalty "
                               "grows (default max_tokens / 4)")

    @property
    def builtin(self) -> bool:
        return ":" not in self.name

    @model_validator(mode="after")
    def _known(self) -> RewardConfig:
        if self.builtin and self.name not in BUILTIN_REWARDS:
            raise ValueError(f"reward {self.name!r} is not built in ({', '.join(BUILTIN_REWARDS)}); a function of "
                             "your own is named module:function")
        if self.name in ("regex", "format") and not self.pattern:
            raise ValueError(f"reward {self.name} needs a pattern")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward {self.name}: pattern {self.pattern!r} is not a valid regex: {e}") from None
        return self


class ObjectiveConfig(Section):
    """What the training minimises (`jaxtune.train.objectives`).

    ``cross_entropy``: next-token cross-entropy on the tokens with loss (pretraining text, SFT's assistant turns).
    Preference pairs (``data.format: preference``): ``dpo`` (against a frozen reference model: LoRA's base with the
    adapters off, else a frozen copy of the initial weights, or its log-probs computed once before training with
    ``precompute_ref_logps``), and the reference-free ``simpo`` and ``orpo``. Prompts (``data.format: prompts``):
    ``grpo``, RL with verifiable rewards: ``num_generations`` completions sampled per prompt inside the loop, scored by
    ``rewards``, the clipped policy-gradient surrogate on group-normalised advantages, and with ``beta`` > 0 a KL
    penalty to the reference model. Their keys follow TRL's."""

    name: Literal[tuple(OBJECTIVES)] = Field("cross_entropy", description="; ".join(
        f"{o.name}: {o.description}" for o in OBJECTIVES.values()))
    beta: float | None = Field(None, ge=0, description="dpo: the KL weight (default 0.1); simpo: the reward scale "
                               "(default 2.0); orpo: the odds-ratio term's weight lambda (TRL's beta, default 0.1); "
                               "grpo: the KL penalty's weight (default 0: no reference model)")
    loss_type: Literal[LOSS_TYPES] | None = Field(
        None, description="dpo: sigmoid (the DPO paper, default), ipo (squared, per-token log-ratios) or hinge; grpo: "
        "how the per-token losses are averaged: grpo (per sequence, then over sequences), dr_grpo (summed, over "
        "sequences x max_completion_length), dapo (over the whole batch's completion tokens, default)")
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5, description="dpo (sigmoid) and simpo: the assumed share of "
                                   "flipped labels (conservative DPO)")
    gamma: float = Field(0.5, ge=0.0, description="simpo: the target reward margin (TRL's simpo_gamma)")
    precompute_ref_logps: bool = Field(False, description="dpo: compute the reference log-probs of every pair once "
                                       "before training (stored in the run directory), so no reference model is "
                                       "held while training")
    # grpo
    num_generations: int = Field(8, ge=2, description="grpo: completions sampled per prompt (the group)")
    max_completion_length: int = Field(128, ge=1, description="grpo: new tokens per completion at most")
    temperature: float = Field(1.0, gt=0, description="grpo: sampling temperature (the log-probs are of the same "
                               "tempered distribution, as TRL's)")
    top_p: float = Field(1.0, gt=0, le=1, description="grpo: nucleus sampling")
    top_k: int | None = Field(None, ge=1, description="grpo: sample among the k likeliest tokens")
    epsilon: float = Field(0.2, gt=0, lt=1, description="grpo: the ratio's lower clip, 1 - epsilon")
    epsilon_high: float | None = Field(None, gt=0, description="grpo: the ratio's upper clip, 1 + epsilon_high "
                                       "(default epsilon)")
    scale_rewards: bool = Field(True, description="grpo: divide each group's advantages by its reward std "
                                "(false: Dr. GRPO's unscaled advantages)")
    num_iterations: int = Field(1, ge=1, description="grpo: optimisation passes over each batch of completions "
                                "(TRL's mu)")
    rewards: list[RewardConfig] = Field([], description="grpo: reward functions, summed with their weights")
    reward_errors: Literal["raise", "zero"] = Field("raise", description="grpo: a reward function that raises or "
                                                    "returns NaN stops training (raise, naming it and the row) or "
                                                    "scores that completion 0, counted (zero)")

    @model_validator(mode="before")
    @classmethod
    def _legacy_loss_type(cls, data: Any) -> Any:
        # Configs written before grpo set loss_type: sigmoid for every objective; it only ever meant dpo's. Objectives
        # with loss types of their own (grpo) came later: sigmoid there is the user's, and an error.
        spec = OBJECTIVES.get(data.get("name", "cross_entropy")) if isinstance(data, dict) else None
        if spec is not None and data.get("loss_type") == "sigmoid" and not spec.loss_types:
            data = {k: v for k, v in data.items() if k != "loss_type"}
        return data

    @property
    def spec(self) -> ObjectiveKind:
        """This objective's record (`jaxtune.config.kinds.OBJECTIVES`)."""
        return OBJECTIVES[self.name]

    @property
    def kinds(self) -> tuple[BatchKind, ...]:
        """The batch kinds it trains on."""
        return self.spec.kinds

    @property
    def generates(self) -> bool:
        """Whether it trains on completions the loop samples (GRPO)."""
        return any(k.generates for k in self.spec.kinds)

    @property
    def passes(self) -> int:
        """Optimiser updates per batch (GRPO's ``num_iterations``; 1 for the others)."""
        return getattr(self, self.spec.passes_key) if self.spec.passes_key else 1

    @property
    def uses_reference(self) -> bool:
        ref = self.spec.reference
        return ref == "always" or (ref == "when_beta" and self.beta_value > 0)

    @property
    def beta_value(self) -> float:
        default = self.spec.default_beta
        return self.beta if self.beta is not None else (default if default is not None else 0.0)

    @property
    def loss_type_value(self) -> str | None:
        return self.loss_type if self.loss_type is not None else self.spec.default_loss_type

    @model_validator(mode="after")
    def _keys_apply(self) -> ObjectiveConfig:
        # Keys away from their defaults (a dumped config sets every key, at its default where unused).
        given = {k for k, f in type(self).model_fields.items() if k != "name" and getattr(self, k) != f.default}
        spec = self.spec
        applies = spec.keys
        extra = sorted(given - applies)
        if extra:
            raise ValueError(f"objective.{extra[0]} does not apply to objective.name={self.name}"
                             + (f"; its keys: {', '.join(sorted(applies))}" if applies else ""))
        if self.loss_type is not None and self.loss_type not in spec.loss_types:
            raise ValueError(f"objective.loss_type={self.loss_type} does not apply to objective.name={self.name}; "
                             f"choose one of {', '.join(spec.loss_types)}")
        if self.label_smoothing and self.loss_type_value not in (None, "sigmoid"):
            raise ValueError("objective.label_smoothing applies to loss_type=sigmoid only")
        if self.beta == 0 and spec.reference != "when_beta":
            raise ValueError(f"objective.beta must be > 0 for objective.name={self.name}")
        if self.generates and not self.rewards:
            raise ValueError(f"objective.name={self.name} needs at least one reward function in objective.rewards, "
                             "e.g. [{name: exact_number, field: answer}]")
        return self
