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

import jax
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
    """SIGTERM stops the run at a step boundary with a checkpoint.

    One process: a SIGTERM handler sets a flag. Several (jax.distributed): JAX's preemption service already
    listens for SIGTERM on every host and agrees on one step for all of them
    (`multihost_utils.reached_preemption_sync_point`, asked at every step), so every host saves the same step.
    """

    def __init__(self, multi_host: bool):
        self.multi_host = multi_host
        self.requested = False
        self._previous = None

    def __enter__(self):
        if not self.multi_host:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                self._previous = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def reached(self, step: int) -> bool:
        """Whether to save and stop after ``step``; call it once per step, on every host."""
        if self.multi_host:
            self.requested = self.requested or multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
