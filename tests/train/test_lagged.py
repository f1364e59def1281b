"""Rollouts sampled ahead (``objective.max_staleness``, `jaxtune.rollout.lagged`), through `jaxtune.loop.train`.

Checked against a reference written here from the run's own parts (its rollout, steps and data, set up by the loop's
`_setup`) in the plain order: step s trains on the rollout of step s (its prompts and seed), sampled with the weights
of update max(0, s - 1 - k). With k = 0 that is the on-policy loop; with k = 1 and 2 the loop's overlapped order must
give the same losses, metrics and final weights bitwise. Also: the lag is corrected (grpo's token_truncate by
default: the importance ratios move off 1 once the sampler lags), a killed run resumes bitwise (the pending
rollouts sampled again from the checkpoint's weights), and the settings that cannot correct (or do not sample) are
refused in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.processes import beside
from helpers.run_outputs import final_params, metric_rows
from helpers.tiny_runs import GRPO_REST, arithmetic_prompts_file, assert_kill9_resume_is_bitwise, run_overrides

from jaxtune import sharding
from jaxtune.backends import backend_of
from jaxtune.config import load_config
from jaxtune.data import load_tokenizer
from jaxtune.loop import _setup, train
from jaxtune.rollout.lagged import copied
from jaxtune.run import load_run

EXTRA = ["optim.lr=3e-2", "eval.every=0", "eval.exact_match=0", "checkpoint.every=100", "train.compile_ahead=0"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    return arithmetic_prompts_file(tmp_path_factory.mktemp("prompts"))


@pytest.fixture
def grpo(prompts_file, tmp_path, data_cache):
    """grpo(*extra, run=...) -> the tiny GRPO run's overrides (`GRPO_REST`, 4 steps, no evaluation), then ``extra``."""
    return run_overrides([*GRPO_REST, *EXTRA], prompts_file, tmp_path, data_cache)


def reference(cfg, k: int) -> tuple[list[float], list[dict], object]:
    """The losses, train metrics and final trained params of ``cfg`` trained in the plain order (see the module):
    each step's rollout sampled from the weights of update max(0, s - 1 - k), kept as a list of versions."""
    run = _setup(cfg, backend_of(cfg), cfg.run_path, False)
    versions, rollouts, losses, rows = [copied(run.state.params)], {}, [], []
    state, it = run.state, run.data.train_iter
    with sharding.use_mesh(run.mesh):
        for s in range(1, cfg.train.steps + 1):
            for r in range(len(rollouts) + 1, min(s + k, cfg.train.steps) + 1):  # in step order, as the data reads
                weights = run.steps.weights(versions[max(0, r - 1 - k)], run.frozen)
                rollouts[r] = run.rollout.batch(weights, run.data.prompts.train, next(it), r - 1,
                                                more=lambda: next(it))
            batch = run.shapes.fit(rollouts[s][0])[0]
            state, metrics = run.steps.train(state, sharding.global_batch(run.mesh, batch), run.frozen)
            versions.append(copied(state.params))
            metrics = jax.device_get(metrics)
            losses.append(float(metrics["loss"]))
            rows.append(metrics)
    run.ckpt.close()
    run.data.close()
    return losses, rows, versions[-1]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_overlapped_loop_equals_the_plain_order(grpo, k, capsys):
    """LoRA GRPO, 4 steps, lag k: the loop's losses, objective metrics and final adapters equal the plain order's
    bitwise; each step logs its staleness min(s - 1, k); the lag is corrected (token_truncate by default), so the
    importance ratios are 1 (to float rounding) while the sampler is not behind, and move off 1 once it is behind
    weights that changed (a step whose groups all scored alike changes none)."""
    over = (f"objective.max_staleness={k}", "model.lora.rank=4")
    cfg = load_config(None, grpo(*over))
    assert cfg.objective.importance_sampling == ("token_truncate" if k else "off")
    assert cfg.objective.old_logps == "trainer" if k else "sampler"
    train(cfg)
    said = capsys.readouterr().out
    rows = metric_rows(cfg.run_path, "train")
    losses, ref_rows, ref_params = reference(load_config(None, grpo(*over, run="ref")), k)
    assert [r["loss"] for r in rows] == losses
    for row, ref in zip(rows, ref_rows):
        assert {key: row[key] for key in ref if key in row} == \
            {key: float(np.asarray(v).item()) for key, v in ref.items() if key in row}
    params, _ = final_params(cfg, 4)
    jax.tree.map(np.testing.assert_array_equal, params, jax.tree.map(np.asarray, ref_params))
    if not k:
        assert "staleness" not in rows[0] and "importance_sampling_ratio/mean" not in rows[0]
        return
    assert [r["staleness"] for r in rows] == [min(s - 1, k) for s in range(1, 5)]
    ratios = [r["importance_sampling_ratio/mean"] for r in rows]
    assert ratios[0] == pytest.approx(1.0, abs=1e-5) and any(abs(x - 1.0) > 1e-4 for x in ratios[1:]), ratios
    assert all(0.0 <= r["importance_sampling_ratio/cut_fraction"] <= 1.0 for r in rows)
    assert f"objective.max_staleness={k}: sampled the rollouts of steps 1-{k} ahead" in said


def test_rloo_sampled_ahead_equals_the_plain_order(grpo):
    """rloo with a step of lag (its old log-probs the sampler's): the loop's losses equal the plain order's."""
    over = ("objective.name=rloo", "objective.max_staleness=1", "model.lora.rank=4")
    cfg = load_config(None, grpo(*over))
    train(cfg)
    rows = metric_rows(cfg.run_path, "train")
    assert [r["loss"] for r in rows] == reference(load_config(None, grpo(*over, run="ref")), 1)[0]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]


@pytest.mark.parametrize("k", [1, 2])
def test_a_killed_overlapped_run_resumes_bitwise(grpo, tmp_path, k):
    """Killed after step 4 with step 3 committed (k = 2: the rollouts of steps 4 and 5 pending, sampled with the
    weights of updates 1 and 2): resumed, they are sampled again from the checkpoint's copies, so steps 4-5 and the
    final adapters equal the uninterrupted run's bitwise."""
    over = [f"objective.max_staleness={k}", "model.lora.rank=4", "train.steps=5", "checkpoint.every=3",
            "checkpoint.keep=5"]
    assert_kill9_resume_is_bitwise(tmp_path, grpo, over, steps=5, kill_at=4, commit=3)


@pytest.mark.parametrize("objective", ["cross_entropy", "dpo", "kto", "gkd"])
def test_a_lag_on_an_objective_that_does_not_sample_is_refused(objective):
    """Objectives that train on the data's rows (gkd: on some steps) have no key max_staleness."""
    data = {"cross_entropy": [], "dpo": ["data.format=preference"], "kto": ["data.format=unpaired"],
            "gkd": ["data.format=prompts", "objective.teacher=x"]}[objective]
    with pytest.raises(Exception, match=f"objective.max_staleness does not apply to objective.name={objective}"):
        load_config(None, [f"objective.name={objective}", *data, "objective.max_staleness=1"])


@pytest.mark.parametrize("extra, message", [
    (["objective.name=rloo", "objective.old_logps=trainer"], "nothing would correct for the stale sampler"),
    (["objective.importance_sampling=off", "objective.old_logps=trainer"], "nothing would correct"),
])
def test_settings_that_cannot_correct_the_lag_are_refused(grpo, extra, message):
    """A lag with the old log-probs the trainer's and no importance correction: nothing would see the lag."""
    with pytest.raises(Exception, match=message):
        load_config(None, grpo("objective.max_staleness=1", *extra))


def test_rloo_takes_the_samplers_log_probs_as_the_old_policys(grpo):
    """rloo (no importance_sampling key) with a lag: its ratio's old log-probs are the sampler's, in bfloat16 too."""
    cfg = load_config(None, grpo("objective.name=rloo", "objective.max_staleness=1", "model.compute_dtype=bfloat16"))
    assert cfg.objective.old_logps == "sampler"
    assert load_config(None, grpo("objective.name=rloo", "model.compute_dtype=bfloat16")).objective.old_logps == \
        "trainer"


SPLIT_SCRIPT = """
import json, sys
from jaxtune.config import load_config
from jaxtune.loop import train
result = train(load_config(None, sys.argv[1:]))
print("RESULT " + json.dumps([result.losses[s] for s in sorted(result.losses)]))
"""


def test_the_samplers_own_devices_change_nothing_but_where_it_runs(grpo, tmp_path):
    """2 CPU devices, mesh.rollout=1: the learner on the first, the sampler (and its copy of the weights, moved after
    each update) on the second. The losses and final adapters equal the run with both on one device, bitwise."""
    over = ["objective.max_staleness=1", "model.lora.rank=4", "eval.every=2", "eval.exact_match=4"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    cfg = load_config(None, grpo(*over))
    load_tokenizer(cfg.tokenizer, cfg.data)  # trained and cached once, before two processes want it
    split = grpo(*over, "mesh.rollout=1", run="split")
    proc = subprocess.Popen([sys.executable, "-c", SPLIT_SCRIPT, *split], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    result, losses = beside(proc, lambda: train(cfg))
    assert losses == [result.losses[s] for s in sorted(result.losses)]
    mine, theirs = final_params(cfg, 4)[0], final_params(load_config(None, split), 4)[0]
    jax.tree.map(np.testing.assert_array_equal, theirs, mine)
    loaded = load_run(tmp_path / "split")  # eval and export take every device here (one): the split is training's
    assert loaded.step == 4 and loaded.spec.mesh.devices.size == 1


def test_sampler_devices_need_a_lag_and_leave_the_learner_some(grpo):
    with pytest.raises(Exception, match=r"mesh\.rollout=1 gives the sampler devices of its own.*needs "
                                        r"objective\.max_staleness >= 1"):
        load_config(None, grpo("mesh.rollout=1"))
    with pytest.raises(Exception, match=r"mesh\.rollout=1 leaves the learner none of the 1 devices"):
        train(load_config(None, grpo("mesh.rollout=1", "objective.max_staleness=1")))
