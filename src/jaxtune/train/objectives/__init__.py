"""Training objectives by name (``objective.name``). Adding one: a module here with a class that meets
`base.Objective`, and its entry in `make_objective` (plus its keys in `jaxtune.config.ObjectiveConfig`)."""

from __future__ import annotations

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives.base import Metrics, Objective, Reference
from jaxtune.train.objectives.cross_entropy import CrossEntropy
from jaxtune.train.objectives.preference import DPO, ORPO, PREFERENCE, SimPO

OBJECTIVES: dict[str, type] = {"cross_entropy": CrossEntropy, **PREFERENCE}


def make_objective(cfg: ObjectiveConfig) -> Objective:
    """The objective ``objective.name`` names, with its keys."""
    if cfg.name == "dpo":
        return DPO(beta=cfg.beta_value, loss_type=cfg.loss_type_value, label_smoothing=cfg.label_smoothing)
    if cfg.name == "simpo":
        return SimPO(beta=cfg.beta_value, gamma=cfg.gamma, label_smoothing=cfg.label_smoothing)
    if cfg.name == "orpo":
        return ORPO(beta=cfg.beta_value)
    return OBJECTIVES[cfg.name]()


__all__ = ["DPO", "OBJECTIVES", "ORPO", "CrossEntropy", "Metrics", "Objective", "Reference", "SimPO",
           "make_objective"]
