"""Process-level costs outside the train step (issue 17): the allocator setting that removes the per-step page faults,
and start-up imports that the CLI and the loop avoid. Each check runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Allocate and free a 64 MiB buffer (like XLA:CPU's per-step temp buffer) from a worker thread 20 times, touching
# every page; print the minor page faults of the last 19 rounds.
FAULTS = textwrap.dedent("""
    import ctypes, resource, sys, threading
    from jaxtune import runtime
    print(runtime.tune_malloc() if sys.argv[1] != "default" else "default", flush=True)
    if sys.argv[1] == "released":  # a large model's run: small models keep the heap, large ones give it back
        assert not runtime.release_malloc(runtime.KEEP_HEAP_MAX_BYTES)
        assert runtime.release_malloc(runtime.KEEP_HEAP_MAX_BYTES + 1)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    size = 64 << 20
    def step():
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(ctypes.c_void_p(p))
    def rounds(n):
        for _ in range(n):
            t = threading.Thread(target=step)
            t.start(); t.join()
    rounds(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rounds(19)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _python(code: str, *args: str, env: dict | None = None) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_tune_malloc_removes_the_page_faults_of_a_reused_buffer():
    """64 MiB is 16k pages: freshly mapped each round by default, reused warm once tuned."""
    mode, default = _python(FAULTS, "default")
    assert mode == "default" and int(default) > 19 * 10_000, default
    mode, tuned = _python(FAULTS, "tuned")
    assert mode == "tuned" and int(tuned) < 19 * 200, tuned  # a few pages per round (thread stacks), not 16k
    mode, released = _python(FAULTS, "released")  # glibc's mmap and trim again: the memory goes back each round
    assert mode == "tuned" and int(released) > 19 * 10_000, released


# The train loop's heap on a CPU run (`HeapWatch`): a step's temporary buffer larger than the 2 GB that mallopt's trim
# threshold takes, freed and allocated again; then a freed block the steps do not reuse (an evaluation's, a
# compile's), which must be given back once, and a steady loop after it, which must not be.
WATCH = textwrap.dedent("""
    import ctypes, resource, sys
    from jaxtune import runtime
    assert runtime.tune_malloc() == "tuned"
    runtime.release_malloc(runtime.KEEP_HEAP_MAX_BYTES + 1)  # a large model's setup: glibc's mmap and trim again
    watch = runtime.HeapWatch.start("cpu") if sys.argv[1] == "cpu" else None
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    def touched(size):
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        return p
    def step(size=(2 << 30) + (64 << 20)):
        libc.free(ctypes.c_void_p(touched(size)))
        if watch is not None:
            watch.after_step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(); step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    trims = watch.trims if watch else 0
    kept = runtime.resident_bytes()
    libc.free(ctypes.c_void_p(touched(11 << 28)))  # 2.75 GB freed: more than the steps reuse (an evaluation's)
    grown = runtime.resident_bytes()
    step()
    after = runtime.resident_bytes()
    step(); step(); step()
    print(faults, trims, watch.trims if watch else 0, kept >> 20, grown >> 20, after >> 20,
          runtime.HeapWatch.start("tpu") is None)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings: Linux only")
def test_heap_watch_reuses_a_step_buffer_over_2gb_and_gives_back_what_the_steps_do_not_reuse():
    """2.06 GB is 540k pages: faulted in afresh every step unless the heap keeps it; the 0.7 GB more that a larger
    block left resident is given back (one trim), then the steady steps trim nothing. Not on a non-CPU platform, and
    not by default."""
    *numbers, off_cpu = _python(WATCH, "cpu")
    faults, trims, trims_after, kept, grown, after = map(int, numbers)
    assert faults < 50_000, faults  # two steps of a kept 2.06 GB buffer: not its 1.08M pages again
    assert trims == 0, trims
    assert grown > kept + 600  # the larger block, freed, stayed resident ...
    assert trims_after == 1 and after < kept - 1500, (trims_after, kept, after)  # ... until the next step's end
    assert off_cpu == "True"  # off the CPU nothing changes
    faults, *_ = map(int, _python(WATCH, "none")[:-1])  # tune_malloc's 2 GB trim threshold alone: faulted every step
    assert faults > 2 * 500_000, faults


def test_jaxtune_malloc_default_opts_out():
    import os

    env = {**os.environ, "JAXTUNE_MALLOC": "default"}
    assert _python("from jaxtune import runtime; print(runtime.tune_malloc())", env=env) == ["default"]


def test_cli_answers_before_jax_is_imported():
    """`jaxtune train` prints its first line before the imports that take seconds: the CLI module pulls in no JAX."""
    code = "import sys; import jaxtune.cli; print('jax' in sys.modules, 'jaxtune.data' in sys.modules)"
    assert _python(code) == ["False", "False"]


def test_tensorboard_writer_does_not_import_torch():
    pytest.importorskip("torch")
    code = ("import sys; from jaxtune.train.metrics import _summary_writer; _summary_writer(); "
            "print('torch' in sys.modules); import torch; print(torch.__name__)")
    assert _python(code) == ["False", "torch"]  # and torch still imports afterwards
