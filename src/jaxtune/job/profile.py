"""``train.profile_steps: [START, END]``: a `jax.profiler` trace of those train steps, and their step time.

The trace goes to ``run_dir/profile/plugins/profile/<time>/``: ``<host>.xplane.pb`` (TensorBoard's profile plugin:
``tensorboard --logdir run_dir/profile``; xprof: ``xprof --logdir run_dir/profile``) and ``perfetto_trace.json.gz``
(drop it on https://ui.perfetto.dev). Tracing starts before step START is dispatched and stops once step END has
finished on the device, so the trace holds exactly those steps; the log gets their mean step time, which includes
the profiler's own overhead (compare it with the ``step_time`` of unprofiled steps). Pick START after the first
step (its compile would dominate the trace). Steps already done when a run resumes are not profiled again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import jax


class Profiler:
    """Starts and stops the trace around the steps asked for; a no-op without ``train.profile_steps``."""

    def __init__(self, steps: tuple[int, int] | None, run_dir: Path, start_step: int, say: Callable[[str], None]):
        self.first, self.last = steps if steps is not None else (0, -1)
        self.directory = run_dir / "profile"
        self.say = say
        self.t0: float | None = None
        if steps is not None and start_step >= self.first:
            say(f"train.profile_steps={list(steps)}: step {self.first} was run before this resume (step "
                f"{start_step}); not profiled")
            self.first, self.last = 0, -1

    def before(self, step: int) -> None:
        """Call before dispatching ``step`` (1-based)."""
        if step == self.first:
            jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            self.t0 = time.perf_counter()

    def after(self, step: int, state: Any) -> None:
        """Call after dispatching ``step``; at END waits for it to finish, then stops the trace."""
        if step == self.last and self.t0 is not None:
            jax.block_until_ready(state)
            seconds = (time.perf_counter() - self.t0) / (self.last - self.first + 1)
            self.stop()
            self.say(f"profiled steps {self.first}-{self.last}: {seconds * 1e3:.1f} ms per step (with the "
                     f"profiler's overhead); trace in {self.directory} (tensorboard --logdir / xprof / Perfetto)")

    def stop(self) -> None:
        """Stop a trace still running (the run ended or failed inside the profiled steps)."""
        if self.t0 is not None:
            self.t0 = None
            jax.profiler.stop_trace()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
