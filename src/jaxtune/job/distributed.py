"""Multi-host start-up on JAX's own multi-controller runtime: `jax.distributed.initialize`, no launcher.

Every host runs the same command (``gcloud ... ssh --worker=all``, ``srun``, or one process per GPU); each
becomes one JAX process. ``distributed.initialize``:

- ``auto`` (default): initialize when this looks like one of several processes: a coordinator is configured
  (``distributed.coordinator_address`` or ``JAX_COORDINATOR_ADDRESS``), or SLURM / Open MPI report more than
  one task, or a multi-host TPU slice is detected (``TPU_WORKER_HOSTNAMES`` lists several hosts). JAX then
  reads the rest (process count and id) from the same environment.
- ``always`` / ``never``: force it.

On CPU, cross-process collectives use gloo.

A user's mistake on one host stops every host with the same one line naming the process and the host, instead of
leaving the others waiting in a collective: a coordinator this process cannot reach (`initialize` probes it first,
for ``distributed.timeout`` seconds: JAX would abort the process), configs that differ between processes
(`check_same_config`), and a failure while reading the tokenizer and data on one host (`together`). A process id
outside the process count is refused before joining, and a process that was never started leaves the others one
line after ``distributed.timeout`` seconds (`_join_or_exit`), not JAX's C++ abort.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtune.config import DistributedConfig
from jaxtune.io import describe

log = logging.getLogger(__name__)


def _cluster_detected() -> bool:
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(env.get(key, "1") or 1) > 1:
            return True
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


class HostError(ValueError):
    """A failure on one process of several, reported by every one (naming the process and its host)."""


# Where a launcher says which process this is (JAX reads the same): a known non-zero id probes the coordinator.
_RANK_VARIABLES = ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "TPU_WORKER_ID")


def _rank(cfg: DistributedConfig) -> int | None:
    if cfg.process_id is not None:
        return cfg.process_id
    return next((int(os.environ[k]) for k in _RANK_VARIABLES if os.environ.get(k, "").isdigit()), None)


def _reach_coordinator(address: str, rank: int, timeout: float) -> None:
    """Wait until the coordinator at ``address`` (process 0's, started by it) accepts a connection, or raise one
    `HostError` line after ``timeout`` seconds. JAX's own wait ends in a fatal abort of the process."""
    host, _, port = address.rpartition(":")
    deadline, why = time.monotonic() + timeout, ""
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)).close()
            return
        except (OSError, ValueError) as e:
            why = describe(e.errno) if getattr(e, "errno", None) else str(e) or type(e).__name__
        if time.monotonic() >= deadline:
            raise HostError(f"distributed.coordinator_address={address}: process {rank} (host "
                            f"{socket.gethostname()}) could not reach the coordinator in {timeout:g} s ({why}); start "
                            "process 0 with the same address, and check that this host can reach it (address, port, "
                            "firewall), or raise distributed.timeout") from None
        time.sleep(0.5)


def _check_rank(cfg: DistributedConfig, rank: int | None) -> None:
    """A process id the process count has no room for is this process's mistake: say so before joining (a non-zero
    id would otherwise probe the coordinator, and a late one wait for it, before JAX refuses it)."""
    if rank is None or cfg.num_processes is None or rank < cfg.num_processes:
        return
    key = "distributed.process_id" if cfg.process_id is not None else next(
        k for k in _RANK_VARIABLES if os.environ.get(k, "").isdigit())
    raise HostError(f"{key}={rank} (host {socket.gethostname()}) is not below distributed.num_processes="
                    f"{cfg.num_processes}: number the processes 0 to {cfg.num_processes - 1}, or raise "
                    "distributed.num_processes")


# JAX's own deadline comes this much after ours, so that ours, which can say what happened, is the one met.
_JAX_GRACE_S = 30


def _join_or_exit(cfg: DistributedConfig, address: str | None, rank: int | None) -> None:
    """`jax.distributed.initialize`, which returns once every process has joined. Where one never starts, JAX ends
    the wait with a C++ abort (blaming "another task died") that Python cannot catch, and the joining call cannot be
    interrupted: past ``distributed.timeout`` seconds this process prints one ``error:`` line naming the
    coordinator, the process count and what to do, and exits 2, as the CLI does for a user error."""
    who = f"process {rank}" if rank is not None else "this process"
    key = (f"distributed.num_processes={cfg.num_processes}" if cfg.num_processes is not None
           else f"distributed.coordinator_address={address}")
    count = f"all {cfg.num_processes} processes" if cfg.num_processes is not None else "every process"
    message = (f"{key}: {who} (host {socket.gethostname()}) waited {cfg.timeout:g} s at the coordinator "
               f"{address or '(from the cluster environment)'} and not every process joined; start {count}, each "
               "with its own distributed.process_id and the same distributed.coordinator_address, or raise "
               "distributed.timeout")
    timer = threading.Timer(cfg.timeout, _exit_with, (message,))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                                   process_id=cfg.process_id,
                                   initialization_timeout=math.ceil(cfg.timeout) + _JAX_GRACE_S)
    finally:
        timer.cancel()


def _exit_with(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(2)  # the main thread is inside JAX's joining call, which no exception reaches


def initialize(cfg: DistributedConfig) -> bool:
    """Join the job's processes (once per process); returns whether this is a multi-process run."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    wanted = cfg.initialize == "always" or (
        cfg.initialize == "auto" and (cfg.coordinator_address is not None or _cluster_detected()))
    if not wanted:
        return False
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address and "cpu" in (os.environ.get("JAX_PLATFORMS", "") or "cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank = _rank(cfg)
    _check_rank(cfg, rank)
    if address and rank:
        _reach_coordinator(address, rank, cfg.timeout)
    _join_or_exit(cfg, address, rank)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


def every_process(local: np.ndarray) -> np.ndarray:
    """This process's (n, ...) values and every other process's (each the same n), in process order:
    (processes x n, ...). One process: ``local`` itself. Every process must call it together."""
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, *local.shape[1:])


def _texts(text: str) -> list[str]:
    """Every process's ``text``, in process order (every process calls it together)."""
    raw = np.frombuffer(text.encode(), np.uint8)
    longest = int(every_process(np.asarray([len(raw)], np.int64)).max())
    mine = np.zeros((1, longest), np.uint8)
    mine[0, :len(raw)] = raw
    return [bytes(row).rstrip(bytes(1)).decode(errors="replace") for row in every_process(mine)]


def first_failure(message: str | None) -> str | None:
    """The first failing process's ``message`` (None where this process did not fail), the same on every process and
    naming that process and its host: so that an error on one host stops every host with it instead of leaving them
    waiting. Every process calls it together."""
    failed = every_process(np.asarray([message is not None], np.int32))
    if not failed.any():
        return None
    texts = _texts(f"{socket.gethostname()}\x1f{message}" if message is not None else "")
    k = int(np.argmax(failed))
    host, _, text = texts[k].partition("\x1f")
    return f"{text} (on process {k}, host {host})"


@contextlib.contextmanager
def together(multi_host: bool, errors: tuple[type[Exception], ...] = ()) -> Iterator[None]:
    """Run the body on every process; a user error in it (a `ValueError` such as a `DataError`, an `OSError` such as
    a missing file, or one of ``errors``) on any process is raised on every process as one `HostError` naming where
    it happened. The body must not hold collectives (a failed process would skip them). One process: the body's
    errors as they are."""
    if not multi_host:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except (ValueError, OSError, *errors) as e:
        failure = e
    message = first_failure(None if failure is None else str(failure))
    if message is not None:
        raise HostError(message) from failure


# Keys that may differ between the processes of one run: which process it is, and host-local caches.
PER_PROCESS_KEYS = ("distributed", "data.cache_dir", "train.compile_cache_dir")


def check_same_config(config: dict[str, Any]) -> None:
    """Every process runs the same ``config`` (the run's, as a dict; `PER_PROCESS_KEYS` aside), or every process
    raises one `HostError` naming the first keys that differ, their values on process 0 and on the first process
    that differs, and its host."""
    flat = _flat(config)
    mine = json.dumps({k: v for k, v in flat.items()
                       if not any(k == p or k.startswith(p + ".") for p in PER_PROCESS_KEYS)}, sort_keys=True)
    digest = np.frombuffer(hashlib.sha256(mine.encode()).digest(), np.uint8)[None]
    digests = every_process(digest)
    if (digests == digests[0]).all():
        return
    texts = _texts(f"{socket.gethostname()}\x1f{mine}")
    hosts, configs = zip(*(t.partition("\x1f")[::2] for t in texts))
    k = next(i for i in range(len(texts)) if configs[i] != configs[0])
    first, other = json.loads(configs[0]), json.loads(configs[k])
    keys = sorted(set(first) | set(other), key=lambda key: (first.get(key) == other.get(key), key))
    shown = "; ".join(f"{key}={other.get(key)!r} there, {first.get(key)!r} on process 0"
                      for key in keys[:3] if first.get(key) != other.get(key))
    raise HostError(f"process {k} (host {hosts[k]}) runs another config than process 0 (host {hosts[0]}): {shown}; "
                    "start every process with the same config file and overrides")


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


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
