"""Programs compiled ahead of their first use (`Ahead`): the held-out evaluation's and the train step's for the
length buckets the first batches will meet, compiled on worker threads while the main thread goes on.

An XLA:CPU compile runs on one core and releases the GIL, so on a host with two or more cores two programs compile
at once, and they overlap the step-0 evaluation instead of following it. Each compile goes through the same
``jax.jit`` the loop dispatches (``.lower(...).compile()`` on the arguments' shapes and shardings), so the first
dispatch of a compiled shape finds its trace, its lowering and its executable already made and compiles nothing;
each program is still compiled (traced) once, which ``Steps.compiles`` counts as before. The main thread waits for
a program before its first dispatch (`wait`), so a program is never compiled twice at once.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh

from jaxtune import sharding


def abstract(tree: Any) -> Any:
    """``tree``'s arrays as ShapeDtypeStructs with their shardings: what a compile needs, and nothing a donation
    can delete meanwhile."""
    def one(x):
        if not isinstance(x, jax.Array):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)
    return jax.tree.map(one, tree)


class _CacheHits(threading.local):
    """Persistent-compilation-cache hits counted per thread: JAX records one in the thread that compiles."""

    count = 0


_hits = _CacheHits()
_listening = False


def _listen() -> None:
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_count_hit)
        _listening = True


def _count_hit(event: str, **_: object) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _hits.count += 1


@dataclass(frozen=True)
class Compiled:
    """A program compiled ahead: its seconds, and whether XLA's persistent cache held it (read, not compiled)."""

    seconds: float
    cached: bool

    def __str__(self) -> str:
        return f"{self.seconds:.1f} s" + (", read from the compilation cache" if self.cached else "")


def placed(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs ``abstract`` placed as ``shardings`` says (the same tree): the arrays to come."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def compile_workers() -> int:
    """Compiles at once: the cores this process may use, less one for the main thread, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores - 1, 4)) if cores > 2 else cores


class Ahead:
    """Compiles submitted programs on worker threads; `wait` returns a program's compile seconds once it is ready
    (None when it was never submitted). Every compile is traced under ``mesh`` (given here or by `on`), as the
    loop's dispatch is."""

    def __init__(self, mesh: Mesh | None = None, workers: int | None = None):
        _listen()
        self.mesh = mesh
        self.workers = workers or compile_workers()
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="jaxtune-compile")
        self.pending: dict[Hashable, Future] = {}
        self.deferred: dict[Hashable, tuple[Callable, tuple]] = {}

    def submit(self, key: Hashable, jitted: Callable, *args: Any, later: bool = False) -> None:
        """Compile ``jitted`` for ``args`` (arrays or ShapeDtypeStructs: only their shapes and shardings are read).
        ``later``: not before `release` (a program the first step does not need, kept off the cores until then)."""
        if key in self.pending or key in self.deferred:
            return
        shapes = abstract(args)
        if later:
            self.deferred[key] = (jitted, shapes)
        else:
            self.pending[key] = self.pool.submit(contextvars.copy_context().run, self._compile, jitted, shapes)

    def release(self) -> None:
        """Start the compiles held back until now (`submit` ``later``)."""
        deferred, self.deferred = self.deferred, {}
        for key, (jitted, shapes) in deferred.items():
            self.pending[key] = self.pool.submit(contextvars.copy_context().run, self._compile, jitted, shapes)

    def wait(self, key: Hashable) -> Compiled | None:
        """How ``key``'s program was compiled (after waiting for it), or None when it was not submitted. A compile
        that failed raises here, where the dispatch would have raised."""
        if key in self.deferred:
            self.release()
        future = self.pending.pop(key, None)
        return None if future is None else future.result()

    def has(self, key: Hashable) -> bool:
        return key in self.pending or key in self.deferred

    def _compile(self, jitted: Callable, args: tuple) -> Compiled:
        started, hits = time.perf_counter(), _hits.count
        with sharding.use_mesh(self.mesh):  # traced as the loop's dispatch would be
            jitted.lower(*args).compile()
        return Compiled(time.perf_counter() - started, _hits.count > hits)

    def on(self, mesh: Mesh) -> Ahead:
        """This, its programs traced under ``mesh`` (the run's, made after the threads)."""
        self.mesh = mesh
        return self

    def close(self, wait: bool = True) -> None:
        """Drop what has not started. A compile under way finishes (XLA cannot be interrupted): ``wait`` for it, or
        not (a run that stops on an error returns at once; the process exits once the compile ends)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
        self.pending.clear()
        self.deferred.clear()


