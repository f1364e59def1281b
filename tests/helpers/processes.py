"""Runs in a process of their own beside the test's: `train()` under a driver that kills it (kill -9) or stops it
(SIGTERM) at a step, and `beside`, work in this process while another one runs (on two cores each compile is
single-threaded, so the two overlap)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    from jaxtune.config import load_config
    from jaxtune.job import checkpoint
    from jaxtune.train import metrics
    from jaxtune.loop import train

    mode, at, commit = sys.argv[1], int(sys.argv[2]), int(os.environ.get("DRIVER_COMMIT", "10"))
    cfg = load_config(None, sys.argv[3:])
    if mode != "plain":
        write, save = metrics.MetricsWriter.write, checkpoint.Checkpointer.save
        committed = []

        def save_and_note(self, step, *a, **k):
            save(self, step, *a, **k)
            if step == commit:
                self.wait()  # that step is committed before we pull the plug
                committed.append(step)

        def write_then_signal(self, step, scalars, kind="train"):
            write(self, step, scalars, kind)
            if kind == "train" and step == at:
                if mode == "kill":
                    assert committed, f"checkpoint {commit} must be committed first"
                    os.kill(os.getpid(), signal.SIGKILL)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)

        checkpoint.Checkpointer.save = save_and_note
        metrics.MetricsWriter.write = write_then_signal
    train(cfg)
    """
)


def start_driver(tmp_path: Path, mode: str, at: int, overrides: list[str], commit: int = 10,
                 compile_cache: Path | None = None) -> subprocess.Popen:
    """`DRIVER` in a process of its own: "kill" (kill -9 once the train row of step ``at`` is written, checkpoint
    ``commit`` committed before), "term" (SIGTERM there) or "plain". ``compile_cache``: a persistent XLA compilation
    cache for it (a process that runs the programs of an earlier one loads them instead of compiling)."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, JAX_PLATFORMS="cpu", DRIVER_COMMIT=str(commit))
    if compile_cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
    return subprocess.Popen([sys.executable, str(script), mode, str(at), *overrides], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def wait(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """``proc``'s outcome once it exits (killed after 600 s)."""
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()  # a no-op once it has exited
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_driver(tmp_path: Path, mode: str, at: int, overrides: list[str], commit: int = 10,
               compile_cache: Path | None = None) -> subprocess.CompletedProcess:
    return wait(start_driver(tmp_path, mode, at, overrides, commit, compile_cache))


def beside(proc: subprocess.Popen, work):
    """(work(), the JSON ``proc`` prints after "RESULT"), ``work`` running in this process while ``proc`` (a test's
    run on simulated devices, in its own process) runs: on two cores each compile is single-threaded, so the two
    overlap. ``proc`` is killed if ``work`` fails."""
    try:
        value = work()
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()  # a no-op once it has exited
    assert proc.returncode == 0, err[-3000:]
    return value, json.loads(out.split("RESULT", 1)[1])
