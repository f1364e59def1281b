"""The training loop end to end: compile once, resume, kill -9 bit-exact, SIGTERM, unfinished checkpoints,
NaN policies and bad inputs. Tiny model, real stdlib text, CPU."""

from __future__ import annotations

import dataclasses
import signal

import jax
import numpy as np
import pytest
from helpers.processes import run_driver, start_driver, wait
from helpers.run_outputs import final_params, losses

from jaxtune import loop as loop_mod
from jaxtune import runtime
from jaxtune.config import ConfigError, load_config
from jaxtune.data import DataError, load_tokenizer, prepare_tokens
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.loop import NonFiniteLossError, train


def test_train_end_to_end_compiles_once_and_resumes(tiny_cfg):
    cfg = tiny_cfg("train.steps=10", "eval.prompts=['def f(x):']", "eval.max_new_tokens=8")
    result = train(cfg)
    run = cfg.run_path
    assert result.step == 10 and result.step_compiles == len(result.step_lengths)
    assert sorted(result.losses) == list(range(1, 11))
    assert result.losses[10] < result.losses[1] - 0.5  # it learns
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "summary.json", "samples.jsonl", "tokenizer"):
        assert (run / name).exists(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "5"]
    assert result.eval_loss is not None and np.isfinite(result.eval_loss)
    assert result.samples and result.samples[0].startswith("def f(x):")

    # The same command again with more steps resumes at 10: only steps 11..15 run, compiled once.
    again = train(tiny_cfg("train.steps=15", "eval.prompts=['def f(x):']", "eval.max_new_tokens=8"))
    assert sorted(again.losses) == list(range(11, 16)) and again.step_compiles == len(again.step_lengths)


def test_resume_with_changed_config_is_refused(tiny_cfg):
    train(tiny_cfg("train.steps=5"))
    with pytest.raises(ConfigError, match=r"model\.n_layer: checkpoint has 2, config has 3") as e:
        train(tiny_cfg("train.steps=10", "model.n_layer=3", "train.seed=4"))
    assert "train.seed" in str(e.value)


@pytest.mark.parametrize("backend", ["native", "torchax"])
def test_kill9_and_resume_is_bit_exact(tmp_path, backend, request):
    """kill -9 after step 6 (checkpoint 5 committed), then the same command again: steps 6-8 and the final params
    equal an uninterrupted run's bitwise."""
    tiny_overrides = request.getfixturevalue("tiny_overrides" if backend == "native" else "torchax_overrides")
    ref_cfg = load_config(None, tiny_overrides + ["train.steps=8", f"run_dir={tmp_path / 'ref'}"])
    assert ref_cfg.checkpoint.every == 5
    prepare_tokens(ref_cfg.data, load_tokenizer(ref_cfg.tokenizer, ref_cfg.data))  # before two processes read it
    over = tiny_overrides + ["train.steps=8", f"run_dir={tmp_path / 'killed'}"]
    cache = tmp_path / "xla-cache"  # the resumed process loads what the killed one compiled
    killing = start_driver(tmp_path, "kill", 6, over, commit=5, compile_cache=cache)
    try:
        ref = train(ref_cfg)  # the uninterrupted run, in this process while the other one runs
        ref_params, _ = final_params(ref_cfg, 8)
    finally:
        killed = wait(killing)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    cfg = load_config(None, over)
    assert Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint).latest_step() == 5
    assert max(losses(cfg.run_path)) == 6  # step 6 ran but was never checkpointed

    resumed = run_driver(tmp_path, "plain", 0, over, compile_cache=cache)  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    resumed_losses = losses(cfg.run_path)
    for s in range(6, 9):
        assert resumed_losses[s] == ref.losses[s], (s, resumed_losses[s], ref.losses[s])  # bitwise, not approximately
    params, _ = final_params(cfg, 8)
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)


def test_sigterm_saves_at_the_step_boundary_and_exits_cleanly(tmp_path, tiny_overrides):
    over = tiny_overrides + [f"run_dir={tmp_path / 'pre'}", "checkpoint.every=100"]
    proc = run_driver(tmp_path, "term", 7, over)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SIGTERM: saved step" in proc.stdout + proc.stderr
    cfg = load_config(None, over)
    saved = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint).latest_step()
    assert saved in (7, 8), saved  # the signal lands while step 8 runs: saved at that boundary, not 20
    result = train(cfg)  # resumes and finishes
    assert result.step == 20 and min(result.losses) == saved + 1


NO_EVAL = "data.val_fraction=0"  # no held-out windows: no evaluation, and no eval step to compile


def test_unfinished_checkpoint_is_never_loaded(tiny_cfg):
    cfg = tiny_cfg("train.steps=10", NO_EVAL)
    train(cfg)
    ckpts = cfg.run_path / "checkpoints"
    planted = ckpts / "15"  # looks like a step, but its save never committed
    (planted / "state").mkdir(parents=True)
    (planted / "state" / "garbage").write_bytes(b"\x00" * 100)
    (ckpts / "20.orbax-checkpoint-tmp-1234").mkdir()
    result = train(tiny_cfg("train.steps=12", NO_EVAL))
    assert sorted(result.losses) == [11, 12]  # resumed from 10, not from the planted 15
    aside = [p for p in ckpts.iterdir() if p.name.startswith("15.incomplete")]
    assert len(aside) == 1 and (aside[0] / "state" / "garbage").exists()  # moved aside, not deleted
    assert not (ckpts / "20.orbax-checkpoint-tmp-1234").exists()


def _poison(monkeypatch, nan_steps: set[int]):
    """Feed NaN into the loss at the given steps through a loss mask (a real NaN path: data, not a mock)."""
    real = loop_mod.make_training_data

    class Poisoned:
        def __init__(self, it):
            self.it, self.step = it, 0

        def __next__(self):
            batch = next(self.it)
            self.step += 1
            mask = np.ones(batch["inputs"].shape, np.float32)
            if self.step in nan_steps:
                mask[0, 0] = np.nan
            return {**batch, "loss_mask": mask}

        def get_state(self):  # the count of batches read is part of the position (the loop reads ahead, then back)
            return {"inner": self.it.get_state(), "read": self.step}

        def set_state(self, s):
            self.it.set_state(s["inner"])
            self.step = s["read"]

    def poisoned_data(*a, **k):
        data = real(*a, **k)
        return dataclasses.replace(data, train_iter=Poisoned(data.train_iter))

    monkeypatch.setattr(loop_mod, "make_training_data", poisoned_data)


def test_nan_abort_keeps_last_good_checkpoint(tiny_cfg, monkeypatch):
    _poison(monkeypatch, {7})
    cfg = tiny_cfg("train.on_nan=abort", NO_EVAL)
    with pytest.raises(NonFiniteLossError, match=r"step 7: loss=nan.*last good checkpoint: 5"):
        train(cfg)
    assert Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint).latest_step() == 5


def test_on_a_kept_cpu_heap_each_step_is_read_before_the_next_and_a_nan_still_stops_at_its_step(tiny_cfg, monkeypatch):
    """With `runtime.HeapWatch` (what `jaxtune train` starts on a CPU run; here without its process-wide mallopt), the
    loop waits for each step and reads its metrics before it dispatches the next, so a step's row is written at once;
    the NaN policy still stops at the poisoned step with the last good checkpoint kept."""
    monkeypatch.setattr(runtime.HeapWatch, "start", classmethod(lambda cls, platform: cls(runtime._libc())))
    read_before, dispatch = {}, loop_mod._train_step

    def recorded(run, state, frozen, batch, shape, step):
        read_before[step] = max(run.log.losses, default=0)  # the last step whose metrics were read
        return dispatch(run, state, frozen, batch, shape, step)

    monkeypatch.setattr(loop_mod, "_train_step", recorded)
    _poison(monkeypatch, {7})
    cfg = tiny_cfg("train.on_nan=abort", NO_EVAL)
    with pytest.raises(NonFiniteLossError, match=r"step 7: loss=nan.*last good checkpoint: 5"):
        train(cfg)
    assert read_before == {k: k - 1 for k in range(1, 8)}  # without the watch: step k - 2 (a step late)


def test_nan_skip_counts_and_aborts_after_k_in_a_row(tiny_cfg, monkeypatch):
    _poison(monkeypatch, {7, 12, 13})
    result = train(tiny_cfg("train.on_nan=skip", "train.max_nan_skips=3", "train.steps=14", NO_EVAL))
    assert result.step == 14 and result.nan_skipped == 3
    assert np.isnan(result.losses[7]) and np.isfinite(result.losses[14])

    _poison(monkeypatch, {3, 4})
    with pytest.raises(NonFiniteLossError, match="2 non-finite steps in a row"):
        train(tiny_cfg("train.on_nan=skip", "train.max_nan_skips=2", NO_EVAL,
                       "run_dir=" + str(tiny_cfg().run_path) + "2"))


def test_missing_source_is_a_named_error(tiny_cfg, tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt"):
        train(tiny_cfg(f"data.sources=[{tmp_path / 'nope.txt'}]"))


def test_empty_corpus_is_a_named_error(tiny_cfg, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no text"):
        train(tiny_cfg(f"data.sources=[{empty}]"))
