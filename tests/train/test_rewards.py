"""GRPO's reward functions: the built-ins on hand-made completions, weights and labels, user functions imported from
the current directory, the raise/zero policies, and group advantages against TRL's torch arithmetic."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch
from trl.rewards import get_soft_overlong_punishment

from jaxtune.config import ConfigError, objective_config
from jaxtune.rollout.rewards import RewardError, Scores, make_rewards
from jaxtune.train.objectives.advantages import group_advantages, normalized_then_summed


def _rewards(*rewards: dict, **objective):
    return make_rewards(objective_config(name="grpo", rewards=list(rewards), **objective))


def _score(rewards, completions, rows=None, lengths=None, prompts=None):
    n = len(completions)
    return rewards.score(prompts or [f"prompt {i}" for i in range(n)], completions,
                         rows or [{"answer": "0"}] * n, lengths or [1] * n, [f"train.jsonl:{i + 1}" for i in range(n)])


def _column(reward: dict, completions, rows=None, lengths=None, **objective) -> list[float]:
    return _score(_rewards(reward, **objective), completions, rows, lengths).per_function[:, 0].tolist()


def test_exact_number_takes_the_last_number_numerically():
    cases = [  # (completion, answer, score)
        ("The answer is 42.", "42", 1.0),
        ("no number here", "42", 0.0),
        ("", "0", 0.0),
        ("7 apples and 42 pears, so 13", "42", 0.0),  # the last number, not any number
        ("42 first, then 13", "13", 1.0),
        ("It costs $1,234 in all", "1234", 1.0),
        ("It costs $1,234 in all", 1234, 1.0),
        ("1234", "1,234", 1.0),
        ("total 1,234,567.50", "1234567.5", 1.0),
        ("so x = -3", "-3", 1.0),
        ("so x = -3", "3", 0.0),
        ("5-3", "3", 1.0),  # a binary minus is not a sign
        ("3.0", "3", 1.0),
        ("3", 3.0, 1.0),
        ("0.10", 0.1, 1.0),
        ("3.5", "3", 0.0),
        ("1,2,3", "3", 1.0),  # a list, not thousands
        ("1,2345", "2345", 1.0),  # four digits after the comma: not a thousands separator
        ("answer: 12345", "12,345", 1.0),
    ]
    completions = [c for c, _, _ in cases]
    rows = [{"answer": a} for _, a, _ in cases]
    assert _column({"name": "exact_number"}, completions, rows) == [s for _, _, s in cases]


def test_exact_number_reads_the_configured_field_and_a_missing_one_is_a_data_error():
    assert _column({"name": "exact_number", "field": "solution"}, ["= 9"], [{"solution": 9, "answer": 1}]) == [1.0]
    for policy in ("raise", "zero"):  # a data error, whatever the policy
        with pytest.raises(RewardError, match=r"'exact_number'.*train\.jsonl:2 has no field 'answer'.*"
                                              r"objective\.rewards\[0\]\.field"):
            _column({"name": "exact_number"}, ["1", "2"], [{"answer": 1}, {"question": "q"}], reward_errors=policy)
    with pytest.raises(RewardError, match=r"train\.jsonl:1 has answer='#### 72', not a number"):
        _column({"name": "exact_number"}, ["72"], [{"answer": "#### 72"}])


def test_regex_compares_the_first_group_stripped():
    reward = {"name": "regex", "pattern": r"<answer>(.*?)</answer>"}
    completions = ["<answer> Paris </answer>", "<answer>paris</answer>", "Paris", "<answer>Paris</answer><answer>x",
                   "x <answer>132</answer>"]
    rows = [{"answer": "Paris"}, {"answer": "Paris"}, {"answer": "Paris"}, {"answer": " Paris\n"}, {"answer": 132}]
    assert _column(reward, completions, rows) == [1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(RewardError, match=r"'regex'.*train\.jsonl:1 has no field 'answer'"):
        _column(reward, ["x"], [{}])
    with pytest.raises(ConfigError, match=r"objective\.rewards\[0\]\.pattern.*no group"):
        _rewards({"name": "regex", "pattern": r"\d+"})


def test_format_matches_the_whole_stripped_completion_across_lines():
    reward = {"name": "format", "pattern": r"<think>.*?</think>\s*<answer>.*?</answer>"}
    completions = ["<think>a\nb</think>\n<answer>1</answer>", "<think>a</think><answer>1</answer>\n\n  ",
                   "  <think>a</think><answer>1</answer>", "<think>a</think><answer>1</answer> extra",
                   "<answer>1</answer>"]
    assert _column(reward, completions) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_length_is_dapos_soft_overlong_penalty():
    lengths = [0, 60, 79, 80, 81, 90, 99, 100, 101, 500]
    mine = _column({"name": "length", "max_tokens": 100, "buffer": 20}, ["x"] * len(lengths), lengths=lengths)
    np.testing.assert_array_equal(np.float32(mine), np.float32([0, 0, 0, 0, -0.05, -0.5, -0.95, -1, -1, -1]))
    trl = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)([[1] * n for n in lengths])
    np.testing.assert_allclose(mine, trl, rtol=0, atol=1e-7)
    # Defaults: max_tokens = objective.max_completion_length, buffer = max_tokens // 4.
    assert _column({"name": "length"}, ["x"] * 4, lengths=[6, 7, 8, 9], max_completion_length=8) == [
        0.0, -0.5, -1.0, -1.0]
    assert _column({"name": "length"}, ["x"] * 3, lengths=[2, 3, 4], max_completion_length=3) == [0.0, -1.0, -1.0]
    with pytest.raises(ConfigError, match=r"objective\.rewards\[0\]\.buffer=9 is more than its max_tokens=8"):
        _rewards({"name": "length", "max_tokens": 8, "buffer": 9})


def test_weights_totals_labels_and_accuracy():
    rewards = _rewards({"name": "format", "pattern": r".*\d", "weight": 0.5}, {"name": "length", "max_tokens": 4,
                       "buffer": 2}, {"name": "exact_number", "weight": 2.0}, {"name": "format", "pattern": "x.*"},
                       {"name": "regex", "pattern": r"(\d+)"})
    assert rewards.labels == ["format", "length", "exact_number", "format_2", "regex"]
    assert rewards.weights.dtype == np.float32 and rewards.weights.tolist() == [0.5, 1.0, 2.0, 1.0, 1.0]
    assert rewards.accuracy == 2
    s = _score(rewards, ["x 7", "y 8", "z"], [{"answer": 7}, {"answer": 7}, {"answer": 7}], [1, 3, 4])
    expected = np.array([[1, 0, 1, 1, 1], [1, -0.5, 0, 0, 0], [0, -1, 0, 0, 0]], np.float32)
    assert s.per_function.dtype == np.float32 and s.per_function.shape == (3, 5)
    np.testing.assert_array_equal(s.per_function, expected)
    assert s.total.dtype == np.float32 and s.total.tolist() == [4.5, 0.0, -1.0]
    assert s.errors == {}
    assert _rewards({"name": "format", "pattern": "x"}, {"name": "length"}).accuracy is None
    assert _rewards({"name": "length"}, {"name": "regex", "pattern": "(x)"}).accuracy == 1


def _module(tmp_path, monkeypatch, source: str, name: str) -> None:
    """Writes module ``name`` into tmp_path, the current directory (not on sys.path: make_rewards adds it)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_user_function_gets_the_batch_and_its_scores_are_used(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, """
        CALLS = []

        def has_answer(prompts, completions, rows):
            CALLS.append((prompts, completions, rows))
            return [float(r["answer"] in c) + len(p) / 100 for p, c, r in zip(prompts, completions, rows)]

        class Scorer:
            @staticmethod
            def numpy(prompts, completions, rows):
                import numpy as np
                return np.array([len(c) for c in completions], np.int64)
        """, "my_rewards_ok")
    rewards = _rewards({"name": "my_rewards_ok:has_answer", "weight": 2.0}, {"name": "my_rewards_ok:Scorer.numpy"},
                       {"name": "my_rewards_ok:has_answer"})
    assert str(tmp_path) not in sys.path  # the current directory was on sys.path for the import only
    assert rewards.labels == ["has_answer", "Scorer.numpy", "has_answer_2"] and rewards.accuracy is None
    prompts = ["ab", [{"role": "user", "content": "q"}]]
    rows = [{"answer": "12"}, {"answer": "x", "id": 3}]
    s = rewards.score(prompts, ["is 12", "no"], rows, [3, 1], ["a:1", "a:2"])
    np.testing.assert_allclose(s.per_function, [[1.02, 5, 1.02], [0.01, 2, 0.01]], rtol=1e-6)
    np.testing.assert_allclose(s.total, [2 * 1.02 + 5 + 1.02, 2 * 0.01 + 2 + 0.01], rtol=1e-6)
    calls = sys.modules["my_rewards_ok"].CALLS
    assert len(calls) == 2 and calls[0] == (prompts, ["is 12", "no"], rows)  # once per batch, keywords, as given


def test_a_reward_marked_accuracy_is_the_held_out_success_criterion(tmp_path, monkeypatch):
    """``accuracy: true`` makes a user function the success criterion held-out accuracy counts (not only the
    built-in answer checks); ``accuracy: false`` keeps a built-in check out; two marked rewards are refused."""
    _module(tmp_path, monkeypatch, """
        def solved(prompts, completions, rows):
            return [float(r["answer"] in c) for c, r in zip(completions, rows)]
        """, "my_rewards_acc")
    marked = {"name": "my_rewards_acc:solved", "accuracy": True}
    assert _rewards({"name": "my_rewards_acc:solved"}).accuracy is None  # unmarked: no accuracy to report
    assert _rewards({"name": "exact_number"}, marked).accuracy == 1  # the marked one, not the first built-in
    assert _rewards({"name": "exact_number", "accuracy": False}, {"name": "regex", "pattern": "(x)"}).accuracy == 1
    assert _rewards({"name": "exact_number", "accuracy": False}).accuracy is None
    with pytest.raises(ValueError, match="2 rewards set accuracy: true"):
        _rewards(marked, {"name": "exact_number", "accuracy": True})


def test_labels_are_unique_even_against_a_function_named_like_a_suffixed_one(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "def format_2(prompts, completions, rows):\n    return [0.0] * len(rows)\n",
            "my_rewards_labels")
    rewards = _rewards({"name": "format", "pattern": "a"}, {"name": "format", "pattern": "b"},
                       {"name": "my_rewards_labels:format_2"}, {"name": "my_rewards_labels:format_2"})
    assert rewards.labels == ["format", "format_3", "format_2", "format_2_2"]


@pytest.mark.parametrize("name, match", [
    ("no_such_module_xyz:f", r"cannot import module 'no_such_module_xyz' \(ModuleNotFoundError"),
    ("my_rewards_bad:scroe", r"'my_rewards_bad' \(.*my_rewards_bad\.py\) has no 'scroe'; did you mean 'score'\?"),
    ("my_rewards_bad:VALUE", r"my_rewards_bad\.VALUE is a int, not a function"),
    ("my_rewards_bad.py:score", r"name the module, not its file: my_rewards_bad:score"),
    ("my_rewards_broken:f", r"cannot import module 'my_rewards_broken' \(ZeroDivisionError: division by zero\)"),
    ("my_rewards_bad:", r"a reward function of your own is named module:function"),
])
def test_user_function_import_errors_name_the_key(tmp_path, monkeypatch, name, match):
    _module(tmp_path, monkeypatch, "VALUE = 3\n\ndef score(prompts, completions, rows):\n    return []\n",
            "my_rewards_bad")
    _module(tmp_path, monkeypatch, "1 / 0\n", "my_rewards_broken")
    with pytest.raises(ConfigError, match=match) as raised:
        _rewards({"name": "length"}, {"name": name})
    assert str(raised.value).startswith(f"objective.rewards[1].name={name!r}: ")


BAD = """
    import math

    def boom(prompts, completions, rows):
        if any("bad" in c for c in completions):
            raise KeyError("no such thing")
        return [1.0] * len(completions)

    def nan(prompts, completions, rows):
        return [math.nan if "bad" in c else 1.0 for c in completions]

    def none(prompts, completions, rows):
        return [None if "bad" in c else 1.0 for c in completions]

    def text(prompts, completions, rows):
        return ["1.0" if "bad" in c else 1.0 for c in completions]

    def short(prompts, completions, rows):
        return [1.0]
    """


@pytest.mark.parametrize("function, match", [
    ("boom", r"reward 'boom' raised KeyError: 'no such thing' on the row train\.jsonl:2;"),
    ("nan", r"reward 'nan' scored the completion of the row train\.jsonl:2 nan, not a finite number"),
    ("none", r"reward 'none' scored the completion of the row train\.jsonl:2 None, not a finite number"),
    ("text", r"reward 'text' scored the completion of the row train\.jsonl:2 '1\.0', not a finite number"),
])
def test_a_failing_user_function_raises_or_scores_zero(tmp_path, monkeypatch, function, match):
    _module(tmp_path, monkeypatch, BAD, "my_rewards_fail")
    completions = ["good", "bad", "good"]
    with pytest.raises(RewardError, match=match + r".*objective\.reward_errors: zero") as raised:
        _score(_rewards({"name": "length"}, {"name": f"my_rewards_fail:{function}"}), completions)
    assert "\n" not in str(raised.value)
    if function == "boom":
        assert isinstance(raised.value.__cause__, KeyError)

    s = _score(_rewards({"name": "length"}, {"name": f"my_rewards_fail:{function}", "weight": 3.0},
                        reward_errors="zero"), completions)
    # A call that raised scores its whole batch 0; a bad score only its completion.
    scored = [0.0, 0.0, 0.0] if function == "boom" else [1.0, 0.0, 1.0]
    assert s.per_function[:, 1].tolist() == scored and s.total.tolist() == [3 * x for x in scored]
    assert s.errors == {function: 3 if function == "boom" else 1}
    assert _score(_rewards({"name": f"my_rewards_fail:{function}"}, reward_errors="zero"), ["good"]).errors == {}


def test_a_wrong_number_of_scores_always_raises(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, BAD, "my_rewards_short")
    for policy in ("raise", "zero"):
        with pytest.raises(RewardError, match=r"reward 'short' returned 1 scores for 2 completions \(from "
                                              r"train\.jsonl:1 on\); it must return one number per completion"):
            _score(_rewards({"name": "my_rewards_short:short"}, reward_errors=policy), ["a", "b"])


def _trl_advantages(per_function: np.ndarray, weights: list[float], g: int, scale: str,
                    aggregation: str = "sum_then_normalize") -> tuple[np.ndarray, np.ndarray]:
    """TRL 1.16's GRPOTrainer advantage arithmetic (``_generate_and_score_completions``), step by step in float32
    torch with TRL's own ``nanstd``: the weighted nansum (or GDPO's per-function normalisation first), unscorable
    completions NaN, group or batch std, 1e-4, NaN advantages to 0; and its ``frac_reward_zero_std`` flags."""
    from trl.trainer.utils import nanstd

    r, w = torch.tensor(per_function, dtype=torch.float32), torch.tensor(weights, dtype=torch.float32)
    unscorable = torch.isnan(r).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (r * w[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if scale != "batch" else \
            nanstd(rewards).expand_as(rewards)
        advantages = rewards - mean
        if scale != "none":
            advantages = advantages / (std + 1e-4)
    else:
        grouped = r.view(-1, g, r.shape[1])
        k = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
        rewards = (k.view(-1, r.shape[1]) * w[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    zero = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0).numpy(), zero.numpy()


def _scores(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """(n, 2) score tables: normal; 0/1 answers and a format bonus; groups whose rewards agree (std 0); stds of the
    order of the 1e-4 added; and "does not apply" (NaN) in one function here and there and in both for two rows."""
    agree = np.repeat(np.array([[0.0, 1.0], [1.0, 1.0]]), n // 2, axis=0)
    declined = rng.normal(size=(n, 2))
    declined[rng.random(n) < 0.3, 1] = np.nan
    declined[[1, n - 1]] = np.nan
    return [rng.normal(size=(n, 2)), np.stack([rng.integers(0, 2, n), rng.integers(0, 2, n) * 0.5], 1), agree,
            rng.normal(size=(n, 2)) * 1e-4, declined]


@pytest.mark.parametrize("group", [2, 4, 8])
@pytest.mark.parametrize(("scale", "aggregation"), [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"),
                                                    ("none", "sum_then_normalize"), ("group", "normalize_then_sum")])
def test_grpo_advantages_match_trl(group, scale, aggregation):
    """Advantages and zero-std flags equal TRL 1.16's (float32) to 1e-5 for every scale_rewards and
    multi_objective_aggregation, with per-function weights and unscorable completions (0 advantage, left out of
    their group's mean and std). GDPO's aggregation normalises over the batch itself (scale_rewards with it is
    refused: tests/test_user_errors.py)."""
    weights = [1.0, 0.5]  # sums exact in float32: equal rewards have std 0 in TRL too, not float32 noise
    for per_function in _scores(np.random.default_rng(group), 6 * group):
        done = Scores(per_function=per_function.astype(np.float32), errors={},
                      total=np.nansum(per_function * weights, axis=1).astype(np.float32))
        if aggregation == "sum_then_normalize":
            mine, zero = group_advantages(done.scored_total, group, scale)
        else:
            mine, zero = normalized_then_summed(done.per_function, np.asarray(weights), group)
        want, want_zero = _trl_advantages(per_function, weights, group, scale, aggregation)
        assert mine.dtype == np.float32 and mine.shape == (6 * group,) and not np.isnan(mine).any()
        np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(zero, want_zero)
    assert group_advantages(np.array([1, 3, 5, 5], np.float32), 2, False)[0].tolist() == [-1, 1, 0, 0]
    with pytest.raises(ValueError, match="group=3"):
        group_advantages(np.zeros(8, np.float32), 3, scale)
