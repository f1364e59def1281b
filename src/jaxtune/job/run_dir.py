"""The run directory belongs to one run at a time, and a write into it that fails reads as one line.

`claim(run_dir, multi_host)` holds ``run_dir/train.lock`` while a run trains. The lock file names its holder's host
and PID, and process 0 holds it with ``flock``, which the kernel drops when the holder dies however it dies (kill -9
included): a second ``jaxtune train`` on the same directory is refused with a line naming that host and PID, and a lock
whose holder is gone is taken over with a line that says so. The processes of one multi-host run are one run: only
process 0 takes the lock, and all of them stop when it cannot.

A write that fails for a reason the user fixes (`WRITE_ERRNOS`: a read-only or full disk, permissions, a quota, a
file-size limit) is a `WriteError` naming the file and the OS error (`writing`, and `claim` for everything the run
writes), not a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtune.io import describe, why_not

LOCK_NAME = "train.lock"

# OS errors of a write that the user fixes, not jaxtune; only a write fails with the first four.
_WRITE_ONLY = frozenset({errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
WRITE_ERRNOS = _WRITE_ONLY | {errno.EACCES, errno.EPERM}


class RunDirError(Exception):
    """The run directory cannot be used as asked; the message is one line that names the file."""


class RunLockedError(RunDirError):
    """Another run holds the run directory's lock."""


class WriteError(RunDirError):
    """A write into the run directory failed: read-only, full, over a size limit or not permitted."""


def _write_error(e: OSError, path: Path | None = None, unnamed: str = "a write failed") -> WriteError:
    """``e`` (one of `WRITE_ERRNOS`) as one line naming the file: the one ``e`` names, else ``path`` (a write of
    ``path`` failed). EACCES and EPERM are a read's errors too: without ``path`` only the others say "cannot write"."""
    name = e.filename or path
    if name is None:
        return WriteError(f"{unnamed}: {describe(e.errno)}")
    verb = "cannot write " if path is not None or e.errno in _WRITE_ONLY else ""
    return WriteError(f"{verb}{name}: {describe(e.errno)}")


def make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` (and its parents), or one `RunDirError` line naming ``run_dir`` and why it cannot be: a part
    of the path that is a file, a place nothing can be created (``/proc``), no permission, a full disk."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run_dir={run_dir}: cannot create it ({why_not(run_dir, e)}); set run_dir to a directory "
                          "you can write, e.g. run_dir=runs/NAME") from None


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Report an OSError of the body that the user fixes (`WRITE_ERRNOS`) as a `WriteError` naming the file (the one
    the error names, else ``path``)."""
    try:
        yield
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise _write_error(e, path) from None


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: a process on a host. ``started`` (the process's start time, from /proc) tells a PID that
    was reused by another process apart from the one that took the lock."""

    host: str
    pid: int
    started: str | None = None

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), _start_time(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), d.get("started"))
        except (ValueError, KeyError, TypeError):
            return None  # empty (its holder is writing it) or not ours

    def running(self) -> bool:
        """Whether this process still runs; only answerable on its own host (elsewhere: assumed to run)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        started = _start_time(self.pid)
        return started is None or self.started is None or started == self.started

    def __str__(self) -> str:
        return f"PID {self.pid} on {self.host}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), or None; a zombie counts as ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return None if fields[0] in ("Z", "X") else fields[19]


class RunLock:
    """``run_dir/train.lock``: ``acquire`` takes it (or raises `RunLockedError`), ``release`` removes it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns a line to print when it was taken over from a process that is gone."""
        with writing(self.path):
            while True:
                fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    locked = self._flock(fd)
                    if _same_file(fd, self.path):  # else its holder removed it after our open: open the new one
                        note = self._take(fd, locked)
                        self.fd, fd = fd, None
                        return note
                finally:
                    if fd is not None:
                        os.close(fd)

    def _flock(self, fd: int) -> bool:
        """flock ``fd`` (False: the file system has no flock, the PID check alone decides), or refuse."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockedError(self._refusal(Holder.parse(_read(fd)))) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return False
        return True

    def _take(self, fd: int, locked: bool) -> str | None:
        previous, me = Holder.parse(_read(fd)), Holder.me()
        note = None
        if previous is not None and previous != me:
            # Holding the flock proves its holder gone on this host; on another host only that host can tell.
            if previous.host != me.host or (not locked and previous.running()):
                raise RunLockedError(self._refusal(previous))
            note = f"took over the run lock {self.path} from {previous}, which is no longer running"
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(asdict(me)) + "\n").encode(), 0)
        os.fsync(fd)
        return note

    def _refusal(self, holder: Holder | None) -> str:
        run_dir = self.path.parent
        if holder is None:
            return f"{run_dir} is in use by another run, which is starting: it holds {self.path}"
        if holder.host != socket.gethostname():
            return (f"{run_dir} is in use by another run: {holder} holds {self.path}; if that run has ended, "
                    f"delete {self.path}")
        return f"{run_dir} is in use by another run: {holder} holds {self.path}"

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if Holder.parse(_read(self.fd)) == Holder.me():
                self.path.unlink(missing_ok=True)
        except OSError:
            pass  # the lock file stays; the next run finds its holder gone and takes it over
        finally:
            os.close(self.fd)  # drops the flock
            self.fd = None


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def claim(run_dir: Path, multi_host: bool) -> Iterator[None]:
    """Hold ``run_dir``'s lock while the body runs (process 0, for every process of the run), and report an OSError
    the user fixes (`WRITE_ERRNOS`) raised by the body as one `WriteError` line. The lock is released on the way out,
    on an error too."""
    lock = RunLock(run_dir)
    try:
        refused: RunDirError | None = None
        if jax.process_index() == 0:
            try:
                note = lock.acquire()
                if note:
                    print(note, flush=True)
            except RunDirError as e:
                refused = e
        if multi_host and not bool(multihost_utils.broadcast_one_to_all(np.int32(refused is None))):
            raise refused or RunLockedError(f"{run_dir}: process 0 could not take the run lock (see its error)")
        if refused:
            raise refused
        yield
    except OSError as e:
        if e.errno not in WRITE_ERRNOS:
            raise
        raise _write_error(e, unnamed=f"a write failed while training {run_dir}") from None
    finally:
        lock.release()
