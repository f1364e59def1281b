"""GRPO's reward functions as the config names them (``objective.rewards``): the built-in ones and their keys."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, model_serializer, model_validator

from jaxtune.config.base import Section

# The reward functions built in (`jaxtune.rollout.rewards`); any other name is a user function, ``module:function``.
BUILTIN_REWARDS = ("exact_number", "regex", "format", "length")
# A learned reward model's score (`jaxtune.rollout.model_reward`): the entry names the model with ``path``.
MODEL_REWARD = "model"
_MODEL_KEYS = ("path", "batch_size")  # what only a reward model's entry sets


class RewardConfig(Section):
    """One reward function of ``grpo`` (`jaxtune.rollout.rewards`), weighted into the total reward.

    Built in: ``exact_number`` (1 when the completion's last number equals the row's ``field``, numerically, else 0),
    ``regex`` (1 when ``pattern``'s first group, searched in the completion, equals the row's ``field``, stripped),
    ``format`` (1 when ``pattern`` matches the whole completion, stripped), ``length`` (DAPO's soft overlong penalty:
    0 up to ``max_tokens - buffer`` completion tokens, then down linearly to -1 at ``max_tokens`` and beyond).
    ``model``: a reward model's score of the prompt and completion (``path``: a jaxtune reward-model run, its export,
    or a transformers *ForSequenceClassification checkpoint with one label), computed on the run's devices. Any
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
    path: str | None = Field(None, description="model: the reward model, a run directory of objective.name=reward, "
                             "its `jaxtune export`, or a transformers *ForSequenceClassification directory "
                             "(num_labels 1); it scores with its own tokenizer and chat template")
    batch_size: int | None = Field(None, ge=1, description="model: sequences scored per call (default: all the "
                                   "completions of a step at once)")
    accuracy: bool | None = Field(None, description="true: this reward is the success criterion, and held-out "
                                  "accuracy is the share of held-out prompts it scores at least 1 (default: the "
                                  "first built-in reward that checks the answer, exact_number or regex; false: "
                                  "never this one)")

    @model_serializer(mode="wrap")
    def _without_unset_model_keys(self, handler: Any) -> dict[str, Any]:
        # A reward model's keys are left out of every other reward's dump: configs saved before they existed read
        # back, and resume, as they were written.
        out = handler(self)
        return {k: v for k, v in out.items() if k not in _MODEL_KEYS or v is not None}

    @property
    def builtin(self) -> bool:
        return ":" not in self.name and not self.model

    @property
    def model(self) -> bool:
        return self.name == MODEL_REWARD

    @model_validator(mode="after")
    def _known(self) -> RewardConfig:
        if self.builtin and self.name not in BUILTIN_REWARDS:
            raise ValueError(f"reward {self.name!r} is not built in ({', '.join(BUILTIN_REWARDS)}, or {MODEL_REWARD} "
                             "with a path); a function of your own is named module:function")
        if self.model and not self.path:
            raise ValueError("reward model needs a path: a run directory of objective.name=reward, its export, or a "
                             "transformers *ForSequenceClassification directory")
        if not self.model and (self.path is not None or self.batch_size is not None):
            raise ValueError(f"reward {self.name}: path and batch_size are a reward model's keys (name: model)")
        if self.model and self.accuracy:
            raise ValueError("reward model: accuracy: true marks a reward that scores a right answer 1; a reward "
                             "model's score is no such count: mark an exact_number or regex reward")
        if self.name in ("regex", "format") and not self.pattern:
            raise ValueError(f"reward {self.name} needs a pattern")
        if self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"reward {self.name}: pattern {self.pattern!r} is not a valid regex: {e}") from None
        return self
