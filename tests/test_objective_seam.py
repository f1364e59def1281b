"""The objective seam holds: outside the objective records (`jaxtune.config`) and the objectives' own modules
(`jaxtune.train.objectives`), no code compares a name with an objective's; the loop, step, rollout, evaluation and
plan ask the record (`jaxtune.config.kinds.ObjectiveKind`) instead. Nor does any code there compute advantages: the
rollout asks the objective (its ``advantages``), so a new baseline is a function in its objective's module. A new
objective is then its record, its config and its module, and nothing else changes."""

from __future__ import annotations

import ast
from pathlib import Path

import jaxtune
from jaxtune.config.kinds import OBJECTIVES

SRC = Path(jaxtune.__file__).parent
ALLOWED = ("config", "train/objectives")


def _names_in(node: ast.AST) -> set[str]:
    """The objective names a comparison operand spells: a string constant, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(OBJECTIVES)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_names_in(e) for e in node.elts)) if node.elts else set()
    return set()


def name_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, name) of each comparison (==, !=, in, not in) with an objective's name in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, n) for n in sorted(_names_in(operand))]
    return found


# The advantage estimators (`jaxtune.train.objectives.advantages`): called only by the objectives.
ESTIMATORS = {"group_advantages", "leave_one_out_advantages", "normalized_then_summed", "zero_advantages"}


def baselines_outside(source: str) -> list[tuple[int, str]]:
    """(line, name) of each call of an advantage estimator, and each function defined to compute advantages (its
    name has ``advantage`` in it), in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in ESTIMATORS:
                found.append((node.lineno, name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and "advantage" in getattr(
                node, "name", ""):
            found.append((node.lineno, node.name))
    return sorted(found)


def test_no_baseline_is_computed_outside_an_objective():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("train/objectives"):
            continue
        offenders += [f"{rel}:{line}: {name}" for line, name in baselines_outside(path.read_text())]
    assert not offenders, ("advantages are the objective's (its advantages(cfg, rewarded), from "
                           "jaxtune.train.objectives.advantages):\n" + "\n".join(offenders))


def test_the_baseline_check_finds_one():
    code = ("a = group_advantages(total, 4)\nb = adv.leave_one_out_advantages(t, p, 2)\n"
            "def batch_advantages(total):\n    return total - total.mean()\nc = informative_groups(s, 4)\n")
    assert baselines_outside(code) == [(1, "group_advantages"), (2, "leave_one_out_advantages"),
                                       (3, "batch_advantages")]


def test_no_objective_name_is_compared_outside_its_records():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(ALLOWED):
            continue
        offenders += [f"{rel}:{line}: compares with {name!r}" for line, name in name_comparisons(path.read_text())]
    assert not offenders, "ask the objective's record (jaxtune.config.kinds.ObjectiveKind) instead:\n" + "\n".join(
        offenders)


def test_the_check_finds_a_comparison():
    """The walk is not vacuous: each way of spelling the comparison is found."""
    code = 'a = cfg.objective.name == "gkd"\nb = o.name in ("grpo", "rloo")\nc = "dpo" != name\nd = x == "gkd-ish"\n'
    assert name_comparisons(code) == [(1, "gkd"), (2, "grpo"), (2, "rloo"), (3, "dpo")]
