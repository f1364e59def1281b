"""GRPO's reward functions (`jaxtune.config.RewardConfig`): each completion scored by every function, weighted.

A batch is N completions: ``num_generations`` per prompt, each with its prompt (a string, or a list of message
dicts, as the row gave it), the row's other fields (``{"answer": "132"}``), its length in tokens and the row's
``file:line`` for error messages. `Rewards.score` returns the (N, K) scores of the K functions and their weighted sum
(N,), as TRL's ``GRPOTrainer._calculate_rewards``; each objective turns them into advantages
(`jaxtune.train.objectives.advantages`).

Built in: ``exact_number``, ``regex``, ``format``, ``length`` (see `RewardConfig`). ``model``: a learned reward
model's score (`jaxtune.rollout.model_reward`), loaded before the rewards are made and called on every process's
completions at once (`Rewards.modelled`); a sequence it cannot score is a failure as below. Any other ``name`` is a
function of the user's, ``module:function``, imported when the rewards are made (before training) from the current
directory as ``python -m`` would, and called once per batch in one of two forms, told apart by its parameters:

- jaxtune's, a function with a ``rows`` parameter: ``f(prompts=..., completions=..., rows=...)`` (the prompts as the
  rows gave them, the completions' texts, the rows' other fields as dicts);
- TRL's (``GRPOTrainer``'s reward functions, unchanged), any other: ``f(prompts=..., completions=...,
  completion_ids=..., trainer_state=..., log_extra=..., log_metric=..., **columns)``, each of the data's other
  fields a keyword holding its column (a list, one value per completion), conversational completions (when the
  prompt is a message list) as ``[{"role": "assistant", "content": text}]``. It is given the keywords it declares
  (all of them with ``**kwargs``); one it requires that the data lacks is an error naming it and the columns there
  are. ``trainer_state`` has ``global_step``; ``log_metric(name, value)`` logs ``rewards/<name>``; ``log_extra`` is
  accepted and ignored. As in TRL, a None score means "does not apply": it counts 0 in the total (TRL's nansum)
  and is left out of the function's mean and std.

A function that raises, or scores a completion NaN, +-inf or something that is not a number (or None, in jaxtune's
form), stops training with a `RewardError` naming it and the row (``objective.reward_errors: raise``, the default) or
scores that completion 0 and is counted in `Scores.errors` (``zero``; a call that raised scores its whole batch 0).
Data errors (a row without the field a built-in reads) and programming errors (a function returning the wrong number
of scores) always raise.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import math
import numbers
import os
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np

from jaxtune.config import BUILTIN_REWARDS, ConfigError, ObjectiveConfig, RewardConfig

# A number as written in a completion: integer or decimal, negative, with thousands separators ("1,234.5"). The
# minus counts only where it cannot be a binary one ("5-3" is 5 and 3); a number never starts inside a digit run.
_NUMBER = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_IN_TEXT = re.compile(rf"(?:(?<![\w)\]])-)?(?<!\d){_NUMBER}")
_NUMBER_ALONE = re.compile(rf"-?{_NUMBER}")
_FIX = "fix the function, or set objective.reward_errors: zero to score such completions 0 (counted)"


class RewardError(ValueError):
    """A reward function failed on a row, or a row lacks what a reward reads; names the reward and the row."""


@dataclass(frozen=True)
class Scores:
    per_function: np.ndarray  # (N, K) float32: one column per reward function; failures scored 0 under "zero",
    # NaN where a TRL-form function said None ("does not apply")
    total: np.ndarray  # (N,) float32: sum over functions of weight * score (NaN left out, as TRL's nansum)
    errors: dict[str, int]  # label -> completions scored 0 because the function failed ("zero"); only labels > 0
    logged: dict[str, float] = field(default_factory=dict)  # what TRL-form functions passed to log_metric

    @property
    def scored_total(self) -> np.ndarray:
        """``total`` with NaN where no function scored the completion (every column NaN): TRL leaves those out of the
        baselines, the stds and the logged reward."""
        if not self.per_function.shape[1]:
            return self.total
        return np.where(np.isnan(self.per_function).all(axis=1), np.nan, self.total)


# A built-in scores one completion: (completion, row, length in tokens, where) -> score.
_OneScore = Callable[[str, dict, int, str], float]


# A reward model (`jaxtune.rollout.model_reward.ModelReward`): (prompts, completions) -> ((N,) scores, NaN where not
# scored, {index: why}); called on every process's completions at once, the same on every process.
ModelScores = Callable[[list, list[str]], tuple[np.ndarray, dict[int, str]]]


@dataclass(frozen=True)
class _Function:
    label: str
    one: _OneScore | None  # a built-in
    batch: Callable[..., Any] | None  # a user function, called once per batch
    trl: bool = False  # the user function takes TRL's keywords (no ``rows`` parameter)
    model: ModelScores | None = None  # a reward model
    given: bool = False  # an environment's own reward (`jaxtune.rollout.agent`): its scores come with the completions


class Rewards:
    """The run's reward functions (`make_rewards`): labels (metric names ``reward/<label>``), weights and `score`."""

    def __init__(self, functions: list[_Function], weights: list[float], accuracy: int | None, policy: str):
        self._functions = functions
        self._policy = policy
        self.labels = [f.label for f in functions]
        self.weights = np.asarray(weights, np.float32)  # (K,)
        self.accuracy = accuracy  # index of the reward held-out accuracy counts (`RewardConfig.accuracy`), or None

    def modelled(self, prompts: list, completions: list[str]) -> dict[int, tuple[np.ndarray, dict[int, str]]]:
        """Each reward model's scores of the completions (`ModelScores`), by the index of its function. With several
        processes every process calls this on the same completions (every process's), as the models are sharded
        over all of them; `score` then takes each process's share."""
        return {k: f.model(prompts, completions) for k, f in enumerate(self._functions) if f.model is not None}

    def score(self, prompts: list, completions: list[str], rows: list[dict], lengths: list[int],
              where: list[str], completion_ids: list[list[int]] | None = None, step: int = 0,
              modelled: dict[int, tuple[np.ndarray, dict[int, str]]] | None = None) -> Scores:
        """Scores N completions: ``per_function`` (N, K), ``total`` (N,) = per_function @ weights, both float32.
        ``completion_ids`` and ``step`` are what TRL-form functions are also given; ``modelled``: the reward
        models' scores of these completions (`modelled`), computed here when not given."""
        n = len(completions)
        modelled = self.modelled(prompts, completions) if modelled is None else modelled
        if not len(prompts) == len(rows) == len(lengths) == len(where) == n:
            raise ValueError(f"score needs one prompt, row, length and where per completion; got {len(prompts)}, "
                             f"{len(rows)}, {len(lengths)}, {len(where)} for {n} completions")
        per_function = np.zeros((n, len(self._functions)), np.float32)
        errors: dict[str, int] = {}
        logged: dict[str, float] = {}
        for k, f in enumerate(self._functions):
            if f.one is not None:
                per_function[:, k] = [f.one(c, r, m, w) for c, r, m, w in zip(completions, rows, lengths, where)]
                continue
            if f.given:  # NaN stays: "does not apply" (a rollout of another environment)
                scores, problems = modelled[k]
                self._model_scores(f, scores, problems, where, "fix get_reward(), or")  # raises unless "zero"
                per_function[:, k] = scores
                per_function[list(problems), k] = 0.0
                if problems:
                    errors[f.label] = len(problems)
                continue
            if f.model is not None:
                per_function[:, k], failed = self._model_scores(f, *modelled[k], where)
                if failed:
                    errors[f.label] = failed
                continue
            call = _trl_call(f, prompts, completions, rows, completion_ids, step, logged) if f.trl else (
                lambda i, j, f=f: f.batch(prompts=prompts[i:j], completions=completions[i:j], rows=rows[i:j]))
            per_function[:, k], failed = self._call(f, call, n, where)
            if failed:
                errors[f.label] = failed
        total = np.nansum(per_function * self.weights[None, :], axis=1, dtype=np.float32)  # (N,)
        return Scores(per_function=per_function, total=total, errors=errors, logged=logged)

    def _model_scores(self, f: _Function, scores: np.ndarray, problems: dict[int, str], where: list[str],
                      fix: str = "or") -> tuple[np.ndarray, int]:
        """A reward model's (or an environment's) scores, those it could not give 0 under ``reward_errors: zero``
        (counted), else an error naming the first one's row and why (``problems``), then ``fix`` and the key."""
        if problems and self._policy != "zero":
            i = min(problems)
            raise RewardError(f"reward {f.label!r} cannot score the completion of the row {where[i]}: {problems[i]}; "
                              f"{fix} set objective.reward_errors: zero to score such completions 0 (counted)")
        return np.nan_to_num(scores, nan=0.0), len(problems)

    def _call(self, f: _Function, call: Callable[[int, int], Any], n: int,
              where: list[str]) -> tuple[np.ndarray, int]:
        """A user function's (N,) scores on the batch (``call(i, j)``: its scores of completions i..j-1), and how
        many of them are failures scored 0."""
        try:
            out = call(0, n)
        except RewardError:
            raise
        except Exception as e:
            if self._policy == "zero":
                return np.zeros(n, np.float32), n
            bad = _culprit(call, n)
            row = f"the row {where[bad]}" if bad is not None else f"a batch of {n} completions from {where[0]} on"
            raise RewardError(f"reward {f.label!r} raised {_one_line(e)} on {row}; {_FIX}") from e
        try:
            values = list(out)
        except TypeError:
            values = None
        if values is None or len(values) != n:
            got = f"{len(values)} scores" if values is not None else f"a {type(out).__name__}"
            raise RewardError(f"reward {f.label!r} returned {got} for {n} completions (from {where[0]} on); it "
                              "must return one number per completion")
        scores = np.zeros(n, np.float32)
        failed = 0
        for i, v in enumerate(values):
            if isinstance(v, (numbers.Real, np.bool_)) and math.isfinite(v):
                scores[i] = float(v)
            elif v is None and f.trl:  # TRL's "this reward does not apply"
                scores[i] = np.nan
            elif self._policy == "zero":
                failed += 1
            else:
                raise RewardError(f"reward {f.label!r} scored the completion of the row {where[i]} {v!r}, not a "
                                  f"finite number; {_FIX}")
        return scores, failed


def make_rewards(cfg: ObjectiveConfig, models: dict[int, ModelScores] | None = None,
                 environments: tuple[str, ...] | list[str] = ()) -> Rewards:
    """The reward functions of ``cfg.rewards``, user functions imported now: a `ConfigError` names the key.
    ``models``: the reward models, loaded (`jaxtune.companions.load_reward_models`), by their entry's index.
    ``environments``: the classes of the tools' environments that own a reward (``get_reward``), each one more
    function after the configured ones, weight 1, as TRL adds them."""
    functions, taken = [], set()
    bases = [r.name if r.builtin or r.model else r.name.partition(":")[2] for r in cfg.rewards]
    for i, (r, base) in enumerate(zip(cfg.rewards, bases)):
        key = f"objective.rewards[{i}]"
        label, n = base, 2
        while label in taken or (label != base and label in bases):  # format, format_2 (unless a function is so named)
            label, n = f"{base}_{n}", n + 1
        taken.add(label)
        if r.model:
            if models is None or i not in models:
                raise ConfigError(f"{key}: a reward model is loaded on the run's devices (jaxtune.companions."
                                  "load_reward_models) before the rewards are made")
            functions.append(_Function(label, None, None, model=models[i]))
        elif r.builtin:
            functions.append(_Function(label, BUILTINS[r.name].make(r, cfg, key, label), None))
        else:
            fn = _import(r.name, f"{key}.name")
            functions.append(_Function(label, None, fn, trl="rows" not in _parameters(fn)))
    for label in environments:
        functions.append(_Function(label if label not in taken else f"{label}_environment", None, None, given=True))
    accuracy = next((i for i, r in enumerate(cfg.rewards) if r.accuracy), None)  # the one marked, else the first
    if accuracy is None:  # built-in that checks the answer and is not marked false
        accuracy = next((i for i, r in enumerate(cfg.rewards)
                         if r.builtin and BUILTINS[r.name].judges_answer and r.accuracy is None), None)
    return Rewards(functions, [r.weight for r in cfg.rewards] + [1.0] * len(environments), accuracy,
                   cfg.reward_errors)


def _exact_number_of(r: RewardConfig, cfg: ObjectiveConfig, key: str, label: str) -> _OneScore:
    return _exact_number(r.field, key, label)


def _regex_of(r: RewardConfig, cfg: ObjectiveConfig, key: str, label: str) -> _OneScore:
    pattern = re.compile(r.pattern)
    if pattern.groups < 1:
        raise ConfigError(f"{key}.pattern={r.pattern!r} has no group: put the answer's part in parentheses, "
                          r"e.g. 'answer is (\S+)'")
    return _regex(pattern, r.field, key, label)


def _format_of(r: RewardConfig, cfg: ObjectiveConfig, key: str, label: str) -> _OneScore:
    pattern = re.compile(r.pattern, re.DOTALL)
    return lambda completion, row, length, where: float(pattern.fullmatch(completion.strip()) is not None)


def _length_of(r: RewardConfig, cfg: ObjectiveConfig, key: str, label: str) -> _OneScore:
    max_tokens = r.max_tokens or cfg.max_completion_length
    buffer = r.buffer or max(1, max_tokens // 4)
    if buffer > max_tokens:
        raise ConfigError(f"{key}.buffer={buffer} is more than its max_tokens={max_tokens}; the penalty grows over "
                          "the last `buffer` tokens before max_tokens")
    return lambda completion, row, length, where: _overlong(length, max_tokens, buffer)


@dataclass(frozen=True)
class Builtin:
    """A built-in reward: ``make(reward section, objective section, its config key, its label)`` -> the scorer of
    one completion; ``judges_answer``: it checks the answer, so held-out accuracy reports it."""

    make: Callable[[RewardConfig, ObjectiveConfig, str, str], _OneScore]
    judges_answer: bool = False


# The implementation of each reward `jaxtune.config.BUILTIN_REWARDS` names.
BUILTINS: dict[str, Builtin] = {"exact_number": Builtin(_exact_number_of, judges_answer=True),
                                "regex": Builtin(_regex_of, judges_answer=True), "format": Builtin(_format_of),
                                "length": Builtin(_length_of)}
if set(BUILTINS) != set(BUILTIN_REWARDS):
    raise ImportError(f"built-in rewards declared {sorted(BUILTIN_REWARDS)} != implemented {sorted(BUILTINS)}")


def _exact_number(field: str, key: str, label: str) -> _OneScore:
    def score(completion: str, row: dict, length: int, where: str) -> float:
        answer = _number_field(row, field, where, key, label)
        found = _NUMBER_IN_TEXT.findall(completion)
        return float(bool(found) and Decimal(found[-1].replace(",", "")) == answer)
    return score


def _regex(pattern: re.Pattern, field: str, key: str, label: str) -> _OneScore:
    def score(completion: str, row: dict, length: int, where: str) -> float:
        answer = str(_field(row, field, where, key, label)).strip()
        match = pattern.search(completion)
        return float(match is not None and match.group(1) is not None and match.group(1).strip() == answer)
    return score


def _overlong(n: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong penalty (TRL's ``get_soft_overlong_punishment``) of an n-token completion."""
    if n <= max_tokens - buffer:
        return 0.0
    return (max_tokens - buffer - n) / buffer if n < max_tokens else -1.0


def _field(row: dict, field: str, where: str, key: str, label: str) -> Any:
    if row.get(field) is None:
        has = f"has {field!r} empty" if field in row else f"has no field {field!r}"
        raise RewardError(f"reward {label!r}: the row {where} {has} (its fields: {', '.join(sorted(row)) or 'none'}); "
                          f"give every row one, or set {key}.field to the field that holds the answer")
    return row[field]


def _number_field(row: dict, field: str, where: str, key: str, label: str) -> Decimal:
    """The row's answer as an exact number: an int, a finite float, or a string that is one number ("1,234")."""
    value = _field(row, field, where, key, label)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return Decimal(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return Decimal(repr(float(value)))  # 0.1 is "0.1", not its binary expansion
    if isinstance(value, str) and _NUMBER_ALONE.fullmatch(value.strip()):
        return Decimal(value.strip().replace(",", ""))
    raise RewardError(f"reward {label!r}: the row {where} has {field}={value!r}, not a number; write the answer "
                      f"alone (e.g. \"1,234\" or -3.5), or use a regex reward ({key}.name: regex)")


def _import(name: str, key: str) -> Callable[..., Any]:
    """The function ``module:attribute`` names, imported with the current directory on sys.path."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}={name!r}: a reward function of your own is named module:function")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        dotted = module_name.removesuffix(".py").replace("/", ".").replace("\\", ".")
        raise ConfigError(f"{key}={name!r}: name the module, not its file: {dotted}:{attribute}, run from the "
                          "directory that holds it")
    with _cwd_on_path():
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(f"{key}={name!r}: cannot import module {module_name!r} ({_one_line(e)}); it is looked "
                              f"up from the current directory ({os.getcwd()}) and the installed packages") from e
    f: Any = module
    for part in attribute.split("."):
        if not hasattr(f, part):
            known = [a for a in dir(f) if not a.startswith("_")]
            near = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{key}={name!r}: {module_name!r} ({getattr(module, '__file__', None)}) has no "
                              f"{attribute!r}{hint}")
        f = getattr(f, part)
    if not callable(f):
        raise ConfigError(f"{key}={name!r}: {module_name}.{attribute} is a {type(f).__name__}, not a function")
    return f


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    # `python -m` puts the current directory first on sys.path; the jaxtune command (a console script) does not.
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def _culprit(call: Callable[[int, int], Any], n: int) -> int | None:
    """The first completion the user function raises on alone, to name its row; None if each passes alone."""
    for i in range(n):
        try:
            call(i, i + 1)
        except Exception:  # noqa: BLE001 (any failure of the user's function marks its row)
            return i
    return None


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: TRL's form, every keyword
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}


def _trl_call(f: _Function, prompts: list, completions: list[str], rows: list[dict],
              completion_ids: list[list[int]] | None, step: int, logged: dict[str, float]) -> Callable[[int, int], Any]:
    """``call(i, j)``: ``f`` called on completions i..j-1 as TRL's GRPOTrainer calls a reward function."""
    params = _parameters(f.batch)
    columns = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in ("prompt", "completion",
                                                                                   "completion_ids")]
    given = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", *columns}
    missing = [name for name, p in params.items() if p.default is p.empty and name not in given
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise RewardError(f"reward {f.label!r} takes {missing[0]!r}, which is not a column of the data (columns: "
                          f"{', '.join(columns) or 'none'}); it is called as TRL calls it: prompts, completions, "
                          "completion_ids and each column as a keyword")
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    chat = bool(prompts) and isinstance(prompts[0], list)
    texts = [[{"role": "assistant", "content": c}] for c in completions] if chat else completions
    state = types.SimpleNamespace(global_step=step)

    def log_metric(name: str, value: float) -> None:
        logged[f"rewards/{name}"] = float(value)

    def call(i: int, j: int) -> Any:
        kw = {"prompts": prompts[i:j], "completions": texts[i:j],
              "completion_ids": None if completion_ids is None else completion_ids[i:j], "trainer_state": state,
              "log_extra": lambda *a, **k: None, "log_metric": log_metric,
              **{c: [r.get(c) for r in rows[i:j]] for c in columns}}
        return f.batch(**(kw if takes_all else {k: v for k, v in kw.items() if k in params}))

    return call


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())
