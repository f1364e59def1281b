"""Training objectives by name (``objective.name``). Adding one: a module here with a class that meets
`base.Objective`, and its entry in `OBJECTIVES` (plus its keys in `jaxtune.config.ObjectiveConfig`)."""

from __future__ import annotations

from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives.base import Metrics, Objective
from jaxtune.train.objectives.cross_entropy import CrossEntropy

OBJECTIVES: dict[str, type] = {"cross_entropy": CrossEntropy}


def make_objective(cfg: ObjectiveConfig) -> Objective:
    return OBJECTIVES[cfg.name]()


__all__ = ["OBJECTIVES", "CrossEntropy", "Metrics", "Objective", "make_objective"]
