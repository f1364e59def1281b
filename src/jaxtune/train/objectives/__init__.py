"""Training objectives by name (``objective.name``). Each is declared once in `jaxtune.config.kinds.OBJECTIVES` (its
batch kind, keys, loss types, defaults) and implemented here by a class meeting `base.Objective` whose
``from_config`` reads its keys; adding one is its record there, its module here and its class in `CLASSES`."""

from __future__ import annotations

from jaxtune.config import OBJECTIVES as DECLARED
from jaxtune.config import ObjectiveConfig
from jaxtune.train.objectives import base
from jaxtune.train.objectives.base import Metrics, Objective, Reference
from jaxtune.train.objectives.cross_entropy import CrossEntropy
from jaxtune.train.objectives.gkd import GKD
from jaxtune.train.objectives.grpo import GRPO
from jaxtune.train.objectives.kto import KTO
from jaxtune.train.objectives.preference import DPO, ORPO, SimPO
from jaxtune.train.objectives.reward import RewardModel
from jaxtune.train.objectives.rloo import RLOO

CLASSES = (CrossEntropy, DPO, SimPO, RewardModel, ORPO, KTO, GRPO, RLOO, GKD)
OBJECTIVES: dict[str, type] = {c.name: c for c in CLASSES}
if set(OBJECTIVES) != set(DECLARED):  # a declared objective without its class, or a class without its record
    raise ImportError(f"objectives declared in jaxtune.config.kinds {sorted(DECLARED)} != implemented "
                      f"{sorted(OBJECTIVES)}")


def make_objective(cfg: ObjectiveConfig) -> Objective:
    """The objective ``objective.name`` names, with its keys."""
    return OBJECTIVES[cfg.name].from_config(cfg)


def initial_carry(cfg: ObjectiveConfig) -> dict[str, float]:
    """What the objective of ``cfg`` carries from one update to the next before the first (`base.initial_carry`):
    the train state's initial ``carry``."""
    return base.initial_carry(make_objective(cfg))


__all__ = ["CLASSES", "DPO", "GKD", "GRPO", "KTO", "OBJECTIVES", "ORPO", "RLOO", "CrossEntropy", "Metrics", "Objective",
           "Reference", "RewardModel", "SimPO", "initial_carry", "make_objective"]
