"""Orbax checkpoints of the whole run: train state, data-iterator position and the resolved config.

Orbax writes each step into a temporary directory and renames it on commit, then marks it with
``commit_success.txt``. A step directory without that mark was interrupted: it is moved aside
(``<step>.incomplete``), never loaded and never deleted, so nothing already written is lost.

A save that fails on an OS error (a full disk, a file-size limit, a read-only directory) is one `WriteError` line
naming the file and the error: its unfinished directory is moved aside the same way, the checkpoints before it stay as
they are, and the next run resumes from the last of them. Orbax reports such a failure again and again from its
background threads (logged tracebacks; callbacks of writes still in flight when its event loop closed); those
reports are silenced, as the line says it all.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxtune.config import CheckpointConfig, ConfigError, identity_diff
from jaxtune.train.run_dir import WriteError, describe

log = logging.getLogger(__name__)

COMMIT_MARK = "commit_success.txt"


# Orbax's temporary directory of a step being saved: <step>.orbax-checkpoint-tmp[-<id>]
_ORBAX_TMP = re.compile(r"(\d+)\.orbax-checkpoint-tmp(-.*)?")


def _set_aside_incomplete(directory: Path, orbax_tmp: bool = False) -> list[Path]:
    """Move interrupted step directories out of Orbax's way; returns where they went. ``orbax_tmp``: the temporary
    directory of a save that just failed, which its error reports (else Orbax deletes those of a killed save when it
    starts)."""
    moved = []
    if jax.process_index() != 0 or not directory.is_dir():
        return moved
    for d in sorted(directory.iterdir()):
        tmp = _ORBAX_TMP.fullmatch(d.name) if orbax_tmp else None
        if d.is_dir() and (tmp or (d.name.isdigit() and not (d / COMMIT_MARK).exists())):
            dest = d.with_name(f"{tmp.group(1) if tmp else d.name}.incomplete-{int(time.time())}")
            shutil.move(str(d), str(dest))
            if not orbax_tmp:
                log.warning("checkpoint %s was never committed (interrupted save); moved to %s, not loaded", d, dest)
            moved.append(dest)
    return moved


def _committed_steps(directory: Path) -> list[int]:
    return sorted(int(d.name) for d in directory.iterdir() if d.name.isdigit() and (d / COMMIT_MARK).exists())


# A tensorstore write error names the file, then the errno: ...Failed writing: "<path>": ... [os_error_code='28']
_TS_ERRNO = re.compile(r"os_error_code='?(\d+)")
_TS_PATH = re.compile(r'"(/[^"]+)"')


def os_error_of(exc: BaseException | None) -> tuple[int, str | None] | None:
    """(errno, file) of the OS error behind ``exc`` (an OSError or a tensorstore error in its chain), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno, exc.filename
        text = str(exc)
        if m := _TS_ERRNO.search(text):
            paths = _TS_PATH.findall(text[:m.start()])
            return int(m.group(1)), paths[-1] if paths else None
        exc = exc.__cause__ or exc.__context__
    return None


def _from_orbax(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _QuietFailedWrites(logging.Filter):
    """Drops the records (Orbax's, and asyncio's about its tasks) of an Orbax write that failed on an OS error: they
    carry its traceback, once per thread and task; `Checkpointer` reports it as one line. A tensorstore write error
    set on a future that nobody awaited (asyncio's "Future exception was never retrieved", logged when the future is
    collected, possibly after the line) has no Orbax frame in its traceback: its message marks it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and os_error_of(exc) and (_from_orbax(exc) or _TS_ERRNO.search(str(exc))))


def _quiet_unraisable(hook):
    """A `sys.unraisablehook` that drops the callbacks of tensorstore writes that finish after the event loop Orbax
    ran them on was closed by a failed save, and passes everything else to ``hook``."""

    def unraisable(u):
        tb = u.exc_traceback
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
                and tb is not None and tb.tb_frame.f_code.co_name == "call_soon_threadsafe"):
            hook(u)

    unraisable.quiets_failed_writes = True
    return unraisable


def _quiet_orbax_failure_reports() -> None:
    """Once per process (the reports come from threads, before and after the failure reaches `Checkpointer`)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietFailedWrites) for f in logger.filters):
            logger.addFilter(_QuietFailedWrites())
    if not getattr(sys.unraisablehook, "quiets_failed_writes", False):
        sys.unraisablehook = _quiet_unraisable(sys.unraisablehook)


class Checkpointer:
    """Saves and restores ``{state, data, config}`` under ``directory/<step>/``."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.every = cfg.every
        self.set_aside = _set_aside_incomplete(self.directory)
        self.saving: int | None = None  # the step of the last save started
        self.failed = False  # a save failed and was reported
        _quiet_orbax_failure_reports()
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
        `jaxtune.config.IDENTITY_KEYS` changed) is refused before any work is done."""
        start = self.latest_step() or 0
        diff = identity_diff(self.read_config(start), config) if start else []
        if diff:
            run_dir = self.directory.parent
            raise ConfigError(f"{run_dir} holds a checkpoint (step {start}) of a different run; these keys differ:\n  "
                              + "\n  ".join(diff)
                              + "\nUse another run_dir (e.g. run_dir=runs/NEW), or restore the original values.")
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
        with self._as_write_error(step):
            self.manager.save(step, args=args, force=True)
        self.saving = step  # in flight until the next save or wait

    @contextlib.contextmanager
    def _as_write_error(self, step: int | None) -> Iterator[None]:
        """A save (``step``'s, or an earlier one still in flight) that fails on an OS error becomes one `WriteError`
        line; its unfinished directory is moved aside, the committed checkpoints stay."""
        try:
            yield
        except Exception as e:
            found = os_error_of(e)
            if found is None:
                raise
            code, path = found
            self.failed = True
            moved = _set_aside_incomplete(self.directory, orbax_tmp=True)
            failed_step = max((int(m.name.partition(".")[0]) for m in moved), default=self.saving or step)
            committed = _committed_steps(self.directory)
            aside = f"; its unfinished files were moved to {', '.join(map(str, moved))}" if moved else ""
            kept = (f"the last complete checkpoint, step {committed[-1]}, is intact and the same command resumes "
                    f"from it" if committed else "there is no complete checkpoint yet")
            raise WriteError(f"checkpoint of step {failed_step} not saved: cannot write {path or self.directory}: "
                             f"{describe(code)}{aside}; {kept}") from None

    @contextlib.contextmanager
    def reporting_failures(self) -> Iterator[None]:
        """Around the loop: when it ends in an error, a save still in flight is waited for, and if that failed too,
        its error is the one reported (the cause: a checkpoint that filled the disk fails the next metrics write)."""
        try:
            yield
        except Exception:
            if self.saving is not None and not self.failed:
                self.wait()
            raise

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
        with self._as_write_error(None):
            self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self.manager.close()
