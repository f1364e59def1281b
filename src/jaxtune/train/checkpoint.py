"""Orbax checkpoints of the whole run: train state, data-iterator position and the resolved config.

Orbax writes each step into a temporary directory and renames it on commit, then marks it with
``commit_success.txt``. A step directory without that mark was interrupted: it is moved aside
(``<step>.incomplete``), never loaded and never deleted, so nothing already written is lost.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxtune.config import CheckpointConfig, ConfigError, identity_diff

log = logging.getLogger(__name__)

COMMIT_MARK = "commit_success.txt"


def _set_aside_incomplete(directory: Path) -> list[Path]:
    """Move interrupted step directories out of Orbax's way; returns where they went."""
    moved = []
    if jax.process_index() != 0 or not directory.is_dir():
        return moved
    for d in sorted(directory.iterdir()):
        if d.is_dir() and d.name.isdigit() and not (d / COMMIT_MARK).exists():
            dest = d.with_name(f"{d.name}.incomplete-{int(time.time())}")
            shutil.move(str(d), str(dest))
            log.warning("checkpoint %s was never committed (interrupted save); moved to %s, not loaded", d, dest)
            moved.append(dest)
    return moved


class Checkpointer:
    """Saves and restores ``{state, data, config}`` under ``directory/<step>/``."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.every = cfg.every
        self.set_aside = _set_aside_incomplete(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,  # Orbax's own temp dirs from a killed save
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "config"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def resume_step(self, config: dict[str, Any]) -> int:
        """The step to resume from (0: none). A checkpoint of a different run (a key of
        `jaxtune.config.IDENTITY_SECTIONS` changed) is refused before any work is done."""
        start = self.latest_step() or 0
        diff = identity_diff(self.read_config(start), config) if start else []
        if diff:
            run_dir = self.directory.parent
            raise ConfigError(f"{run_dir} holds a checkpoint (step {start}) of a different run; these keys differ:\n  "
                              + "\n  ".join(diff) + "\nUse another run_dir (or name), or restore the original values.")
        return start

    def notes(self, start: int, total: int) -> list[str]:
        """What the run log says about the checkpoints it found."""
        lines = [f"resumed from {self.directory / str(start)} (step {start}/{total})"] if start else []
        return lines + [f"ignored an unfinished checkpoint, moved to {moved}" for moved in self.set_aside]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Any, data_state: dict[str, Any], config: dict[str, Any]) -> None:
        """Start saving (asynchronously when configured); a second save waits for the first."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config),
        )
        self.manager.save(step, args=args, force=True)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore the state straight into the shardings carried by ``abstract_state`` (ShapeDtypeStructs)."""
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()),
        )
        return out["state"], out["data"]

    def read_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
