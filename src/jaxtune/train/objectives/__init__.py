"""Training objectives by name (``objective.name``). Adding one: a module here with a class that meets
`base.Objective`, and its entry in `make_objective` (plus its keys in `jaxtune.config.ObjectiveConfig`)."""

from __future__ import annotations

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives.base import Metrics, Objective, Reference
from jaxtune.train.objectives.cross_entropy import CrossEntropy
from jaxtune.train.objectives.grpo import GRPO
from jaxtune.train.objectives.preference import DPO, ORPO, PREFERENCE, SimPO

OBJECTIVES: dict[str, type] = {"cross_entropy": CrossEntropy, **PREFERENCE, "grpo": GRPO}


def make_objective(cfg: ObjectiveConfig) -> Objective:
    """The objective ``objective.name`` names, with its keys."""
    if cfg.name == "dpo":
        return DPO(beta=cfg.beta_value, loss_type=cfg.loss_type_value, label_smoothing=cfg.label_smoothing)
    if cfg.name == "simpo":
        return SimPO(beta=cfg.beta_value, gamma=cfg.gamma, label_smoothing=cfg.label_smoothing)
    if cfg.name == "orpo":
        return ORPO(beta=cfg.beta_value)
    if cfg.name == "grpo":
        return GRPO(beta=cfg.beta_value, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high,
                    loss_type=cfg.loss_type_value, temperature=cfg.temperature,
                    max_completion_length=cfg.max_completion_length, passes=cfg.num_iterations)
    return OBJECTIVES[cfg.name]()


__all__ = ["DPO", "GRPO", "OBJECTIVES", "ORPO", "CrossEntropy", "Metrics", "Objective", "Reference", "SimPO",
           "make_objective"]
