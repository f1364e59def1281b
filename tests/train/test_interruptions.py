"""Interruptions lose nothing: a first Ctrl-C saves and exits 0 (a second aborts at once; on several hosts every
host saves the same step), a resumed run's metrics.jsonl, samples.jsonl and TensorBoard hold each step once, a second
``jaxtune train`` on a run_dir is refused (a dead run's lock is taken over), and a write that fails (a file-size
limit, a full disk, a read-only run_dir) is one line, with the last checkpoint intact and resumed.

Real ``jaxtune train`` processes (`jaxtune.cli.main`), signalled or limited as a user's would be; tiny model, CPU.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers.tiny_config import TINY
from tensorboardX.proto.event_pb2 import Event, SessionLog

from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.job.checkpoint import COMMIT_MARK, _QuietFailedWrites
from jaxtune.job.run_dir import LOCK_NAME, RunLock
from jaxtune.loop import train

HOST = socket.gethostname()
SAVED = r"(SIGINT|SIGTERM): saved step (\d+), exiting; re-run the same command to resume"


def without_starting(stdout: str) -> str:
    """``stdout`` of `jaxtune train` without the line the CLI prints at once, before its imports
    (``jaxtune train CONFIG: starting``): what the run itself said."""
    return "".join(line for line in stdout.splitlines(keepends=True)
                   if not (line.startswith("jaxtune train ") and line.rstrip("\n").endswith(": starting")))


# `jaxtune train` (the CLI's main), which acts once the train row of step AT is written: "sigint" (Ctrl-C),
# "sigint2" (Ctrl-C twice), "kill" (kill -9), "pause" (until the file $GO exists, after touching $PAUSED) or "none".
# FSIZE > 0: a `ulimit -f` of that many bytes (Python ignores SIGXFSZ, so a write past it fails with EFBIG).
DRIVER = textwrap.dedent(
    """
    import os, resource, signal, sys, time
    from pathlib import Path
    from jaxtune import cli
    from jaxtune.train import metrics

    action, at, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if fsize:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    write = metrics.MetricsWriter.write

    def write_then_act(self, step, scalars, kind="train"):
        write(self, step, scalars, kind)
        if kind != "train" or step != at:
            return
        if action == "pause":
            Path(os.environ["PAUSED"]).touch()
            while not Path(os.environ["GO"]).exists():
                time.sleep(0.05)
        elif action in ("sigint", "sigint2"):
            for _ in range(2 if action == "sigint2" else 1):
                os.kill(os.getpid(), signal.SIGINT)
        elif action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    metrics.MetricsWriter.write = write_then_act
    sys.exit(cli.main(sys.argv[4:]))
    """
)


@pytest.fixture
def driver(tmp_path) -> list[str]:
    """The command line that starts `DRIVER`: append action, at, fsize, then the CLI's arguments."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return [sys.executable, str(script)]


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("{}\n")  # every key comes from the overrides
    return path


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", **extra)


@pytest.fixture(scope="module")
def xla_cache(tmp_path_factory) -> dict[str, str]:
    """The environment of a persistent XLA compilation cache shared by this module's one-process `jaxtune train`
    runs: they run the same tiny programs, and a process that finds them there loads them instead of compiling.
    (Not for the runs under a file-size limit, whose cache writes could fail, nor the two-process run, whose
    processes would write the same entries at once.)"""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla-cache"))}


def _run(command: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=False, capture_output=True, text=True, env=_env(**extra_env), timeout=600)


def _committed(run: Path) -> list[int]:
    ckpts = run / "checkpoints"
    return sorted(int(d.name) for d in ckpts.iterdir() if d.name.isdigit() and (d / COMMIT_MARK).is_file())


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _steps(path: Path, kind: str | None = None) -> list[int]:
    return [r["step"] for r in _rows(path) if kind is None or r.get("kind") == kind]


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative path -> bytes): equal snapshots mean nothing was lost or changed."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _no_traceback(err: str) -> None:
    assert "Traceback" not in err and "ERROR:" not in err, err[-3000:]


@pytest.fixture(scope="module")
def seed(tmp_path_factory, data_cache) -> Path:
    """A run trained to step 10 (checkpoints 5 and 10), copied by the tests that need one: nothing may change it."""
    cfg = load_config(None, TINY + [f"run_dir={tmp_path_factory.mktemp('seed') / 'run'}",
                                    f"data.cache_dir={data_cache}", "train.steps=10", "checkpoint.async_save=false"])
    train(cfg)
    assert _committed(cfg.run_path) == [5, 10]
    return cfg.run_path


def _seeded(seed: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(seed, run)
    return run


# --- 1: Ctrl-C --------------------------------------------------------------------------------------------------------


def test_first_ctrl_c_saves_the_step_and_exits_0(tmp_path, tiny_overrides, config_file, driver, xla_cache):
    over = tiny_overrides + ["checkpoint.every=100"]
    proc = _run([*driver, "sigint", "7", "0", "train", str(config_file), *over], **xla_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _no_traceback(proc.stderr)
    said = [line for line in proc.stdout.splitlines() if re.fullmatch(SAVED, line)]
    assert len(said) == 1 and said[0] == proc.stdout.splitlines()[-1], proc.stdout
    name, step = re.fullmatch(SAVED, said[0]).groups()
    run = load_config(None, over).run_path
    assert name == "SIGINT" and int(step) in (7, 8)  # the signal lands while step 8 runs: saved at that boundary
    assert _committed(run) == [int(step)]
    assert not (run / LOCK_NAME).exists()

    result = train(load_config(None, over))  # the same command again resumes there and finishes
    assert result.step == 20 and min(result.losses) == int(step) + 1


def test_second_ctrl_c_aborts_at_once(tmp_path, tiny_overrides, config_file, driver, capsys, xla_cache):
    """The second SIGINT ends the process where it is, without saving: checkpoint 5 is the last one, and the
    next run resumes from it, taking over the lock the aborted run left."""
    over = tiny_overrides + ["checkpoint.async_save=false"]
    proc = subprocess.Popen([*driver, "sigint2", "7", "0", "train", str(config_file), *over], env=_env(**xla_cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    _no_traceback(err)
    assert "saved step" not in out
    run = load_config(None, over).run_path
    assert _committed(run) == [5]

    assert main(["train", str(config_file), *over, "train.steps=8"]) == 0
    lines = without_starting(capsys.readouterr().out).splitlines()
    lock = run / LOCK_NAME
    assert lines[0] == f"took over the run lock {lock} from PID {proc.pid} on {HOST}, which is no longer running"
    assert f"resumed from {run / 'checkpoints' / '5'} (step 5/8)" in lines
    assert _committed(run) == [5, 8] and not lock.exists()


MULTIHOST_WORKER = textwrap.dedent(
    """
    import sys
    from jaxtune import cli
    sys.exit(cli.main(sys.argv[1:]))
    """
)


@pytest.mark.slow
def test_ctrl_c_on_one_host_stops_every_host_at_the_same_step(tmp_path, tiny_overrides, config_file):
    """SIGINT to process 1 of a 2-process run: both save the same step (one checkpoint) and exit 0; process 0 says
    SIGINT. Both processes train in one run_dir: the lock is the run's, not each process's."""
    run = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, "-c", MULTIHOST_WORKER, "train", str(config_file), *tiny_overrides,
                               "train.steps=100000", "checkpoint.every=100000", f"run_dir={run}", "eval.batches=1",
                               f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                               f"distributed.process_id={i}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.time() + 300
    while time.time() < deadline:  # wait until training is under way (process 0 logs every step)
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:
            break
        assert all(p.poll() is None for p in procs), [p.communicate()[1][-3000:] for p in procs]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGINT)
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        _no_traceback(err)
    said = re.search(SAVED, outs[0][0])
    assert said and said.group(1) == "SIGINT", outs[0][0][-2000:]
    assert _committed(run) == [int(said.group(2))] and int(said.group(2)) < 100000
    assert not (run / LOCK_NAME).exists()


# --- 2: no duplicate rows after a resume ------------------------------------------------------------------------------


def _tensorboard_scalars(logdir: Path, purge: bool = True) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them: the events files in order, and a SessionLog START at step S
    (what `SummaryWriter(purge_step=S)` writes) purges the events of steps >= S written before it (unless not
    ``purge``: every event written)."""
    seen: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):  # TFRecord: length (8), its crc (4), the record, its crc (4)
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 16 + n
            if purge and event.HasField("session_log") and event.session_log.status == SessionLog.START:
                seen = {tag: [(s, v) for s, v in pts if s < event.step] for tag, pts in seen.items()}
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append((event.step, value.simple_value))
    return seen


def test_resume_leaves_one_row_per_step(tmp_path, tiny_overrides, config_file, driver, capsys, xla_cache):
    """kill -9 after step 12 (checkpoint 10, an evaluation with samples at 11): the resumed run redoes 11 and 12; no
    row of the killed attempt after step 10 remains, in metrics.jsonl, samples.jsonl or TensorBoard."""
    over = tiny_overrides + ["checkpoint.async_save=false", "logging.tensorboard=true", "eval.every=11",
                             "eval.prompts=['def f(x):']", "eval.max_new_tokens=4"]
    run = load_config(None, over).run_path
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("the user's own file\n")
    killed = _run([*driver, "kill", "12", "0", "train", str(config_file), *over], **xla_cache)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _committed(run) == [5, 10]
    assert _steps(run / "metrics.jsonl", "train") == list(range(1, 13))
    assert _steps(run / "samples.jsonl") == [0, 11]
    before = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 10]
    tb_before = [s for s, _ in _tensorboard_scalars(run / "tensorboard")["train/loss"]]
    assert tb_before == list(range(1, len(tb_before) + 1)) and tb_before[-1] > 10  # the last events may be unflushed

    assert main(["train", str(config_file), *over]) == 0
    assert f"resumed from {run / 'checkpoints' / '10'} (step 10/20)" in capsys.readouterr().out
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert rows[:len(before)] == before  # the rows up to the checkpoint, as they were
    assert _steps(run / "metrics.jsonl", "train") == list(range(1, 21))
    assert _steps(run / "metrics.jsonl", "eval") == [0, 11, 20]
    assert _steps(run / "samples.jsonl") == [0, 11, 20]
    assert (run / "notes.txt").read_text() == "the user's own file\n"

    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per attempt
    tb = _tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 21))  # one curve
    written = [s for s, _ in _tensorboard_scalars(run / "tensorboard", purge=False)["train/loss"]]
    assert written.count(11) == 2  # step 11 was written twice: TensorBoard shows it once because of the purge
    assert [s for s, _ in tb["eval/loss"]] == [0, 11, 20]
    jsonl = {r["step"]: r["loss"] for r in _rows(run / "metrics.jsonl") if r["kind"] == "train"}
    assert all(abs(v - jsonl[s]) <= 1e-6 * abs(jsonl[s]) for s, v in tb["train/loss"])


# --- 3: one run per run_dir -------------------------------------------------------------------------------------------


def test_second_run_on_a_run_dir_is_refused(tmp_path, tiny_overrides, config_file, driver, capsys, xla_cache):
    paused, go = tmp_path / "paused", tmp_path / "go"
    first = subprocess.Popen([*driver, "pause", "3", "0", "train", str(config_file), *tiny_overrides],
                             env=_env(PAUSED=str(paused), GO=str(go), **xla_cache), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not paused.exists():
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.1)
        run = load_config(None, tiny_overrides).run_path
        assert main(["train", str(config_file), *tiny_overrides]) == 2
        captured = capsys.readouterr()
        assert without_starting(captured.out) == ""
        assert captured.err == (f"error: {run} is in use by another run: PID {first.pid} on {HOST} holds "
                                f"{run / LOCK_NAME}\n")
    finally:
        go.touch()
        _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert _steps(run / "metrics.jsonl", "train") == list(range(1, 21))  # one run's rows, once
    assert not (run / LOCK_NAME).exists()


def test_lock_held_on_another_host_is_refused(tmp_path, tiny_overrides, config_file, capsys):
    """A lock taken on another host: whether its process runs cannot be known here, so it is refused, naming that
    host and PID, and left as it is."""
    run = load_config(None, tiny_overrides).run_path
    run.mkdir(parents=True)
    lock = RunLock(run)
    assert lock.acquire() is None
    lock.release()
    assert not lock.path.exists()
    lock.path.write_text(json.dumps({"host": "node-7.example", "pid": 4242}) + "\n")
    before = lock.path.read_bytes()
    assert main(["train", str(config_file), *tiny_overrides]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {run} is in use by another run: PID 4242 on node-7.example holds {lock.path}; "
                            f"if that run has ended, delete {lock.path}\n")
    assert lock.path.read_bytes() == before and sorted(p.name for p in run.iterdir()) == [LOCK_NAME]


# --- 7: failed writes -------------------------------------------------------------------------------------------------


def _checkpoint_error(run: Path, step: int, error: str) -> str:
    """The one line of a save that failed with ``error`` (a pattern), the last complete checkpoint being 10."""
    ckpts = re.escape(str(run / "checkpoints"))
    return (rf"error: checkpoint of step {step} not saved: cannot write {ckpts}/{step}\.orbax-checkpoint-tmp\S*: "
            rf"{error}; its unfinished files were moved to {ckpts}/{step}\.incomplete-\d+; the last complete "
            rf"checkpoint, step 10, is intact and the same command resumes from it\n")


def _resumes_from_10(run: Path, over: list[str]) -> None:
    result = train(load_config(None, over))
    assert sorted(result.losses) == list(range(11, 21))
    assert _steps(run / "metrics.jsonl", "train") == list(range(1, 21))
    assert _committed(run) == [5, 10, 15, 20]


def test_file_size_limit_during_a_save_is_one_line(seed, tmp_path, tiny_overrides, config_file, driver):
    """`ulimit -f` below a checkpoint's size (200 kB; the state is 2 MB): the asynchronous save of step 15 fails
    with EFBIG. One line; checkpoint 10 is intact and resumed; step 15's files are set aside, not deleted."""
    run = _seeded(seed, tmp_path)
    kept = _snapshot(run / "checkpoints" / "10")
    over = tiny_overrides + ["checkpoint.async_save=true"]
    # No persistent compilation cache under the limit, even one set for the whole session: writing it could fail too.
    proc = _run([*driver, "none", "0", "200000", "train", str(config_file), *over], JAX_COMPILATION_CACHE_DIR="")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.fullmatch(_checkpoint_error(run, 15, r"File too large \(EFBIG\)"), proc.stderr), proc.stderr[-3000:]
    assert _committed(run) == [5, 10] and _snapshot(run / "checkpoints" / "10") == kept
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("15.incomplete-")]
    assert len(aside) == 1 and any(aside[0].rglob("*"))
    _resumes_from_10(run, over)
    assert aside[0].is_dir()  # still there after the resumed run


def _namespace() -> list[str]:
    """A user and mount namespace (as root in it) in which a test may mount: tmpfs, or a read-only bind mount."""
    probe = (subprocess.run(["unshare", "-rm", "true"], check=False, capture_output=True)
             if shutil.which("unshare") else None)
    if probe is None or probe.returncode:
        pytest.skip("needs `unshare -rm` (a user and mount namespace) to mount a size-limited or read-only directory")
    return ["unshare", "-rm", "sh", "-ec"]


# Fill the file system of directory argv[1] up to argv[2] free bytes.
FILL = textwrap.dedent(
    """
    import os, sys
    st = os.statvfs(sys.argv[1])
    with open(os.path.join(sys.argv[1], "filler"), "wb") as f:
        f.write(bytes(st.f_bavail * st.f_frsize - int(sys.argv[2])))
    """
)


def test_full_disk_during_a_save_is_one_line(seed, tmp_path, tiny_overrides, config_file, driver, xla_cache):
    """The run_dir on a 16 MB tmpfs with 300 kB left: the save of step 15 fails with ENOSPC (and, as the disk is
    then full, so may the next metrics row: the checkpoint's error is the one reported). After space is freed, the
    same command resumes from 10."""
    ns = _namespace()
    run = tmp_path / "run"
    run.mkdir()
    out1, out2 = tmp_path / "failed", tmp_path / "resumed"
    over = tiny_overrides + ["checkpoint.async_save=true"]
    train_cmd = " ".join(f"'{a}'" for a in [*driver, "none", "0", "0", "train", str(config_file), *over])
    (tmp_path / "fill.py").write_text(FILL)
    script = f"""
        mount -t tmpfs -o size=16m tmpfs {run}
        cp -a {seed}/. {run}/
        {sys.executable} {tmp_path / "fill.py"} {run} 300000
        rc=0; {train_cmd} > {tmp_path}/out1 2> {tmp_path}/err1 || rc=$?; echo $rc > {tmp_path}/rc1
        cp -a {run}/. {out1}/
        rm {run}/filler
        rc=0; {train_cmd} > {tmp_path}/out2 2> {tmp_path}/err2 || rc=$?; echo $rc > {tmp_path}/rc2
        cp -a {run}/. {out2}/
    """
    done = subprocess.run([*ns, textwrap.dedent(script)], check=False, capture_output=True, text=True,
                          env=_env(**xla_cache), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    err1 = (tmp_path / "err1").read_text()
    assert (tmp_path / "rc1").read_text().strip() == "2", err1[-3000:]
    assert re.fullmatch(_checkpoint_error(run, 15, r"No space left on device \(ENOSPC\)"), err1), err1[-3000:]
    assert _committed(out1) == [5, 10]
    assert _snapshot(out1 / "checkpoints" / "10") == _snapshot(seed / "checkpoints" / "10")
    aside = [p.name for p in (out1 / "checkpoints").iterdir() if "incomplete" in p.name]
    assert len(aside) == 1 and aside[0].startswith("15.incomplete-")

    err2 = (tmp_path / "err2").read_text()
    assert (tmp_path / "rc2").read_text().strip() == "0", err2[-3000:]
    assert f"resumed from {run / 'checkpoints' / '10'} (step 10/20)" in (tmp_path / "out2").read_text()
    assert _committed(out2) == [5, 10, 15, 20]
    assert _steps(out2 / "metrics.jsonl", "train") == list(range(1, 21))


def test_read_only_run_dir_is_one_line(seed, tmp_path, tiny_overrides, config_file, driver):
    """A read-only run_dir (a read-only bind mount; chmod does not stop root): one line naming the file and the OS
    error, and nothing in it changed."""
    ns = _namespace()
    run = _seeded(seed, tmp_path)
    before = _snapshot(run)
    train_cmd = " ".join(f"'{a}'" for a in [*driver, "none", "0", "0", "train", str(config_file), *tiny_overrides])
    script = f"mount --bind {run} {run}; mount -o remount,bind,ro {run}; exec {train_cmd}"
    proc = subprocess.run([*ns, script], check=False, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == f"error: cannot write {run / LOCK_NAME}: Read-only file system (EROFS)\n"
    assert without_starting(proc.stdout) == ""
    assert _snapshot(run) == before


def test_an_unretrieved_tensorstore_write_error_is_not_logged_again():
    """asyncio logs "Future exception was never retrieved" when a future holding tensorstore's write error is
    collected; that error has no Orbax frame (tensorstore set it from C++) and may come after the one line. The
    filter drops it by its message; an unrelated error of asyncio's still gets through."""
    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved",
                                 None, (type(exc), exc, None))

    written = ValueError('OUT_OF_RANGE: Error writing "p/0" in OCDBT database at local file "/r/": Failed writing: '
                         '"/r/d/418a": Failed to write 64384 bytes to file 10: File too large [os_error_code=\'27\']')
    quiet = _QuietFailedWrites()
    assert not quiet.filter(record(written))
    assert quiet.filter(record(ValueError("something else went wrong")))
    assert quiet.filter(logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "no exception", None, None))
