"""Process-level settings applied by the CLI before JAX starts: how this process allocates memory.

**Memory (glibc malloc).** XLA:CPU allocates each step's temporary buffers afresh on every execution and frees them
at its end. Under glibc's defaults, a freed block at the top of the heap is given back to the OS (``trim``), and
every thread allocates from its own arena, whose heaps are trimmed the same way; the next step maps the same memory
again and the kernel zeroes it page by page. On a CPU run that is tens of thousands of minor page faults per step
and a third of the step's time in the kernel (benchmarks/RESULTS.md). `tune_malloc` keeps freed memory in the
process (one arena, no trim, no mmap for large blocks), so each step reuses warm pages. Its cost is memory: the
process keeps its peak heap instead of shrinking between steps (measured in benchmarks/RESULTS.md, "Time outside
the train step"). The CLI applies it before JAX starts; ``JAXTUNE_MALLOC=default`` leaves glibc as it is, and a
library user calling ``train()`` may call `tune_malloc` first. It is a no-op off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

