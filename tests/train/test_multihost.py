"""A real 2-process `jax.distributed` run on localhost (CPU, gloo collectives), launched by the test: the same
losses as one process on the same global batch, and its checkpoint resumes in a one-process run."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from jaxtune.config import load_config
from jaxtune.data import load_tokenizer, prepare_tokens
from jaxtune.loop import train

# Each test launches processes that compile on their own (30-90 s apiece on 2 cores): `-m "not slow"` skips them all
pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import json, os, sys
    from jaxtune.config import load_config
    from jaxtune.loop import train
    import jax

    named = sys.argv[2].startswith("--config=")  # a shipped config, then overrides
    result = train(load_config(sys.argv[2].partition("=")[2] if named else None, sys.argv[3 if named else 2:]))
    expected = tuple(int(n) for n in os.environ["EXPECT_PROCESSES_DEVICES"].split(","))
    assert (jax.process_count(), jax.device_count()) == expected, (jax.process_count(), jax.device_count())
    with open(sys.argv[1], "w") as f:
        json.dump({"losses": result.losses, "process": jax.process_index(), "compiles": result.step_compiles,
                   "lengths": result.step_lengths, "step": result.step, "preempted": result.preempted}, f)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The command line, as a user runs it on each host: a user's mistake is one `error:` line, exit 2.
CLI_WORKER = textwrap.dedent(
    """
    import sys
    from jaxtune.cli import main

    sys.exit(main(["train", "quickstart", *sys.argv[2:]]))
    """
)


def _env(processes: int, devices: int) -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                EXPECT_PROCESSES_DEVICES=f"{processes},{processes * devices}")


def _launch(tmp_path, overrides: list[str], cwd=None, worker: str = WORKER,
            extra: tuple[list[str], list[str]] = ([], []), devices: int = 2) -> list[subprocess.Popen]:
    """Two processes of one jax.distributed job on localhost, ``devices`` CPU devices each; ``cwd``: one
    directory for both, or one each; ``extra``: overrides of each process's own."""
    port = _free_port()
    cwds = cwd if isinstance(cwd, (list, tuple)) else [cwd, cwd]
    return [
        subprocess.Popen([sys.executable, "-c", worker, str(tmp_path / f"out{i}.json"), *overrides,
                          f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                          f"distributed.process_id={i}", *extra[i]],
                         env=_env(2, devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=cwds[i])
        for i in range(2)
    ]


def _single(tmp_path, overrides: list[str], devices: int) -> subprocess.Popen:
    """One process (no jax.distributed) over ``devices`` CPU devices, its result in ``single.json``."""
    return subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "single.json"), *overrides],
                            env=_env(1, devices), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _error_lines(errs: list[str]) -> list[str]:
    """Each process's stderr ends with one `error:` line and holds no traceback; the lines."""
    lines = []
    for err in errs:
        assert "Traceback" not in err, err[-3000:]
        lines.append(err.rstrip("\n").splitlines()[-1])
        assert lines[-1].startswith("error: "), err[-3000:]
    return lines


def _finish(tmp_path, procs, ok: bool = True) -> list[dict] | list[str]:
    """Each process's result (``ok``), or each one's stderr when they are expected to fail."""
    outs = [p.communicate(timeout=600) for p in procs]
    if not ok:
        assert all(p.returncode != 0 for p in procs), [err[-2000:] for _, err in outs]
        return [err for _, err in outs]
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
    from jaxtune.job import distributed

    assert distributed.initialize(tiny_cfg().distributed) is False


@pytest.mark.parametrize("env,expected", [({"SLURM_NTASKS": "4"}, True), ({"SLURM_NTASKS": "1"}, False),
                                          ({"TPU_WORKER_HOSTNAMES": "a,b"}, True), ({}, False)])
def test_cluster_detection(monkeypatch, env, expected):
    from jaxtune.job import distributed

    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "JAX_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert distributed._cluster_detected() is expected


GRPO = ["data.format=prompts", "data.chat_template=chatml", "data.seq_len=48", "data.val_fraction=0.1",
        "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
        "objective.name=grpo", "objective.num_generations=4", "objective.max_completion_length=16",
        "objective.prompts_per_step=4", "objective.beta=0.04", "optim.lr=1e-2", "optim.warmup_steps=0",
        "train.steps=3", "eval.every=0", "eval.exact_match=4", "checkpoint.every=3", "checkpoint.async_save=false",
        "logging.every=1", "logging.progress=false", "logging.tensorboard=false"]
FLAKY = """
import jax

def flaky(prompts, completions, rows):
    if jax.process_index() == 1:
        raise ZeroDivisionError("no reward on this host")
    return [1.0 for _ in completions]
"""


@pytest.fixture
def grpo_overrides(tmp_path, data_cache) -> list[str]:
    from helpers.rows import write_jsonl
    from helpers.tiny_runs import MODEL

    from jaxtune.data.synthetic import arithmetic_prompts

    prompts = write_jsonl(tmp_path / "prompts.jsonl", itertools.islice(arithmetic_prompts(), 120))
    return [*MODEL, *GRPO, f"data.sources=[{prompts}]", f"data.cache_dir={data_cache}"]


# Sampling ahead on the learner's own devices has no case here: its order across processes is the one below with
# mesh.rollout=2 (which also moves the weights to the sampler's devices), and test_lagged.py runs it in one process.
@pytest.mark.parametrize("extra", [["objective.dynamic_sampling=true", "objective.max_resample=2",
                                     "objective.loss_type=grpo"], ["reward-model"],
                                   ["objective.max_staleness=1", "mesh.rollout=2"]],
                         ids=["dynamic-grpo", "reward-model", "lagged-own-devices"])
def test_grpo_in_two_processes_samples_and_trains_as_one(tmp_path, grpo_overrides, extra, request):
    """GRPO (a KL to a frozen copy) in 2 processes of 1 CPU device each against one process over the same 2 devices,
    both with mesh fsdp=2 (the weights sharded over the two, the batch split): each process holds its block of the
    step's 4 prompts, the 16 completions are sampled SPMD over both devices, each process scores its own, and the
    training batch is the one process's row for row. Every step's completions, rewards and losses, the held-out
    accuracy and the trained weights (3 Adam steps) agree to 1e-6 (the plain DAPO run has no case of its own: it is
    the reward-model case's, less the model among its rewards). With dynamic sampling (and the per-completion
    ``grpo`` normalisation) both processes decide alike on every process's scores and sample the same extra rounds
    of the data's next prompts, so the run is still the one process's. With a reward model among the rewards (a
    random classifier over the quickstart's tokenizer, its weights sharded over both processes' devices), every
    process's completions are scored in one program and each process keeps its own: the scores are the one
    process's. With rollouts sampled a step ahead (max_staleness 1, corrected by token_truncate) on devices of the
    sampler's own (mesh.rollout=2: 2 devices a process, one the learner's and one the sampler's, against one
    process's 4) every process samples and trains in the same order, so the run is still the one process's, its
    staleness and importance ratios included, the weights gathered on the learner's devices and each process's copy
    moved to its own sampler device after every update."""
    from helpers.run_outputs import final_params, metric_rows

    rewards = "objective.rewards=[{name: exact_number, field: answer}, {name: length, max_tokens: 12, buffer: 8}"
    modelled, dynamic, lagged = extra == ["reward-model"], "objective.dynamic_sampling=true" in extra, \
        "objective.max_staleness=1" in extra
    own = 2 if "mesh.rollout=2" in extra else 1  # devices a process holds
    if modelled:
        from helpers.reward_models import classifier

        rm = classifier(request.getfixturevalue("quickstart_sft_model"), tmp_path / "rm")
        rewards, extra = f"{rewards}, {{name: model, path: {rm}}}", []
    base = [*grpo_overrides, f"{rewards}]", "mesh.fsdp=2", *extra]
    single = _single(tmp_path, [*base, f"run_dir={tmp_path / 'single'}"], devices=2 * own)
    results = _finish(tmp_path, _launch(tmp_path, [*base, f"run_dir={tmp_path / 'two'}"], devices=own))
    _, err = single.communicate(timeout=600)
    assert single.returncode == 0, err[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    assert sorted(int(s) for s in ref["losses"]) == [1, 2, 3]
    for got in results:  # every process logs the global loss
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-9), (got["losses"], ref["losses"])
    one, two = metric_rows(tmp_path / "single", "train"), metric_rows(tmp_path / "two", "train")
    for a, b in zip(one, two, strict=True):  # the sampled completions and their scores are the same at every step
        for k in ("reward", "reward_std", "completions/mean_length", "rewards/length/mean", "grad_norm",
                  *(["dynamic_sampling/rounds", "dynamic_sampling/reward"] if dynamic else []),
                  *(["staleness", "importance_sampling_ratio/mean"] if lagged else []),
                  *(["rewards/model/mean", "rewards/model/std"] if modelled else [])):
            assert a[k] == pytest.approx(b[k], rel=1e-6), (k, a[k], b[k])
    if dynamic:  # the extra rounds happened
        assert any(r["dynamic_sampling/rounds"] > 1 for r in one), [r["dynamic_sampling/rounds"] for r in one]
    if lagged:
        assert [r["staleness"] for r in two] == [0, 1, 1]
    eval_one, eval_two = metric_rows(tmp_path / "single", "eval"), metric_rows(tmp_path / "two", "eval")
    assert [r["accuracy"] for r in eval_one] == [r["accuracy"] for r in eval_two]
    if modelled:  # the held-out answers' model scores too
        assert [r["reward"] for r in eval_one] == pytest.approx([r["reward"] for r in eval_two], rel=1e-6)
    (p1, _), (p2, _) = (final_params(load_config(None, [*base, f"run_dir={tmp_path / d}"]), 3, vocab=300)
                            for d in ("single", "two"))
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), p1, p2)))
    assert worst <= 1e-6, worst


# The ragged-batch check in processes: each loss type's train step on one hand-made batch of 8 completions (2 to 20
# tokens), the short ones on process 0 and the long ones on process 1, in 2 micro-batches (every 2nd row: ragged
# again), against the whole batch at once in one process. Its ``old_logps`` are the trainer's own less noise, so the
# ratios leave the clip range. Process 0 (or the one process) writes every loss type's metrics and updated weights.
ACCUMULATION_WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config
    from jaxtune.job import distributed
    from jaxtune.rollout.rollout import training_rows
    from jaxtune.train.step import run_steps

    out, variants, base = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    cfg = load_config(None, base)
    distributed.initialize(cfg.distributed)
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    rng = np.random.default_rng(0)
    lengths = [2, 3, 4, 5, 14, 17, 19, 20]  # process 0: the short half; process 1: the long one
    prompts = [[1, *rng.integers(10, 290, 6 + i % 3).tolist()] for i in range(8)]
    completions = [rng.integers(10, 290, n).tolist() for n in lengths]
    batch = training_rows(prompts, completions, [[0.0] * n for n in lengths], cfg.data.seq_len)
    batch["advantages"] = np.array([1.2, -0.4, 0.7, -1.5, 0.3, -0.8, 1.1, -0.6], np.float32)
    n, p = jax.process_count(), jax.process_index()
    rows = len(lengths) // n
    results = {}
    with sharding.use_mesh(mesh):
        for name, keys in variants.items():
            run_cfg = load_config(None, [*base, *(f"objective.{k}={v}" for k, v in keys.items())])
            spec = make_state_spec(run_cfg, 300, mesh)
            steps = run_steps(spec, run_cfg)
            state, frozen = spec.init(0), steps.frozen((), 0)
            start = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), state.params)
            if not results:  # the trainer's log-probs of the batch, less noise: the sampling policy
                forward = spec.forward()
                local = {k: v[p * rows:(p + 1) * rows] for k, v in batch.items()}
                logps = jax.jit(forward.token_logps)(state.params, sharding.global_batch(mesh, local))
                logps = np.asarray(jax.experimental.multihost_utils.process_allgather(logps, tiled=True))
                noise = rng.normal(0.0, 0.15, logps.shape).astype(np.float32)
                batch["old_logps"] = (logps + noise * batch["loss_mask"]).astype(np.float32)
            local = {k: v[p * rows:(p + 1) * rows] for k, v in batch.items()}
            new, metrics = steps.train(state, sharding.global_batch(mesh, local), frozen)
            params = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), new.params)
            results[name] = {"metrics": {k: float(v) for k, v in jax.device_get(metrics).items()},
                             "start": jax.tree.leaves(start), "new": jax.tree.leaves(params)}
    if p == 0:
        arrays = {f"{name}/{kind}/{i}": a for name, r in results.items() for kind in ("start", "new")
                  for i, a in enumerate(r[kind])}
        np.savez(out + ".npz", **arrays)
        with open(out, "w") as f:
            json.dump({name: r["metrics"] for name, r in results.items()}, f)
    """
)
# Every loss type with its own normalisation, and GSPO's per-completion means (test_grpo_objective.py ACCUMULATED)
CLIP = {"epsilon": 0.2, "epsilon_high": 0.28}
LOSS_VARIANTS = {t: {"loss_type": t, **CLIP} for t in ("dapo", "grpo", "dr_grpo", "bnpo", "sapo", "vespo")} | {
    "cispo": {"loss_type": "cispo", "epsilon_high": 1.1}, "luspo": {"loss_type": "luspo",
                                                                  "importance_sampling_level": "sequence"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", **CLIP}}


def test_every_loss_type_accumulates_exactly_in_two_processes(tmp_path, grpo_overrides):
    """Exact accumulation across processes: for every loss type, the train step over 2 processes (1 CPU device each,
    mesh data=2) holding very different token counts (14 completion tokens on one, 70 on the other) in 2
    micro-batches each makes the loss, the metrics and the update of the whole batch taken at once in one process,
    within 1e-5 (float32 sums in another order; the update as in test_grpo_objective.py's `update_error`, beyond two
    float32 spacings of the parameter). A mean of per-process or per-micro-batch means would be off by far more."""
    # AdamW's eps at 0.1: at its default 1e-8 a first update is lr * g / (|g| + 1e-8), which the rounding of a gradient
    # entry near 1e-8 moves by a good part of lr (test_grpo_objective.py's reason too)
    base = [*grpo_overrides, "objective.beta=0.0", "objective.prompts_per_step=2", "objective.rewards=[{name: length}]",
            "optim.eps=0.1"]
    variants = json.dumps(LOSS_VARIANTS)
    env = dict(_env(1, 1), XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0")
    single = subprocess.Popen([sys.executable, "-c", ACCUMULATION_WORKER, str(tmp_path / "single.json"), variants,
                               *base], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = _free_port()
    two = [subprocess.Popen([sys.executable, "-c", ACCUMULATION_WORKER, str(tmp_path / "two.json"), variants, *base,
                             "mesh.data=2", "train.micro_batches=2",
                             f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
                             f"distributed.process_id={i}"],
                            env={**_env(2, 1), "XLA_FLAGS": env["XLA_FLAGS"]}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in (single, *two):
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    one, many = (json.loads((tmp_path / f"{r}.json").read_text()) for r in ("single", "two"))
    arrays = {r: np.load(tmp_path / f"{r}.json.npz") for r in ("single", "two")}
    clipped = 0
    for name in LOSS_VARIANTS:
        m1, m2 = one[name], many[name]
        for k, v in m1.items():
            if k.endswith(("/min", "/max")) or not np.isfinite(v):
                continue
            assert abs(m2[k] - v) <= 1e-5 * max(abs(v), 1e-30) + 1e-9, (name, k, v, m2[k])
        clipped += m1.get("clip_ratio/region_mean", 0.0) > 0
        leaves = len([k for k in arrays["single"].files if k.startswith(f"{name}/new/")])
        for i in range(leaves):
            start, a, b = (arrays[r][f"{name}/{kind}/{i}"].astype(np.float64) for r, kind in
                           (("single", "start"), ("two", "new"), ("single", "new")))
            excess = np.abs(a - b) - 2 * np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float32))
            assert np.maximum(excess, 0).max() <= 1e-5 * np.abs(b - start).max(), (name, i)
    assert clipped >= 4  # the ratios left the clip range


def test_a_reward_failing_on_one_host_stops_every_host_with_its_error(tmp_path, grpo_overrides):
    """A reward function that raises on process 1 only: both processes stop (none waits in a collective) with the
    same one-line error naming the function, what it raised and the process."""
    (tmp_path / "flaky_rewards.py").write_text(FLAKY)
    errs = _finish(tmp_path, _launch(tmp_path, [*grpo_overrides, "objective.rewards=[{name: 'flaky_rewards:flaky'}]",
                                                f"run_dir={tmp_path / 'run'}", "mesh.data=2", "mesh.fsdp=2"],
                                     cwd=tmp_path), ok=False)
    for err in errs:
        assert "reward 'flaky' raised ZeroDivisionError: no reward on this host" in err, err[-2000:]
        assert f"(on process 1, host {socket.gethostname()})" in err


DPO = ["data.format=preference", "data.chat_template=chatml", "data.seq_len=64", "data.val_fraction=0.1",
       "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
       "objective.name=dpo", "optim.lr=1e-3", "optim.warmup_steps=0", "train.batch_size=8", "train.steps=3",
       "eval.every=3", "eval.batches=1", "checkpoint.every=3", "checkpoint.async_save=false", "logging.every=1",
       "logging.progress=false", "logging.tensorboard=false"]


def test_dpo_in_two_processes_trains_as_one(tmp_path, data_cache):
    """DPO in 2 processes of 1 CPU device each against one process over the same 2 devices (mesh fsdp=2), its
    reference log-probs precomputed once before training (each process computing its rows' share, every process
    keeping them all): the losses, the held-out reward accuracy and loss, and the trained weights agree to 1e-6; the
    length buckets (and so the compiled programs) are the one-process run's, though each process holds half of every
    batch. (A frozen copy as the reference, computed in the step, is GRPO's KL reference in
    `test_grpo_in_two_processes_samples_and_trains_as_one`.)"""
    from helpers.rows import write_jsonl
    from helpers.run_outputs import final_params, metric_rows
    from helpers.tiny_runs import MODEL

    from jaxtune.data.synthetic import arithmetic_preferences

    rows = list(itertools.islice(arithmetic_preferences(), 120))
    for k, row in enumerate(rows):  # every 5th prompt long: batches of different lengths, whose longest pair may be
        if k % 5 == 0:              # on either process
            row["prompt"][0]["content"] = "Think it through. " * (k % 7 + 1) + row["prompt"][0]["content"]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    base = [*MODEL, *DPO, f"data.sources=[{pairs}]", f"data.cache_dir={data_cache}",
            "objective.precompute_ref_logps=true", "mesh.fsdp=2"]
    single = _single(tmp_path, [*base, f"run_dir={tmp_path / 'single'}"], devices=2)
    results = _finish(tmp_path, _launch(tmp_path, [*base, f"run_dir={tmp_path / 'two'}"], devices=1))
    _, err = single.communicate(timeout=600)
    assert single.returncode == 0, err[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    assert len(set(ref["lengths"])) >= 2, ref["lengths"]  # several buckets met
    for got in results:
        # each process holds half of every batch, yet both cut it to the bucket of the whole batch's longest pair
        # (agreed across processes): the lengths and programs of one process's run
        assert got["lengths"] == ref["lengths"] and got["compiles"] == ref["compiles"] == len(ref["lengths"]), got
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-9), (got["losses"], ref["losses"])
    (one,), (two,) = [[r for r in metric_rows(tmp_path / d, "eval") if r["step"] == 3] for d in ("single", "two")]
    assert one["rewards/accuracies"] == two["rewards/accuracies"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    (p1, _), (p2, _) = (final_params(load_config(None, [*base, f"run_dir={tmp_path / d}"]), 3, vocab=300)
                        for d in ("single", "two"))
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(a - b).max()), p1, p2)))
    assert worst <= 1e-6, worst


def test_processes_with_different_configs_stop_at_once_naming_the_key_and_host(tmp_path, tiny_overrides):
    """Every process compares its config with process 0's right after joining: a difference (here a command line
    changed on one host) is one line on every host, naming the key, both values and the host."""
    host = socket.gethostname()
    errs = _finish(tmp_path, _launch(tmp_path, [*tiny_overrides, "train.steps=6"], worker=CLI_WORKER,
                                     extra=([], ["train.steps=7"])), ok=False)
    for line in _error_lines(errs):
        assert line == (f"error: process 1 (host {host}) runs another config than process 0 (host {host}): "
                        "train.steps=7 there, 6 on process 0; start every process with the same config file and "
                        "overrides")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_context_axis_across_hosts_is_refused_on_every_host(tmp_path, tiny_overrides):
    """Each process feeds whole rows, so the devices that split one sequence (mesh.context) must share a host: two
    processes of 2 devices with context=4 is one line on each, naming the sizes and the devices per host."""
    errs = _finish(tmp_path, _launch(tmp_path, [*tiny_overrides, "mesh.data=1", "mesh.context=4"],
                                     worker=CLI_WORKER), ok=False)
    for line in _error_lines(errs):
        assert line == ("error: mesh.context=4 (x mesh.tensor=1) spans processes [0, 1]: the devices that share a "
                        "sequence must be on one host; make mesh.context x mesh.tensor divide the devices per host (2)")
    assert not any((tmp_path / "run" / "checkpoints").iterdir())  # refused before the first step


def test_a_data_file_missing_on_one_host_stops_every_host_naming_it(tmp_path, tiny_overrides):
    """The same config on both hosts, but data.sources' file exists on host 0 only (each process runs in its own
    directory here): both stop with the error of process 1, naming it and its host, rather than process 0 waiting
    in the first collective."""
    here, there = tmp_path / "host0", tmp_path / "host1"
    here.mkdir(), there.mkdir()
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}?"}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(40)]
    (here / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [o for o in tiny_overrides if not o.startswith("data.sources")]
    errs = _finish(tmp_path, _launch(tmp_path, [*overrides, "data.sources=[rows.jsonl]", "data.format=messages",
                                                "data.chat_template=chatml", "data.seq_len=64",
                                                "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]"],
                                  worker=CLI_WORKER, cwd=[here, there]),
                   ok=False)
    for line in _error_lines(errs):
        assert line == ("error: data.sources[0]: no such file or directory: rows.jsonl; give a file, a glob or a "
                        f"directory (on process 1, host {socket.gethostname()})"), line


def _refused_in_one_line(capsys, overrides: list[str], address: str, process_id: int, timeout: int) -> str:
    """`jaxtune train` as process ``process_id`` of 2 at ``address``: it exits 2 within 30 s with one error line and no
    traceback; that line."""
    from jaxtune.cli import main

    started = time.monotonic()
    assert main(["train", "quickstart", *overrides, f"distributed.coordinator_address={address}",
                 "distributed.num_processes=2", f"distributed.process_id={process_id}",
                 f"distributed.timeout={timeout}"]) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error: ") == 1
    return err.rstrip().splitlines()[-1]


def test_a_coordinator_that_does_not_answer_is_one_line_after_the_timeout(tmp_path, tiny_overrides, capsys):
    """Process 1 of 2 whose coordinator never starts: one line naming the address, the process and its host after
    distributed.timeout, not JAX's fatal abort (a C++ check failure that kills the process with a stack dump)."""
    address = f"127.0.0.1:{_free_port()}"
    assert _refused_in_one_line(capsys, tiny_overrides, address, process_id=1, timeout=2) == (
        f"error: distributed.coordinator_address={address}: process 1 (host {socket.gethostname()}) could not reach "
        "the coordinator in 2 s (Connection refused (ECONNREFUSED)); start process 0 with the same address, and check "
        "that this host can reach it (address, port, firewall), or raise distributed.timeout")


def test_a_process_that_never_starts_is_one_line_after_the_timeout(tmp_path, tiny_overrides):
    """Process 0 of 2 whose partner is never started: after distributed.timeout, one line naming the process count,
    the coordinator and what to do, exit 2; not JAX's abort blaming "another task died" with a C++ stack dump."""
    address = f"127.0.0.1:{_free_port()}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CLI_WORKER, "-", *tiny_overrides,
                           f"distributed.coordinator_address={address}", "distributed.num_processes=2",
                           "distributed.process_id=0", "distributed.timeout=2"],
                          env=_env(2, 1), capture_output=True, text=True, timeout=120, check=False)
    assert time.monotonic() - started < 40
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Check failure" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"error: distributed.num_processes=2: process 0 (host {socket.gethostname()}) waited 2 s at the coordinator "
        f"{address} and not every process joined; start all 2 processes, each with its own distributed.process_id "
        "and the same distributed.coordinator_address, or raise distributed.timeout")


def test_a_process_id_beyond_the_process_count_is_refused_before_joining(tmp_path, tiny_overrides, capsys):
    """distributed.process_id=2 of num_processes=2: one line naming both keys and the host, at once; not a
    coordinator that "could not be reached" after the timeout."""
    address = f"127.0.0.1:{_free_port()}"
    assert _refused_in_one_line(capsys, tiny_overrides, address, process_id=2, timeout=60) == (
        f"error: distributed.process_id=2 (host {socket.gethostname()}) is not below distributed.num_processes=2: "
        "number the processes 0 to 1, or raise distributed.num_processes")


def test_grpo_with_tools_in_two_processes_samples_and_trains_as_one(tmp_path, agent_model, data_cache):
    """Multi-turn rollouts with a tool (`agent-quickstart` on the session's briefly fine-tuned agent model) in 2
    processes of 1 CPU device each against one process over 2 devices: each process resets its own rollouts'
    environments and runs their tool calls in its own worker, the appended ids are shared before every turn, so
    every turn is the one process's. The step's tool calls, rewards, model-token counts and losses agree."""
    from helpers.run_outputs import metric_rows

    base = ["--config=agent-quickstart", f"model.from_hf={agent_model}", f"data.cache_dir={data_cache}",
            "train.steps=2", "objective.prompts_per_step=2", "objective.num_generations=4", "mesh.fsdp=2",
            "eval.every=0", "eval.exact_match=0", "checkpoint.every=2", "checkpoint.async_save=false",
            "logging.every=1", "logging.progress=false", "logging.tensorboard=false"]
    single = _single(tmp_path, [*base, f"run_dir={tmp_path / 'single'}"], devices=2)
    results = _finish(tmp_path, _launch(tmp_path, [*base, f"run_dir={tmp_path / 'two'}"], devices=1))
    _, err = single.communicate(timeout=600)
    assert single.returncode == 0, err[-3000:]
    ref = json.loads((tmp_path / "single.json").read_text())
    for got in results:
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-9), (got["losses"], ref["losses"])
    one, two = metric_rows(tmp_path / "single", "train"), metric_rows(tmp_path / "two", "train")
    assert sum(r["tools/call_frequency"] for r in one) > 0  # the rollouts called the tool
    for a, b in zip(one, two, strict=True):
        for k in ("tools/call_frequency", "tools/failure_frequency", "tools/malformed_frequency", "reward",
                  "completions/mean_length", "count", "grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-6), (k, a[k], b[k])
