"""GRPO end to end, through `jaxtune.loop.train`: completions sampled inside the loop, scored, trained on.

Tiny models on the generated arithmetic prompts (`synthetic:arithmetic-prompts`' first rows), CPU. Checked: the train
step compiles once and the sampler once per bucket (no recompiles after a bucket's first step); train rows carry the
rollout's and the objective's metrics (TRL's names), eval rows held-out accuracy and reward; samples.jsonl and
report.md the completions with their rewards; a killed LoRA run (KL to the base with the adapters off, two passes per
batch) resumes bitwise; a reward function that raises is one line naming it and the row, or scored 0 and counted;
the torchax backend trains with its own sampler; the README's commands run. The loss itself is checked against TRL in
test_grpo_objective.py.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from helpers.run_outputs import metric_rows
from helpers.tiny_runs import (
    GRPO_REST,
    arithmetic_prompts_file,
    assert_kill9_resume_is_bitwise,
    run_overrides,
    torchax_lora_config,
)

from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.loop import train

ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/exact_number/mean",
                   "rewards/length/mean", "rewards/length/std", "completions/mean_length", "completions/max_length",
                   "completions/clipped_ratio", "time/generation", "time/rewards", "generation_tok_s")
OBJECTIVE_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                     "sampler_logp_diff/mean", "sampler_logp_diff/max")
# |sampler - trainer| log-prob of a completion token, float32 (two programs: the cache's, the step's)
SAMPLER_TOL = 1e-5


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return arithmetic_prompts_file(tmp_path_factory.mktemp("prompts"))


@pytest.fixture
def grpo(prompts_file, tmp_path, data_cache):
    """grpo("objective.beta=0.04", ...) -> overrides of a tiny native GRPO run in this test's tmp dir."""
    return run_overrides(GRPO_REST, prompts_file, tmp_path, data_cache)


def test_grpo_trains_with_a_reference_and_reports(grpo):
    """Full fine-tuning with a KL penalty (the reference a frozen copy): one train-step compile per length; the
    sampler compiles one program for the rollouts' shape and one for the held-out prompts', and never again (4 steps,
    3 evaluations); every metric is logged and finite; the evaluations and report.md show accuracy and rewards."""
    cfg = load_config(None, grpo("objective.beta=0.04"))
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    assert result.sampler_compiles == 2, result.sampler_compiles
    train_rows, eval_rows = metric_rows(cfg.run_path, "train"), metric_rows(cfg.run_path, "eval")
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for row in train_rows:
        assert set(ROLLOUT_METRICS + OBJECTIVE_METRICS) <= set(row), sorted(row)
        assert np.isfinite([row[k] for k in ROLLOUT_METRICS + OBJECTIVE_METRICS]).all(), row
        assert 1 <= row["completions/mean_length"] <= row["completions/max_length"] <= 16
        assert row["count"] == pytest.approx(row["completions/mean_length"] * 16)  # dapo counts completion tokens
        assert row["tokens"] > row["count"] and 0.0 <= row["pad_fraction"] < 1.0  # prompts too; real tokens only
        assert row["sampler_logp_diff/max"] <= SAMPLER_TOL, row  # the sampler's log-probs are the trainer's
    assert train_rows[0]["kl"] == 0.0 and train_rows[-1]["kl"] > 0  # the policy leaves its reference
    assert any(r["reward_std"] > 0 for r in train_rows)
    assert [r["step"] for r in eval_rows] == [0, 2, 4]
    for row in eval_rows:
        assert 0.0 <= row["accuracy"] <= 1.0 and np.isfinite(row["reward"])
    samples = [json.loads(line) for line in (cfg.run_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4 + [4] * 4
    assert set(samples[0]["rewards"]) == {"exact_number", "length"} and samples[0]["text"].startswith("user: ")
    report = (cfg.run_path / "report.md").read_text()
    assert "| step | held-out accuracy | held-out reward |" in report
    assert f"| 4 | {eval_rows[-1]['accuracy']:.1%} (" in report
    assert "Held-out accuracy (8 held-out prompts" in report and "## Held-out prompt 1" in report


def test_grpo_lora_kill9_and_resume_is_bitwise(grpo, tmp_path):
    """LoRA GRPO with a KL penalty (the base with the adapters off), two passes per batch and adaptive entropy control
    (its weight train state, moved twice a step), killed after step 4 with step 3 committed, resumed: the rollouts
    are sampled again with the same keys and the weight goes on from the checkpoint's, so the losses of steps 4-5 and
    the final adapters equal the uninterrupted run's bitwise."""
    lora = ["model.lora.rank=4", "objective.beta=0.04", "objective.num_iterations=2", "train.steps=5",
            "eval.every=0", "eval.exact_match=0", "checkpoint.every=3", "checkpoint.keep=5",
            "objective.use_adaptive_entropy=true", "objective.entropy_coef=0.01", "objective.entropy_target=50"]
    assert_kill9_resume_is_bitwise(tmp_path, grpo, lora, steps=5, kill_at=4, commit=3)
    for run in ("ref", "killed"):  # entropy stays under the target: up by 2 x 0.005 a step, from 0.01
        rows = {r["step"]: r for r in metric_rows(tmp_path / run, "train")}
        assert [rows[s]["entropy_coef"] for s in (4, 5)] == pytest.approx([0.05, 0.06]), rows
        assert rows[5]["loss"] < rows[5]["policy_loss"]  # the bonus applies


REWARD_MODULE = """
def flaky(prompts, completions, rows):
    if any(int(row["answer"]) % 2 for row in rows):
        raise ZeroDivisionError("no reward for an odd sum")
    return [1.0 for _ in completions]
"""


@pytest.mark.parametrize("policy", ["raise", "zero"])
def test_a_reward_function_that_raises(grpo, prompts_file, tmp_path, monkeypatch, capsys, policy):
    """A user reward (module:function) that raises on the prompts with an odd sum: one line naming it and such a
    prompt's file:line, exit 2 (reward_errors=raise); or the batch's completions scored 0 and counted (zero)."""
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    over = grpo("objective.rewards=[{name: 'my_rewards:flaky'}]", f"objective.reward_errors={policy}",
                "train.steps=2", "eval.every=0", "eval.exact_match=0", "data.val_fraction=0")
    (tmp_path / "grpo.yaml").write_text("name: grpo\n")
    code = main(["train", str(tmp_path / "grpo.yaml"), *over])
    err = capsys.readouterr().err
    if policy == "raise":
        assert code == 2
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert "flaky" in lines[0] and "ZeroDivisionError" in lines[0], lines[0]
        where = re.search(re.escape(str(prompts_file)) + r":(\d+)", lines[0])
        assert where, lines[0]
        row = json.loads(prompts_file.read_text().splitlines()[int(where[1]) - 1])
        assert int(row["answer"]) % 2 == 1, (lines[0], row)
    else:
        assert code == 0, err
        rows = metric_rows(tmp_path / "run", "train")
        assert sum(r.get("reward_errors/flaky", 0) for r in rows) >= 16  # a batch with an odd sum: all 16 zeroed


LENGTH_MODULE = """
def shorter(completion_ids, **kwargs):
    return [-float(len(ids)) for ids in completion_ids]


def longer(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
"""


@pytest.mark.parametrize("objective", ["grpo", "rloo", "reinforce_pp"])
def test_grpo_moves_the_policy_toward_what_the_reward_prefers(grpo, tmp_path, monkeypatch, objective):
    """End to end, the direction of learning: from the same weights and sampling keys, a reward for shorter
    completions makes them shorter than a reward for longer ones does (a sign flipped anywhere between the rewards,
    the advantages, the rows and the loss, or completions scored against another row's, makes it the other way).
    RLOO (its leave-one-out baseline, its per-sequence loss) and REINFORCE++ (the batch's baseline) likewise."""
    (tmp_path / "length_rewards.py").write_text(textwrap.dedent(LENGTH_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "length_rewards", raising=False)
    lengths = {}
    for name in ("shorter", "longer"):
        cfg = load_config(None, [*grpo(f"objective.rewards=[{{name: 'length_rewards:{name}'}}]", "train.steps=8",
                                       "eval.every=0", "eval.exact_match=0", "checkpoint.every=8",
                                       "objective.temperature=1.0", f"objective.name={objective}",
                                       *(["objective.beta=0.0"] if objective != "grpo" else [])),
                                 f"run_dir={tmp_path / name}"])
        train(cfg)
        lengths[name] = [r["completions/mean_length"] for r in metric_rows(cfg.run_path, "train")]
    assert lengths["shorter"][0] == lengths["longer"][0]  # step 1: the same weights, the same samples
    late = {name: float(np.mean(v[-3:])) for name, v in lengths.items()}
    assert late["shorter"] < lengths["shorter"][0] - 2 and late["shorter"] < late["longer"] - 2, lengths


def test_rloo_lora_with_the_kl_in_the_reward_trains_and_compiles_once(grpo, tmp_path):
    """RLOO, LoRA, beta 0.05 (the KL to the base with the adapters off, put into the rewards before the step's
    update, on the whole batch), 2 micro-batches: one program per length met, the rollout's and objective's metrics
    logged and finite, the KL 0 at step 1 (the policy is the reference) and not after an update."""
    cfg = load_config(None, grpo("objective.name=rloo", "objective.beta=0.05", "model.lora.rank=4", "train.steps=3",
                                 "train.micro_batches=2", "eval.every=0", "eval.exact_match=0"))
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    rows = metric_rows(cfg.run_path, "train")
    assert set(ROLLOUT_METRICS + OBJECTIVE_METRICS) <= set(rows[-1]), rows[-1]
    assert all(np.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] != 0.0
    assert rows[-1]["sampler_logp_diff/max"] <= SAMPLER_TOL


def test_torchax_grpo_lora_samples_with_its_own_generator(grpo, tmp_path):
    cfg = torchax_lora_config(grpo("train.steps=2", "eval.every=0", "eval.exact_match=0"), tmp_path)
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths) and result.sampler_compiles >= 1
    row = metric_rows(cfg.run_path, "train")[-1]
    assert set(ROLLOUT_METRICS + OBJECTIVE_METRICS) <= set(row) and row["completions/mean_length"] >= 1
    assert row["sampler_logp_diff/max"] <= SAMPLER_TOL, row


def test_grpo_quickstart_as_the_readme_runs_it(quickstart_sft_model, tmp_path, data_cache, capsys):
    """The README's commands, shortened: the fine-tuning quickstart, its export (done once, `quickstart_sft_model`),
    then grpo-quickstart from it, then `jaxtune eval` of the GRPO run."""
    model, run = quickstart_sft_model, tmp_path / "grpo"
    fast = [f"data.cache_dir={data_cache}", "eval.prompts=[]", "logging.progress=false", "logging.tensorboard=false"]
    capsys.readouterr()
    assert main(["train", "grpo-quickstart", f"model.from_hf={model}", f"run_dir={run}", "train.steps=2",
                 "objective.prompts_per_step=2", "eval.every=0", "eval.exact_match=4", "checkpoint.every=2",
                 "logging.every=1", *fast]) == 0
    out = capsys.readouterr().out
    assert "prompt data: 10000 rows ->" in out and "held-out accuracy" in out
    assert "grpo: 2 prompts x 8 completions = 16 completions a step" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step_compiles"] == len(summary["step_lengths"])  # one program per batch length, none again
    last = metric_rows(run, "eval")[-1]
    assert [r["step"] for r in metric_rows(run, "eval")] == [0, 2]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0  # the same held-out prompts, greedily: the same scores as the run's last
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scored["step"] == 2 and scored["prompts"] == 4
    assert scored["accuracy"] == last["accuracy"] and scored["reward"] == pytest.approx(last["reward"])


def test_grpo_with_shared_prompts_trains_as_a_row_per_completion(grpo, tmp_path):
    """``data.share_prompts=true`` (each prompt's 4 completions one row, the prompt once): the same completions (the
    sampler does not see the layout) and step 1's loss and gradient norm to float rounding, one program per length
    met; at temperature 0.7 the sampler's log-probs are the trainer's (of the tempered distribution) in both."""
    base = ["objective.beta=0.04", "train.steps=1", "eval.every=0", "eval.exact_match=0", "objective.temperature=0.7"]
    shared = load_config(None, [*grpo(*base, "data.share_prompts=true"), f"run_dir={tmp_path / 'shared'}"])
    plain = load_config(None, [*grpo(*base, "data.share_prompts=false"), f"run_dir={tmp_path / 'plain'}"])
    a, _ = train(shared), train(plain)
    # one program per (prompt slots, completion slots) met, rows in regions longer than data.seq_len
    assert a.step_compiles == len(a.step_lengths) and all(isinstance(k, tuple) for k in a.step_lengths)
    assert max(p + 4 * c for p, c in a.step_lengths) > 48
    (ra,), (rb,) = metric_rows(shared.run_path, "train"), metric_rows(plain.run_path, "train")
    assert ra["completions/mean_length"] == rb["completions/mean_length"] and ra["reward"] == rb["reward"]
    assert abs(ra["step_loss"] - rb["step_loss"]) <= 1e-6 + 1e-5 * abs(rb["step_loss"])  # a mean of ~0 advantages
    assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)  # the gradients agree too
    assert ra["tokens"] < rb["tokens"]  # the prompt once per group
    assert ra["sampler_logp_diff/max"] <= SAMPLER_TOL and rb["sampler_logp_diff/max"] <= SAMPLER_TOL, (ra, rb)
    assert ra["sampler_logp_diff/mean"] > 0  # computed, not a constant: two programs round differently


HALF_MODULE = """
def half(prompts, completions, rows):
    # even sums: every completion 1 (a group without signal); odd sums: 1 for a completion of even length
    return [1.0 if int(row["answer"]) % 2 == 0 else float(len(c) % 2 == 0) for c, row in zip(completions, rows)]


def flat(prompts, completions, rows):
    return [1.0 for _ in completions]
"""


def test_dynamic_sampling_trains_on_groups_with_signal(grpo, tmp_path, monkeypatch):
    """objective.dynamic_sampling (DAPO's): a reward that gives half the prompts (even sums) no signal; each step
    drops their groups and samples the data's next prompts until it holds prompts_per_step groups whose rewards
    differ, so every trained group is informative where the budget sufficed (frac_reward_zero_std = 1 - the logged
    informative fraction), some steps take extra rounds, and the groups sampled are 4 a round. With a reward that
    never differs, every step spends its max_resample rounds and trains on groups without signal (advantage 0),
    said by informative_fraction 0. The sampler compiles no extra program for the extra rounds."""
    (tmp_path / "half_rewards.py").write_text(textwrap.dedent(HALF_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "half_rewards", raising=False)
    rows = {}
    for name, extra in (("half", []), ("flat", ["objective.max_resample=2"])):
        cfg = load_config(None, [*grpo(f"objective.rewards=[{{name: 'half_rewards:{name}'}}]", "train.steps=3",
                                       "eval.every=0", "eval.exact_match=0", "checkpoint.every=3",
                                       "objective.dynamic_sampling=true", *extra), f"run_dir={tmp_path / name}"])
        result = train(cfg)
        assert result.sampler_compiles == 1, result.sampler_compiles
        rows[name] = metric_rows(cfg.run_path, "train")
    for r in rows["half"]:
        assert r["dynamic_sampling/groups_sampled"] == 4 * r["dynamic_sampling/rounds"]
        assert r["frac_reward_zero_std"] == pytest.approx(1 - r["dynamic_sampling/informative_fraction"])
        assert r["dynamic_sampling/groups_dropped"] == r["dynamic_sampling/groups_sampled"] - 4
    assert any(r["dynamic_sampling/rounds"] > 1 for r in rows["half"])
    assert all(r["dynamic_sampling/informative_fraction"] == 1.0 for r in rows["half"]), rows["half"]
    for r in rows["flat"]:
        assert (r["dynamic_sampling/rounds"], r["dynamic_sampling/informative_fraction"]) == (3.0, 0.0)
        assert r["frac_reward_zero_std"] == 1.0 and r["dynamic_sampling/groups_dropped"] == 8.0


def test_dynamic_sampling_kill9_and_resume_is_bitwise(grpo, tmp_path):
    """Dynamic sampling draws extra prompt batches from the data: a run killed after step 3 with step 2 committed
    resumes at the data position the checkpoint saved and samples the same rounds, so its losses equal the
    uninterrupted run's bitwise."""
    over = ["model.lora.rank=4", "objective.dynamic_sampling=true", "objective.max_resample=2", "train.steps=4",
            "eval.every=0", "eval.exact_match=0", "checkpoint.every=2", "checkpoint.keep=5"]
    assert_kill9_resume_is_bitwise(tmp_path, grpo, over, steps=4, kill_at=3, commit=2)
    assert all(r["dynamic_sampling/rounds"] > 1 for r in metric_rows(tmp_path / "ref", "train"))  # extra draws
