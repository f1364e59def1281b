"""Committed checkpoints damaged afterwards (a copy cut short, bit rot, a full network disk): the damaged step is named
in one line, moved aside (never deleted) and the run resumes from the newest readable step, bitwise as if it had
never been saved; with no readable step the error says so and nothing is moved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers.run_outputs import final_params
from helpers.tiny_config import TINY

from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.io import CheckpointError
from jaxtune.job.checkpoint import MANIFEST, Checkpointer, damage
from jaxtune.loop import train
from jaxtune.sharding import make_mesh

RUN = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=10", "data.val_fraction=0", "eval.prompts=[]"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_cache):
    """An 8-step run with checkpoints at steps 2, 4, 6 and 8: (config, its run dir)."""
    run = tmp_path_factory.mktemp("damage") / "run"
    cfg = load_config(None, [*TINY, *RUN, f"run_dir={run}", f"data.cache_dir={data_cache}"])
    train(cfg)
    return cfg


def _copy(cfg, tmp_path: Path, *, drop: tuple[int, ...] = ()):
    """The finished run copied to ``tmp_path`` (without the steps in ``drop``): its config and checkpoints dir."""
    run = tmp_path / "run"
    shutil.copytree(cfg.run_path, run)
    for step in drop:
        shutil.rmtree(run / "checkpoints" / str(step))
    return cfg.model_copy(update={"run_dir": str(run)}), run / "checkpoints"


def _item_file(step_dir: Path, item: str) -> Path:
    """The file to damage in ``item``: the state's largest array file, the data position's or config's JSON."""
    if item == "state":
        return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    return step_dir / item / "metadata"


def _damage(path: Path, how: str) -> None:
    if how == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "deleted":
        path.unlink()
    else:  # garbage of the same size: only the checksum can tell
        path.write_bytes(np.random.default_rng(0).integers(0, 256, path.stat().st_size, dtype=np.uint8).tobytes())


def _abstract(cfg):
    return make_state_spec(cfg, 512, make_mesh(1, 1, 1, jax.devices()[:1])).abstract


def test_every_save_is_sealed_with_sizes_and_checksums(finished):
    for step in (2, 4, 6, 8):
        step_dir = finished.run_path / "checkpoints" / str(step)
        assert (step_dir / MANIFEST).is_file() and damage(step_dir) is None


@pytest.mark.parametrize("how", ["truncated", "deleted", "garbage"])
@pytest.mark.parametrize("item", ["state", "data", "config"])
def test_damaged_latest_step_falls_back_to_the_previous(finished, tmp_path, item, how):
    cfg, ckpts = _copy(finished, tmp_path, drop=(8,))
    bad = _item_file(ckpts / "6", item)
    name = str(bad.relative_to(ckpts / "6"))
    _damage(bad, how)
    ckpt = Checkpointer(ckpts, cfg.checkpoint)
    assert ckpt.resume_step(cfg.to_dict()) == 4
    step, _, data_state = ckpt.restore(4, _abstract(cfg))
    ckpt.close()
    assert step == 4 and data_state  # the data position of step 4 restores too
    (note,) = ckpt.notes(0, 8)
    assert note.startswith(f"checkpoint step 6 is unreadable ({name} ") and "moved to" in note, note
    (aside,) = [p for p in ckpts.iterdir() if p.name.startswith("6.unreadable-")]
    assert (aside / "commit_success.txt").is_file()  # moved whole, never deleted
    assert not (ckpts / "6").exists() and sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit()) == [2, 4]


def test_resume_past_a_damaged_step_is_bitwise_the_uninterrupted_run(finished, tmp_path):
    """Steps 8 gone and 6 cut short: the run says so, redoes 5..8 from step 4, and ends where the original did."""
    cfg, ckpts = _copy(finished, tmp_path, drop=(8,))
    _damage(_item_file(ckpts / "6", "state"), "truncated")
    result = train(cfg)
    assert result.step == 8 and sorted(result.losses) == [5, 6, 7, 8]
    assert any(p.name.startswith("6.unreadable-") for p in ckpts.iterdir())
    got, data_got = final_params(cfg, 8)
    want, data_want = final_params(finished, 8)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert data_got == data_want


def test_without_a_manifest_a_failed_restore_falls_back(finished, tmp_path):
    """A step saved before manifests (or killed between commit and seal) is checked by restoring it."""
    cfg, ckpts = _copy(finished, tmp_path, drop=(8,))
    (ckpts / "6" / MANIFEST).unlink()
    _damage(_item_file(ckpts / "6", "state"), "truncated")
    ckpt = Checkpointer(ckpts, cfg.checkpoint)
    assert ckpt.resume_step(cfg.to_dict()) == 6  # nothing to check it against before restoring
    step, _, _ = ckpt.restore(6, _abstract(cfg))
    ckpt.close()
    assert step == 4
    (note,) = ckpt.notes(0, 8)
    assert note.startswith("checkpoint step 6 is unreadable (restoring it failed: ") and len(note) < 600, note


def test_no_readable_step_is_an_error_that_moves_nothing(finished, tmp_path):
    cfg, ckpts = _copy(finished, tmp_path)
    for step in (2, 4, 6, 8):
        _damage(_item_file(ckpts / str(step), "config"), "garbage")
    before = sorted(p.name for p in ckpts.iterdir())
    with pytest.raises(CheckpointError, match=r"(?s)no checkpoint in .* can be read:\n  step 8: config/metadata has "
                                              r"changed since it was written .*\n  step 6: .*Nothing was moved"):
        Checkpointer(ckpts, cfg.checkpoint).resume_step(cfg.to_dict())
    assert sorted(p.name for p in ckpts.iterdir()) == before


def test_step_damaged_while_a_later_save_runs(finished, tmp_path):
    """Step 4 is cut short while step 6 is being written (asynchronously), then step 6 rots: resuming skips both,
    whichever check catches each (step 4's seal may race the damage), and lands on step 2."""
    cfg, _ = _copy(finished, tmp_path)
    ckpt = Checkpointer(finished.run_path / "checkpoints", cfg.checkpoint)
    _, state, data_state = ckpt.restore(8, _abstract(cfg))
    ckpt.close()
    ckpts = tmp_path / "fresh"
    saver = Checkpointer(ckpts, cfg.checkpoint.model_copy(update={"async_save": True}))
    for step in (2, 4, 6):
        saver.save(step, state, data_state, cfg.to_dict())
        if step == 6:
            _damage(_item_file(ckpts / "4", "state"), "truncated")
    saver.close()
    _damage(_item_file(ckpts / "6", "state"), "garbage")
    reader = Checkpointer(ckpts, cfg.checkpoint)
    start = reader.resume_step(cfg.to_dict())
    step, _, _ = reader.restore(start, _abstract(cfg))
    reader.close()
    assert step == 2
    assert sorted(p.name.partition(".")[0] for p in ckpts.iterdir() if ".unreadable-" in p.name) == ["4", "6"]
