"""Training objectives by name (``objective.name``). Each is declared once in `jaxtune.config.kinds.OBJECTIVES` (its
batch kind, keys, loss types, defaults) and implemented here by a class meeting `base.Objective` whose
``from_config`` reads its keys. The classes are found in this package's modules (`CLASSES`: each module's classes
whose ``name`` is a declared objective's), so adding one is its record, its config section and its module here;
an objective that samples computes its own advantages (``advantages``, from `advantages`' estimators)."""

from __future__ import annotations

import importlib
import pkgutil

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


def _classes() -> tuple[type, ...]:
    """Every objective class of this package's modules, in the records' order: a class defined in its module, with
    a ``from_config`` and a ``name`` a record declares."""
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for value in vars(module).values():
            name = getattr(value, "name", None)
            if (isinstance(value, type) and value.__module__ == module.__name__ and isinstance(name, str)
                    and name in DECLARED and hasattr(value, "from_config")):
                if found.get(name, value) is not value:
                    raise ImportError(f"objective {name!r} is implemented twice: {found[name]} and {value}")
                found[name] = value
    return tuple(found[n] for n in DECLARED if n in found)


CLASSES = _classes()
OBJECTIVES: dict[str, type] = {c.name: c for c in CLASSES}
if set(OBJECTIVES) != set(DECLARED):  # a declared objective without its class, or a class without its record
    raise ImportError(f"objectives declared in jaxtune.config.kinds {sorted(DECLARED)} != implemented "
                      f"{sorted(OBJECTIVES)}")
_UNESTIMATED = [n for n, c in OBJECTIVES.items() if DECLARED[n].completions != "given" and not hasattr(c, "advantages")]
if _UNESTIMATED:  # the rollout asks a sampling objective for its completions' advantages
    raise ImportError(f"objectives {_UNESTIMATED} sample completions but define no advantages(cfg, rewarded)")


def make_objective(cfg: ObjectiveConfig) -> Objective:
    """The objective ``objective.name`` names, with its keys."""
    return OBJECTIVES[cfg.name].from_config(cfg)


def initial_carry(cfg: ObjectiveConfig) -> dict[str, float]:
    """What the objective of ``cfg`` carries from one update to the next before the first (`base.initial_carry`):
    the train state's initial ``carry``."""
    return base.initial_carry(make_objective(cfg))


__all__ = ["CLASSES", "DPO", "GKD", "GRPO", "KTO", "OBJECTIVES", "ORPO", "RLOO", "CrossEntropy", "Metrics", "Objective",
           "Reference", "RewardModel", "SimPO", "initial_carry", "make_objective"]
