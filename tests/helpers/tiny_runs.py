"""What the end-to-end tests of the objectives trained on completions share (test_preference_train.py,
test_grpo_train.py, test_lagged.py): the tiny Llama they train, a maker of a run's overrides, GRPO's tiny run on
arithmetic prompts, the same run on the torchax backend, and the check that a killed run resumes bitwise."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers.processes import run_driver, start_driver, wait
from helpers.rows import write_jsonl
from helpers.run_outputs import final_params, losses
from helpers.tiny_config import TORCHAX_LLAMA
from jaxtune.config import Config, load_config
from jaxtune.data import load_tokenizer
from jaxtune.data.synthetic import arithmetic_prompts
from jaxtune.job.checkpoint import Checkpointer
from jaxtune.loop import train

MODEL = ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
         "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=64"]


def run_overrides(rest: list[str], source: Path, tmp_path: Path, data_cache: Path) -> Callable[..., list[str]]:
    """make(*extra, run="run") -> overrides of a tiny native run (MODEL, ``rest``, then ``extra``) on ``source``,
    its run_dir ``tmp_path / run``."""

    def make(*extra: str, run: str = "run") -> list[str]:
        return [*MODEL, *rest, f"data.sources=[{source}]", f"data.cache_dir={data_cache}",
                f"run_dir={tmp_path / run}", *extra]

    return make


def torchax_lora_config(overrides: list[str], tmp_path: Path) -> Config:
    """The run of ``overrides`` on the torchax backend: a LlamaForCausalLM of `TORCHAX_LLAMA`'s shape (the
    BPE's 300 ids), LoRA rank 4, instead of the native model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")  # torchax itself is imported through jaxtune's compatibility shim
    directory = tmp_path / "hf-llama-config"
    transformers.LlamaConfig(**{**TORCHAX_LLAMA, "vocab_size": 300}).save_pretrained(directory)
    over = [o for o in overrides if not o.startswith("model.")]
    return load_config(None, [*over, "model.backend=torchax", f"model.hf_config={directory}", "model.lora.rank=4"])


def assert_kill9_resume_is_bitwise(tmp_path: Path, make: Callable[..., list[str]], overrides: list[str], steps: int,
                                   kill_at: int, commit: int) -> None:
    """The run of ``make(*overrides)`` (``steps`` steps) uninterrupted, then killed (kill -9) once step ``kill_at``
    is logged with step ``commit`` committed, and resumed: one train-step compile, the resumed run's losses from
    step ``commit`` + 1 on and its final parameters equal the uninterrupted run's bitwise. The uninterrupted run
    trains in this process while the killed one runs in its own (the data cache is built first, once); the resumed
    process loads what the killed one compiled from a persistent XLA cache."""
    ref_cfg = load_config(None, make(*overrides, run="ref"))
    load_tokenizer(ref_cfg.tokenizer, ref_cfg.data)  # trained and cached once, before two processes want it
    over = make(*overrides, run="killed")
    cache = tmp_path / "xla-cache"
    killing = start_driver(tmp_path, "kill", kill_at, over, commit=commit, compile_cache=cache)
    try:
        ref = train(ref_cfg)
        ref_params, _ = final_params(ref_cfg, steps)
    finally:
        killed = wait(killing)
    assert ref.step_compiles == len(ref.step_lengths)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    cfg = load_config(None, over)
    assert Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint).latest_step() == commit
    resumed = run_driver(tmp_path, "plain", 0, over, compile_cache=cache)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    resumed_losses = losses(cfg.run_path)
    for s in range(commit + 1, steps + 1):
        assert resumed_losses[s] == ref.losses[s], (s, resumed_losses[s], ref.losses[s])
    params, _ = final_params(cfg, steps)
    jax.tree.map(np.testing.assert_array_equal, params, ref_params)


# Rewards that vary on a random model: the length penalty (completions run to 16 tokens) and a digit count.
GRPO_REST = ["data.format=prompts", "data.chat_template=chatml", "data.seq_len=48", "data.val_fraction=0.1",
             "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
             "objective.name=grpo", "objective.num_generations=4", "objective.max_completion_length=16",
             "objective.rewards=[{name: exact_number, field: answer}, {name: length, max_tokens: 12, buffer: 8}]",
             "optim.lr=1e-2", "optim.warmup_steps=0", "optim.schedule=constant", "objective.prompts_per_step=4",
             "train.steps=4",
             "eval.every=2", "eval.exact_match=8", "checkpoint.every=2", "logging.every=1", "logging.progress=false",
             "logging.tensorboard=false"]


def arithmetic_prompts_file(directory: Path, n: int = 200) -> Path:
    """The first ``n`` generated arithmetic prompts (`synthetic:arithmetic-prompts`) as ``directory``/prompts.jsonl."""
    return write_jsonl(directory / "prompts.jsonl", itertools.islice(arithmetic_prompts(), n))
