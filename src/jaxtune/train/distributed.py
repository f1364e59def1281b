"""Multi-host start-up on JAX's own multi-controller runtime: `jax.distributed.initialize`, no launcher.

Every host runs the same command (``gcloud ... ssh --worker=all``, ``srun``, or one process per GPU); each
becomes one JAX process. ``distributed.initialize``:

- ``auto`` (default): initialize when this looks like one of several processes: a coordinator is configured
  (``distributed.coordinator_address`` or ``JAX_COORDINATOR_ADDRESS``), or SLURM / Open MPI report more than
  one task, or a multi-host TPU slice is detected (``TPU_WORKER_HOSTNAMES`` lists several hosts). JAX then
  reads the rest (process count and id) from the same environment.
- ``always`` / ``never``: force it.

On CPU, cross-process collectives use gloo.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtune.config import DistributedConfig

log = logging.getLogger(__name__)


def _cluster_detected() -> bool:
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(key, "1") or 1) > 1:
            return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize(cfg: DistributedConfig) -> bool:
    """Join the job's processes (once per process); returns whether this is a multi-process run."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    wanted = cfg.initialize == "always" or (
        cfg.initialize == "auto" and (cfg.coordinator_address is not None or _cluster_detected()))
    if not wanted:
        return False
    if (cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")) and "cpu" in (
            os.environ.get("JAX_PLATFORMS", "") or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                               process_id=cfg.process_id)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


class Preemption:
    """SIGTERM, or a first Ctrl-C (SIGINT), stops the run at a step boundary with a checkpoint; a second SIGINT
    aborts at once (the default action: the process ends there, without saving).

    One process: the handlers set a flag. Several (jax.distributed): JAX's preemption service already listens for
    SIGTERM on every host and agrees on one step for all of them (`multihost_utils.reached_preemption_sync_point`,
    asked at every step), so every host saves the same step; a SIGINT is handed to it as a SIGTERM to this process.
    ``signal`` names what stopped the run: SIGINT if any host had one, else SIGTERM.
    """

    def __init__(self, multi_host: bool):
        self.multi_host = multi_host
        self.requested = False
        self.signal: str | None = None
        self._interrupted = False  # this process had a SIGINT
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        handlers = {signal.SIGINT: self._interrupt}
        if not self.multi_host:
            handlers[signal.SIGTERM] = self._terminate
        for signum, handler in handlers.items():
            try:
                self._previous[signum] = signal.signal(signum, handler)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _terminate(self, signum, frame):
        self.requested = True
        self.signal = self.signal or "SIGTERM"

    def _interrupt(self, signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        self._interrupted = True
        if self.multi_host:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service, which agrees on the step
        else:
            self.requested = True
            self.signal = self.signal or "SIGINT"

    def reached(self, step: int) -> bool:
        """Whether to save and stop after ``step``; call it once per step, on every host."""
        if self.multi_host and not self.requested and multihost_utils.reached_preemption_sync_point(step):
            # every host is here at this same step: they can agree on what to call it
            anyone = multihost_utils.process_allgather(np.int32(self._interrupted))
            self.requested, self.signal = True, "SIGINT" if np.any(anyone) else "SIGTERM"
        return self.requested

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            if previous is not None:  # None: installed outside Python, which cannot put it back
                signal.signal(signum, previous)
