"""Process-level settings applied by the CLI before JAX starts: how this process allocates memory, and libtpu off a TPU.

**Memory (glibc malloc).** XLA:CPU allocates each step's temporary buffers afresh on every execution and frees them
at its end. Under glibc's defaults, a freed block at the top of the heap is given back to the OS (``trim``), and
every thread allocates from its own arena, whose heaps are trimmed the same way; the next step maps the same memory
again and the kernel zeroes it page by page. On a CPU run that is tens of thousands of minor page faults per step
and a third of the step's time in the kernel (benchmarks/RESULTS.md). `tune_malloc` keeps freed memory in the
process (one arena, no trim, no mmap for large blocks), so each step reuses warm pages. Its cost is memory: the
process keeps its peak heap instead of shrinking between steps (measured in benchmarks/RESULTS.md, "Time outside
the train step"). The CLI applies it before JAX starts; ``JAXTUNE_MALLOC=default`` leaves glibc as it is, and a
library user calling ``train()`` may call `tune_malloc` first. It is a no-op off glibc (macOS, musl).

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
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _tuned = "unavailable"
        return _tuned
    ok = mallopt(_M_ARENA_MAX, 1) and mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    _tuned = "tuned" if ok else "unavailable"
    return _tuned


# Above this many parameter bytes (float32), a run gives memory back again (`release_malloc`).
KEEP_HEAP_MAX_BYTES = 200 << 20


def release_malloc(param_bytes: int) -> bool:
    """Undo `tune_malloc`'s no-mmap / no-trim for a model of ``param_bytes`` (float32) past `KEEP_HEAP_MAX_BYTES`,
    before its weights are read; True when it did. The kept heap's cost grows with the model (fragments of freed
    weight copies and step buffers are never returned: SmolLM2-135M peaked at 10.6 GB tuned vs 4.9 GB default over 3
    LoRA steps) while the page faults it saves shrink relative to a longer step. One arena stays."""
    if _tuned != "tuned" or param_bytes <= KEEP_HEAP_MAX_BYTES:
        return False
    mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    mallopt(_M_MMAP_MAX, 65536)  # glibc's default
    mallopt(_M_TRIM_THRESHOLD, 128 << 10)  # glibc's default
    return True


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
