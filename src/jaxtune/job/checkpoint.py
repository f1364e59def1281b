"""Orbax checkpoints of the whole run: train state, data-iterator position and the resolved config; and, in a run
whose reference model is state (TR-DPO's, mixed with the policy during training), that reference.

Orbax writes each step into a temporary directory and renames it on commit, then marks it with
``commit_success.txt``. A step directory without that mark was interrupted: it is moved aside
(``<step>.incomplete``), never loaded and never deleted, so nothing already written is lost.

A save that fails on an OS error (a full disk, a file-size limit, a read-only directory) is one `WriteError` line
naming the file and the error: its unfinished directory is moved aside the same way, the checkpoints before it stay as
they are, and the next run resumes from the last of them. Orbax reports such a failure again and again from its
background threads (logged tracebacks; callbacks of writes still in flight when its event loop closed); those
reports are silenced, as the line says it all.

A committed checkpoint can still be damaged afterwards (a copy cut short, bit rot, a full network disk). Once a
save has finished, process 0 seals it: ``jaxtune-manifest.json`` in the step directory records every file's size and
CRC-32, computed in a background thread from the files as written. Resuming checks the newest step against its
manifest (a step saved before manifests, or killed between commit and seal, has none and is checked by restoring it)
and reads its config; a step that fails either, or whose restore then fails, is *unreadable*: it is moved aside
(``<step>.unreadable-<time>``, never deleted) with one line saying which file and why, and the run resumes from the
newest readable step. When no step is readable, nothing is moved and the error says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxtune.config import CheckpointConfig, ConfigError, identity_diff
from jaxtune.io import CheckpointError, describe, write_text_atomically
from jaxtune.job.run_dir import WriteError

log = logging.getLogger(__name__)

COMMIT_MARK = "commit_success.txt"
REFERENCE = "reference"  # the item of a reference model that training changes (objective.sync_ref_model)
BEHIND, LAGGED = "behind", "lagged"  # rollouts sampled ahead (objective.max_staleness): their weights, their steps


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


# --- integrity: a manifest of every file's size and CRC-32, written once a save has finished ---

MANIFEST = "jaxtune-manifest.json"
_READ_BLOCK = 16 << 20  # zlib.crc32 releases the GIL on blocks this large: sealing overlaps the train steps


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def _seal(step_dir: Path) -> None:
    """Write ``step_dir``'s manifest: {relative path: [size, crc32]} for every file in it."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    sums = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in files}
    write_text_atomically(step_dir / MANIFEST, json.dumps({"version": 1, "files": sums}))


def damage(step_dir: Path) -> str | None:
    """Why ``step_dir``'s files do not match its manifest (a file missing, cut short or changed), or None when they
    do or there is no manifest to check against."""
    try:
        files = json.loads((step_dir / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is damaged ({e})"
    for name, (size, crc) in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if (actual := path.stat().st_size) != size:
            return f"{name} has {actual} bytes, {size} were written"
        if _crc32(path) != crc:
            return f"{name} has changed since it was written (CRC-32 mismatch)"
    return None


def _first_line(exc: BaseException) -> str:
    """An exception as one short line (tensorstore's messages go on to print a whole spec)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= 300 else text[:297] + "..."


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
    """Saves and restores ``{state, data, config}`` (and a changed ``reference``) under ``directory/<step>/``."""

    def __init__(self, directory: Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.every = cfg.every
        self.set_aside = _set_aside_incomplete(self.directory)
        self.saving: int | None = None  # the step of the last save started
        self.failed = False  # a save failed and was reported
        self.unreadable: list[str] = []  # one line per damaged checkpoint set aside
        self._sealed: int | None = None  # the last step whose manifest was started
        self._sealer: threading.Thread | None = None
        _quiet_orbax_failure_reports()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            keep_period=cfg.keep_every,
            enable_async_checkpointing=cfg.async_save,
            cleanup_tmp_directories=True,  # Orbax's own temp dirs from a killed save
            create=True,
        )
        items = ("state", "data", "config", REFERENCE, BEHIND, LAGGED)  # a step writes the first three, and others
        # where it has them
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=items)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def resume_step(self, config: dict[str, Any] | None = None) -> int:
        """The step to resume from (0: none): the newest readable one (the module docstring says which are not).
        With ``config``, a checkpoint of a different run (a key of `jaxtune.config.IDENTITY_KEYS` changed) is refused
        before any work is done."""
        start, saved, bad = self._newest_readable()
        self._set_aside_unreadable(bad)
        diff = identity_diff(saved, config) if start and config is not None else []
        if diff:
            run_dir = self.directory.parent
            raise ConfigError(f"{run_dir} holds a checkpoint (step {start}) of a different run; these keys differ:\n  "
                              + "\n  ".join(diff)
                              + "\nUse another run_dir (e.g. run_dir=runs/NEW), or restore the original values.")
        return start

    def _newest_readable(self, failed: list[tuple[int, str]] = ()) -> tuple[int, dict[str, Any] | None,
                                                                            list[tuple[int, str]]]:
        """(step, its config, [(newer unreadable step, why)]) for the newest committed step, besides ``failed``,
        whose files match its manifest and whose config reads; (0, None, []) when there are no checkpoints. Raises
        `CheckpointError` (and moves nothing) when there are some and none is readable."""
        bad = list(failed)
        skip = {step for step, _ in bad}
        for step in sorted(self.manager.all_steps(), reverse=True):
            if step in skip:
                continue
            why = damage(self.directory / str(step))
            if why is None:
                try:
                    config = self.read_config(step)
                    if not isinstance(config, dict):
                        raise TypeError(f"not a mapping but {type(config).__name__}")
                    return step, config, bad
                except Exception as e:  # noqa: BLE001 (any failure to read it makes the step unreadable)
                    why = f"its config cannot be read: {_first_line(e)}"
            bad.append((step, why))
        if bad:
            listed = "\n  ".join(f"step {step}: {why}" for step, why in bad)
            raise CheckpointError(f"no checkpoint in {self.directory} can be read:\n  {listed}\nNothing was moved. "
                                  "Restore the checkpoints from a copy, or move the directory away to start the run "
                                  "over.")
        return 0, None, bad

    def _set_aside_unreadable(self, bad: list[tuple[int, str]]) -> None:
        """Move unreadable steps to ``<step>.unreadable-<time>`` (never deleted) and say so, one line each."""
        for step, why in bad:
            src = self.directory / str(step)
            dest = src.with_name(f"{step}.unreadable-{int(time.time())}")
            if jax.process_index() == 0 and src.is_dir():
                shutil.move(str(src), str(dest))
            self.unreadable.append(f"checkpoint step {step} is unreadable ({why}); moved to {dest}, not loaded")
        if bad:
            self.manager.reload()

    def notes(self, start: int, total: int) -> list[str]:
        """What the run log says about the checkpoints it found."""
        lines = [f"resumed from {self.directory / str(start)} (step {start}/{total})"] if start else []
        return (self.unreadable + lines
                + [f"ignored an unfinished checkpoint, moved to {moved}" for moved in self.set_aside])

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state: Any, data_state: dict[str, Any], config: dict[str, Any],
             reference: Any = None, behind: tuple[list[int], list[Any]] | None = None) -> None:
        """Start saving (asynchronously when configured); a second save waits for the first. ``reference``: a
        reference model that training changes, saved beside the state (None: there is none). ``behind``: the steps
        of rollouts sampled ahead and not yet trained on, and the trained params each was sampled with
        (`jaxtune.rollout.lagged`)."""
        items = {"state": ocp.args.StandardSave(state), "data": ocp.args.JsonSave(data_state),
                 "config": ocp.args.JsonSave(config)}
        if reference is not None:
            items[REFERENCE] = ocp.args.StandardSave(reference)
        if behind is not None and behind[0]:
            items[LAGGED] = ocp.args.JsonSave({"steps": list(behind[0])})
            items[BEHIND] = ocp.args.StandardSave(list(behind[1]))
        args = ocp.args.Composite(**items)
        with self._as_write_error(step):
            self.manager.save(step, args=args, force=True)  # waits for the previous save to finish first
        self._seal_in_background(self.saving)
        self.saving = step  # in flight until the next save or wait

    def _seal_in_background(self, step: int | None) -> None:
        """Start writing the manifest of ``step``, a finished save (process 0; one at a time)."""
        if step is None or step == self._sealed or self.failed or jax.process_index() != 0:
            return
        self._join_sealer()
        self._sealed = step
        self._sealer = threading.Thread(target=self._seal_quietly, args=(self.directory / str(step),),
                                        name=f"jaxtune-seal-{step}", daemon=True)
        self._sealer.start()

    @staticmethod
    def _seal_quietly(step_dir: Path) -> None:
        try:
            _seal(step_dir)
        except FileNotFoundError:
            pass  # deleted meanwhile (checkpoint.keep): nothing to vouch for
        except OSError as e:  # a full disk: the step stays usable, checked by restoring it
            log.warning("could not write %s: %s", step_dir / MANIFEST, e)

    def _join_sealer(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None

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

    def restore(self, step: int, abstract_state: Any) -> tuple[int, Any, dict[str, Any]]:
        """(step, state, data position): ``step``'s, restored straight into the shardings carried by
        ``abstract_state`` (ShapeDtypeStructs); when that fails, the newest older step that restores (the failed
        ones are set aside once one has)."""
        failed: list[tuple[int, str]] = []
        while True:
            try:
                state, data = self._restore_state(step, abstract_state)
            except Exception as e:  # noqa: BLE001 (whatever breaks the restore, an older step may still do)
                failed.append((step, f"restoring it failed: {_first_line(e)}"))
                step, _, failed = self._newest_readable(failed)
                continue
            self._set_aside_unreadable(failed)
            return step, state, data

    def _restore_state(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """``step``'s state and data position. A state saved before train states carried the objective's scalars
        (``carry``) has no such entry: it restores as one whose carry is empty, where the objective carries none."""
        def restore(abstract: Any) -> tuple[Any, dict[str, Any]]:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            return out["state"], out["data"]

        try:
            return restore(abstract_state)
        except ValueError:
            if getattr(abstract_state, "carry", None) != {}:
                raise
            fields = abstract_state._asdict()
            del fields["carry"]
            try:
                out = restore(fields)
            except Exception:  # noqa: BLE001 (not an older state either: the first error says why)
                out = None
            if out is None:
                raise
            return type(abstract_state)(**out[0], carry={}), out[1]

    def restore_reference(self, step: int, abstract: Any) -> Any:
        """The reference model saved with ``step`` (one that training changed), restored straight into the shardings
        ``abstract`` carries."""
        if not (self.directory / str(step) / REFERENCE).is_dir():
            raise ConfigError(f"checkpoint step {step} in {self.directory} holds no reference model, which "
                              "objective.sync_ref_model=true resumes with; use another run_dir to start over with it")
        try:
            return self.manager.restore(step, args=ocp.args.Composite(
                **{REFERENCE: ocp.args.StandardRestore(abstract)}))[REFERENCE]
        except Exception as e:  # noqa: BLE001 (said in one line, with the step)
            raise CheckpointError(f"checkpoint step {step}: its reference model cannot be restored: "
                                  f"{_first_line(e)}") from None

    def restore_behind(self, step: int, abstract: Any) -> tuple[list[int], list[Any]]:
        """The rollouts ``step`` had sampled ahead (`save`'s ``behind``): their steps, and the params each was sampled
        with restored into ``abstract``'s shardings; none where the step holds none (it saved the run's last step)."""
        if not (self.directory / str(step) / LAGGED).is_dir():
            return [], []
        try:
            steps = self.manager.restore(step, args=ocp.args.Composite(
                **{LAGGED: ocp.args.JsonRestore()}))[LAGGED]["steps"]
            trees = self.manager.restore(step, args=ocp.args.Composite(
                **{BEHIND: ocp.args.StandardRestore([abstract] * len(steps))}))[BEHIND]
        except Exception as e:  # noqa: BLE001 (said in one line, with the step)
            raise CheckpointError(f"checkpoint step {step}: the weights of its rollouts sampled ahead "
                                  f"(objective.max_staleness) cannot be restored: {_first_line(e)}") from None
        return [int(s) for s in steps], list(trees)

    def read_config(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        with self._as_write_error(None):
            self.manager.wait_until_finished()
        self._seal_in_background(self.saving)
        self._join_sealer()

    def close(self) -> None:
        self.wait()
        self.manager.close()
