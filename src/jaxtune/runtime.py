"""Process-level settings applied by the CLI before JAX starts: how this process allocates memory, and libtpu off a TPU.

**Memory (glibc malloc).** XLA:CPU allocates each step's temporary buffers afresh on every execution and frees them
at its end. Under glibc's defaults, a freed block at the top of the heap is given back to the OS (``trim``), and
every thread allocates from its own arena, whose heaps are trimmed the same way; the next step maps the same memory
again and the kernel zeroes it page by page. On a CPU run that is tens of thousands of minor page faults per step
and a third of the step's time in the kernel (benchmarks/RESULTS.md). `tune_malloc` keeps freed memory in the
process (one arena, no trim, no mmap for large blocks), so each step reuses warm pages. Its cost is memory: the
process keeps its peak heap instead of shrinking between steps (measured in benchmarks/RESULTS.md, "Time outside
the train step"). The CLI applies it before JAX starts; ``JAXTUNE_MALLOC=default`` leaves glibc as it is, and a
library user calling ``train()`` may call `tune_malloc` first. It is a no-op off glibc (macOS, musl). A large model
gives memory back while its weights are read (`release_malloc`); the train loop then keeps the heap for its steps,
whatever their buffers' size, and gives it back when it grows (`HeapWatch`).

**libtpu on a machine without a TPU** (`quiet_libtpu`). ``pip install 'jaxtune[aot]'`` installs libtpu so that
`jaxtune info --compile-for` can compile for a TPU slice on any host. JAX then tries a TPU backend in every process:
libtpu finds no metadata server, prints three warnings (TPU_ACCELERATOR_TYPE, TPU_WORKER_HOSTNAMES) and JAX falls
back to the CPU; and libtpu holds ``/tmp/libtpu_lockfile`` for the life of the process, which it uses to keep two
processes off the same chips, so a second JAX process on the host (a CPU run, a test, another compile) cannot
create a TPU topology ("Internal error when accessing libtpu multi-process lockfile"). With no TPU device file
(``/dev/accel*``, ``/dev/vfio``: what a TPU VM has) there are no chips to keep apart, so `quiet_libtpu` sets what
libtpu would otherwise ask the metadata server for (one local worker, an accelerator type) and lets processes
share libtpu. Nothing changes on a TPU VM, nor for a variable already set. The accelerator type changes no compiled
program: a step compiled for v5e:2x4 or v4:2x2x1 has the same HLO with it set to v5litepod-8, v4-8 or unset.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
from typing import Any

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_tuned: str | None = None


def tune_malloc() -> str:
    """Keep freed memory for reuse (see the module docstring); returns what was done: ``tuned``, ``default``
    (``JAXTUNE_MALLOC=default``) or ``unavailable`` (not glibc). Call before JAX starts its threads."""
    global _tuned
    if _tuned is not None:
        return _tuned
    if os.environ.get("JAXTUNE_MALLOC", "").lower() == "default":
        _tuned = "default"
        return _tuned
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        _tuned = "unavailable"
        return _tuned
    ok = mallopt(_M_ARENA_MAX, 1) and mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    _tuned = "tuned" if ok else "unavailable"
    return _tuned


# Above this many parameter bytes (float32), a run gives memory back again while it sets up (`release_malloc`).
KEEP_HEAP_MAX_BYTES = 200 << 20


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def release_malloc(param_bytes: int) -> bool:
    """Undo `tune_malloc`'s no-mmap / no-trim for a model of ``param_bytes`` (float32) past `KEEP_HEAP_MAX_BYTES`,
    before its weights are read; True when it did. Reading and converting a large model's weights leaves freed copies
    all over a kept heap (SmolLM2-135M peaked at 10.6 GB tuned vs 4.9 GB default over 3 LoRA steps); `HeapWatch`
    keeps the heap again for the steps. One arena stays."""
    if _tuned != "tuned" or param_bytes <= KEEP_HEAP_MAX_BYTES:
        return False
    mallopt = _libc().mallopt
    mallopt(_M_MMAP_MAX, 65536)  # glibc's default
    mallopt(_M_TRIM_THRESHOLD, 128 << 10)  # glibc's default
    return True


def resident_bytes() -> int:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class HeapWatch:
    """The train loop's memory on a CPU run under `tune_malloc`: every step reuses the previous step's warm pages, and
    the heap is given back only when it has grown.

    XLA:CPU allocates a step's temporary buffer (7.8 GB for a LoRA step of SmolLM2-135M on 4 x 512 tokens) at its
    start and frees it at its end. `tune_malloc`'s trim threshold (2 GB, the largest positive ``int``) gives a larger
    block back to the kernel when it is freed, so the next step faults and zeroes it again: there the step spent a
    fifth of its time in the kernel. `start` keeps every freed block (no mmap; trim threshold -1, which glibc reads as
    the largest size; also after `release_malloc`) and gives back what setup left free (``malloc_trim``). A step that
    starts before the previous one has freed its buffer takes a second block, so on a kept heap the loop waits for
    each step before it calls `after_step`, which on a CPU costs nothing: host and device are the same cores. Other
    programs (evaluation, sampling, compiles on worker threads) can still leave freed blocks the steps do not reuse:
    when the resident memory at a step's end exceeds the least seen at a step's end since the heap was last given
    back by an eighth (and 64 MiB), it is given back again (``malloc_trim``), and the next step faults its buffer in
    once. Measured in benchmarks/RESULTS.md ("A step's buffer over 2 GB was faulted in afresh every step").
    """

    GROWTH, SLACK = 1.125, 64 << 20

    def __init__(self, libc: Any) -> None:
        self._libc = libc
        self.floor: int | None = None
        self.trims = 0

    @classmethod
    def start(cls, platform: str) -> HeapWatch | None:
        """Keep the heap for the steps of a run on ``platform``; None (nothing to do) off the CPU, or when
        `tune_malloc` did not tune this process."""
        if _tuned != "tuned" or platform != "cpu":
            return None
        libc = _libc()
        if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, -1)):  # -1: SIZE_MAX, never trim
            return None
        libc.malloc_trim(0)
        return cls(libc)

    def after_step(self) -> None:
        """At a step's end, once the caller has waited for it: give the heap back when it has grown (see the class)."""
        rss = resident_bytes()
        if self.floor is None or rss < self.floor:
            self.floor = rss
        elif rss > self.floor * self.GROWTH + self.SLACK:
            self._libc.malloc_trim(0)
            self.floor, self.trims = None, self.trims + 1


# What libtpu reads from the environment when it cannot ask a TPU VM's metadata server.
_LIBTPU_OFF_TPU = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5litepod-8",
                   "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def quiet_libtpu() -> str:
    """On a host with libtpu installed but no TPU, keep libtpu quiet and shareable between processes (see the module
    docstring); returns ``set``, ``tpu host`` (TPU device files exist: nothing done) or ``no libtpu``. Call before
    JAX loads libtpu (its first backend or topology)."""
    if importlib.util.find_spec("libtpu") is None:
        return "no libtpu"
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio"):
        return "tpu host"
    for key, value in _LIBTPU_OFF_TPU.items():
        os.environ.setdefault(key, value)
    return "set"
