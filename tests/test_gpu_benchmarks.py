"""The GPU benchmark scripts (benchmarks/gpu/) run end to end in their ``--tiny`` mode on the CPU, so they cannot rot
between the sessions that have a GPU: each script is run as a user runs it (a subprocess, each implementation in a
child process of its own) and its JSON must hold every expected row with positive, finite numbers. Beyond that the
rows must agree where they compute the same thing: the train step compiles once, a freshly initialised model's loss
on uniform random tokens is ln(vocab), every LoRA side trains the same adapter parameters, and transformers + PEFT
and jaxtune's torchax backend (same weights, same packed batches, same optimizer) give the same loss at every
step.
PyTorch, transformers, PEFT and torchax are optional: a script marks the sides it cannot run as skipped, with the
reason, and the test checks that instead."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "gpu"
LN_TOL = 0.1  # |loss - ln(vocab)| at init: small random weights give near-uniform logits (measured within 0.02)
SAME_MODEL_RTOL = 1e-5  # float32, same weights and batch: torchax vs PyTorch eager (measured 7.6e-8)
NUMBERS = ("tokens_per_s", "ms_per_step", "ms_per_step_min", "first_step_s", "peak_mem_gb")

pytestmark = pytest.mark.slow


def has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def run_tiny(script: str, tmp_path: Path) -> dict:
    out = tmp_path / "result.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--tiny", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "| implementation |" in proc.stdout  # the markdown table
    return json.loads(out.read_text())


def rows_by_side(result: dict) -> dict[str, dict]:
    assert result["complete"]
    return {r["side"]: r for r in result["rows"]}


def check_numbers(row: dict) -> None:
    for k in NUMBERS:
        assert isinstance(row[k], float) and math.isfinite(row[k]) and row[k] > 0, (k, row[k])
    assert all(math.isfinite(x) for x in row["losses"]) and len(row["losses"]) == 3  # first + 0 warm-up + 2 timed


def check_compiled_once(row: dict) -> None:
    """jax: the train step compiled in the first step, and nothing compiled after it."""
    assert row["step_compiles_first_step"] == 1 and row["compiles_after_first_step"] == 0, row
    assert row["xla_compile_s"] > 0 and row["first_step_s"] >= row["xla_compile_s"]


def test_gpt2_pretrain_tiny(tmp_path):
    result = run_tiny("gpt2_pretrain.py", tmp_path)
    rows = rows_by_side(result)
    vocab = result["shape"]["vocab"]
    assert result["batch"] == 2 and result["batch_search"]["tries"] == [{"batch": 2, "fits": True}]
    assert result["tokens_per_step"] == 2 * result["shape"]["seq"]

    jx = rows["jaxtune"]
    check_numbers(jx)
    check_compiled_once(jx)
    assert abs(jx["loss_first"] - math.log(vocab)) < LN_TOL
    assert jx["flops_per_token"] > 0 and jx["peak_flops"] is None and jx["mfu"] is None  # CPU: no peak, no MFU
    assert "omitted" in result["mfu_note"]

    pt = rows["pytorch"]
    if not has("torch"):
        assert pt["skipped"] == "torch is not installed"
        return
    check_numbers(pt)
    assert abs(pt["loss_first"] - math.log(vocab)) < LN_TOL
    compiled = pt["torch_compile"]  # Dynamo captured the model once and did not recompile
    assert compiled["first_step"]["graphs"] >= 1 and compiled["end"] == compiled["first_step"]
    assert compiled["end"]["recompiles"] == 0


def test_lora_gemma3_tiny(tmp_path):
    result = run_tiny("lora_gemma3_1b.py", tmp_path)
    rows = rows_by_side(result)
    from jaxtune.models.gemma3 import PRESETS

    c = PRESETS["tiny"]()
    q, kv, rank = c.n_head * c.hd, c.kv_heads * c.hd, result["args"]["rank"]
    dims = [(c.d_model, q), (c.d_model, kv), (c.d_model, kv), (q, c.d_model), (c.d_model, c.d_ff),
            (c.d_model, c.d_ff), (c.d_ff, c.d_model)]  # q k v o gate up down: (in, out)
    adapters = c.n_layer * sum(rank * (i + o) for i, o in dims)

    native = rows["jaxtune"]
    check_numbers(native)
    check_compiled_once(native)
    assert native["trainable_params"] == adapters
    assert abs(native["loss_first"] - math.log(c.vocab_size)) < LN_TOL

    hf, tx = rows["hf-peft"], rows["torchax"]
    if not has("torch", "transformers", "peft"):
        assert "not installed" in hf["skipped"] and "not installed" in tx["skipped"]
        return
    check_numbers(hf)
    assert hf["trainable_params"] == adapters  # PEFT's adapters on the same seven projections
    assert abs(hf["loss_first"] - math.log(c.vocab_size)) < LN_TOL
    if not has("torchax"):
        assert tx["skipped"] == "torchax is not installed"
        return
    check_numbers(tx)
    check_compiled_once(tx)
    assert tx["trainable_params"] == adapters
    assert result["same_trainable_params"]
    assert result["torchax_vs_hf_loss_rel"] <= SAME_MODEL_RTOL  # every step: forward, LoRA gradients, AdamW


def test_unknown_side_is_an_error_naming_the_sides():
    proc = subprocess.run([sys.executable, str(SCRIPTS / "lora_gemma3_1b.py"), "--tiny", "--sides", "peft"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "choose from jaxtune,hf-peft,torchax" in proc.stderr, proc.stderr
