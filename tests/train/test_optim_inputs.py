"""``optim.formulation`` 1 (issue 49, the first minute): the optimizer's numbers are inputs of the train program, so a
run with another lr, number of steps, warm-up, weight decay, betas, eps or clipping norm lowers the same program
(JAX's persistent cache finds it) and still trains with its own numbers; the learning rates equal the constant
schedule's (formulation 0) within 1e-6; and what shapes the program (the schedule's kind, clipping or none) still
gives another one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxtune import sharding
from jaxtune.aot.step import abstract_batch
from jaxtune.backends import make_state_spec
from jaxtune.config import OptimConfig, load_config
from jaxtune.train.optim import Optimizer, schedule
from jaxtune.train.step import run_steps

TINY_LLAMA = ["model.family=llama", "model.preset=tiny", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
              "model.n_kv_head=1", "model.d_ff=64", "model.max_seq_len=32", "model.vocab_size=64",
              "data.seq_len=16", "train.batch_size=2", "train.compile_cache_dir=null"]


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup,decay", [(0, None), (3, None), (2, 9)])
def test_the_schedule_as_inputs_equals_the_constant_schedule(kind, warmup, decay):
    """Every update's learning rate, past the end of the decay too, within 1e-6 (relative) of optax's schedule with
    the numbers folded in (measured: at most 4.9e-7, at the linear decay's end, where XLA's folded arithmetic
    is the farther from 3e-5)."""
    cfg = OptimConfig(lr=3e-4, schedule=kind, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=0.1)
    opt = Optimizer(cfg, total_steps=12)
    counts = np.arange(16, dtype=np.int32)
    as_inputs = jax.jit(lambda h, c: jax.vmap(opt.schedule(h))(c))(opt.inputs, counts)
    constant = jax.jit(jax.vmap(schedule(cfg, 12)))(counts)
    np.testing.assert_allclose(np.asarray(as_inputs), np.asarray(constant), rtol=1e-6, atol=0)
    assert float(as_inputs[0]) == pytest.approx(3e-4 / warmup if warmup else 3e-4, rel=1e-6)


def _lowered_step(*overrides: str) -> str:
    cfg = load_config(None, [*TINY_LLAMA, *overrides])
    mesh = sharding.mesh_of(cfg.mesh)
    steps = run_steps(make_state_spec(cfg, None, mesh), cfg)
    with sharding.use_mesh(mesh):
        return steps.train.lower(steps.spec.abstract, abstract_batch(cfg, 2, mesh), steps.abstract_frozen()).as_text()


def test_another_lr_or_length_lowers_the_same_train_program():
    base = _lowered_step("optim.lr=3e-4", "train.steps=20")
    changed = ["optim.lr=1e-3", "train.steps=7", "optim.warmup_steps=3", "optim.decay_steps=5", "optim.b1=0.8",
               "optim.b2=0.99", "optim.eps=1e-6", "optim.weight_decay=0.01", "optim.grad_clip=0.5",
               "optim.min_lr_ratio=0.0"]
    assert _lowered_step(*changed) == base
    # what shapes the program gives another one; formulation 0 folds the lr in
    assert _lowered_step("optim.schedule=linear") != base
    assert _lowered_step("optim.grad_clip=null") != base
    folded = _lowered_step("optim.formulation=0", "optim.lr=3e-4", "train.steps=20")
    assert folded != base and _lowered_step("optim.formulation=0", "optim.lr=1e-3", "train.steps=20") != folded


def _train(tmp_path: Path, name: str, cache: Path, lr: float) -> tuple[str, dict[int, float]]:
    """``jaxtune train quickstart`` shrunk to 3 steps of a 1-layer model, in its own process."""
    args = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.max_seq_len=32", "data.seq_len=16",
            "data.max_bytes=20000", "data.val_fraction=0", "tokenizer.vocab_size=300", "tokenizer.train_bytes=20000",
            "train.steps=3", "train.batch_size=2", "checkpoint.every=100", "eval.every=0", "eval.prompts=[]",
            "logging.every=1", "logging.progress=false", "logging.tensorboard=false",
            f"train.compile_cache_dir={cache}", f"data.cache_dir={tmp_path / 'data'}", f"optim.lr={lr}",
            f"run_dir={tmp_path / name}"]
    out = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", "quickstart", *args], capture_output=True,
                         text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return out.stdout, {r["step"]: r["lr"] for r in rows if r.get("kind") == "train"}


def test_a_rerun_with_another_lr_reads_its_train_program_from_the_cache(tmp_path):
    """Two processes (JAX's persistent cache is per process): the second, with another lr, is told its train step
    was read from the compilation cache, and trains with its own lr (the metrics' lr is the program's input)."""
    cache = tmp_path / "xla"
    said, lrs = _train(tmp_path, "first", cache, 1e-3)
    assert "was compiled ahead" in said and "read from the compilation cache" not in said, said
    said, relrs = _train(tmp_path, "again", cache, 2e-3)
    assert "positions was compiled ahead" in said and "read from the compilation cache" in said, said
    assert lrs and relrs.keys() == lrs.keys()
    assert all(relrs[k] == pytest.approx(2 * lrs[k], rel=1e-6) for k in lrs), (lrs, relrs)
