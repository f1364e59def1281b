"""A real 2-process `jax.distributed` run on localhost (CPU, gloo collectives), launched by the test: the same
losses as one process on the same global batch, and its checkpoint resumes in a one-process run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from jaxtune.config import load_config
from jaxtune.data import load_tokenizer, prepare_tokens
from jaxtune.loop import train

WORKER = textwrap.dedent(
    """
    import json, sys
    from jaxtune.config import load_config
    from jaxtune.loop import train
    import jax

    result = train(load_config(None, sys.argv[2:]))
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    with open(sys.argv[1], "w") as f:
        json.dump({"losses": result.losses, "process": jax.process_index(), "compiles": result.step_compiles,
                   "step": result.step, "preempted": result.preempted}, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, overrides: list[str]) -> list[subprocess.Popen]:
    """Two processes of one jax.distributed job on localhost, 2 CPU devices each (4 in all)."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return [
        subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / f"out{i}.json"), *overrides,
                          f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                          f"distributed.process_id={i}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]


def _finish(tmp_path, procs) -> list[dict]:
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]


def test_two_processes_match_one_and_resume_in_one(tmp_path, tiny_overrides):
    base = tiny_overrides + ["train.steps=6", "checkpoint.every=3", "checkpoint.async_save=false"]
    ref_cfg = load_config(None, base + [f"run_dir={tmp_path / 'single'}"])
    prepare_tokens(ref_cfg.data, load_tokenizer(ref_cfg.tokenizer, ref_cfg.data))  # the shared cache, built once
    ref = train(ref_cfg)

    run_dir = tmp_path / "two"
    results = _finish(tmp_path, _launch(tmp_path, [*base, f"run_dir={run_dir}", "mesh.data=2", "mesh.fsdp=2"]))
    for i, got in enumerate(results):
        assert got["process"] == i and got["compiles"] == 1
        assert sorted(int(s) for s in got["losses"]) == list(range(1, 7))
        for step, loss in got["losses"].items():  # every process sees the global loss
            assert abs(loss - ref.losses[int(step)]) <= 1e-5 * abs(ref.losses[int(step)]), (i, step)

    # The 2-process checkpoint of step 3 resumes in one process (one device) and continues the same trajectory.
    shutil.rmtree(run_dir / "checkpoints" / "6")
    resumed = train(load_config(None, base + [f"run_dir={run_dir}"]))
    assert sorted(resumed.losses) == list(range(4, 7))
    for step, loss in resumed.losses.items():
        assert abs(loss - ref.losses[step]) <= 1e-5 * abs(ref.losses[step]), step


def test_sigterm_on_one_host_stops_every_host_at_the_same_step(tmp_path, tiny_overrides):
    """SIGTERM to process 1 only: JAX's preemption sync point makes both processes save the same step, with
    one committed checkpoint, and exit 0."""
    run_dir = tmp_path / "run"
    procs = _launch(tmp_path, [*tiny_overrides, "train.steps=100000", "checkpoint.every=100000",
                               f"run_dir={run_dir}", "eval.batches=1"])
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until training is under way (process 0 logs every step)
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    a, b = _finish(tmp_path, procs)
    assert a["preempted"] and b["preempted"] and a["step"] == b["step"] < 100000
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(a["step"])]
    assert (run_dir / "checkpoints" / str(a["step"]) / "commit_success.txt").is_file()


def test_single_process_does_not_initialize(tiny_cfg):
    from jaxtune.train import distributed

    assert distributed.initialize(tiny_cfg().distributed) is False


@pytest.mark.parametrize("env,expected", [({"SLURM_NTASKS": "4"}, True), ({"SLURM_NTASKS": "1"}, False),
                                          ({"TPU_WORKER_HOSTNAMES": "a,b"}, True), ({}, False)])
def test_cluster_detection(monkeypatch, env, expected):
    from jaxtune.train import distributed

    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed._cluster_detected() is expected
