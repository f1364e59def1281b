"""The run's reports (jaxtune.train.metrics): the plain progress lines' time left."""

from __future__ import annotations

import jax

from jaxtune.train import metrics


def test_plain_progress_leaves_out_every_compile(monkeypatch, capsys):
    """Steps of 1 s, after a first step that compiled for a minute and with a new program compiling for 30 s at step 3
    (a new length bucket): every line says 1 s a step and the time left at that rate."""
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(metrics, "PLAIN_EVERY", 0.0)
    progress = metrics.PlainProgress(0, 100)
    now[0] += 60.0  # the setup and the first step's compile
    progress.advance(1)
    for step in range(2, 6):
        now[0] += 1.0
        if step == 3:
            now[0] += 30.0
            jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 30.0)
        progress.advance(1)
    assert capsys.readouterr().out.splitlines() == [
        "progress: step 1/100 (1%)",
        *(f"progress: step {s}/100 ({s}%), 1.00 s/step, about {(100 - s) / 60:.1f} min left" for s in range(2, 6))]
