"""Shared fixtures: a tiny, fast training config over real text (the stdlib source), CPU-sized."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.config import Config, load_config

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

TINY = [
    "model.preset=tiny",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=64",
    "model.max_seq_len=64",
    "data.sources=[python-stdlib]",
    "data.max_bytes=300000",
    "data.seq_len=32",
    "data.val_fraction=0.05",
    "tokenizer.kind=bpe",
    "tokenizer.vocab_size=512",
    "tokenizer.train_bytes=300000",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "train.steps=20",
    "train.batch_size=8",
    "eval.batches=2",
    "checkpoint.every=5",
    "checkpoint.keep=10",
    "logging.every=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the session: tests share the tokenized corpus, not run state."""
    return tmp_path_factory.mktemp("jaxtune-cache")


def without_starting(stdout: str) -> str:
    """``stdout`` of `jaxtune train` without the line the CLI prints at once, before its imports
    (``jaxtune train CONFIG: starting``): what the run itself said."""
    return "".join(line for line in stdout.splitlines(keepends=True)
                   if not (line.startswith("jaxtune train ") and line.rstrip("\n").endswith(": starting")))


QUICK = ["eval.exact_match=0", "eval.prompts=[]", "logging.progress=false", "logging.tensorboard=false"]


@pytest.fixture(scope="session")
def quickstart_sft_model(tmp_path_factory, data_cache) -> Path:
    """The README's first steps of the DPO and GRPO quickstarts, shortened and done once for the session:
    `jaxtune train finetune-quickstart` (30 steps), then `jaxtune export` of it. The exported model directory."""
    from jaxtune.cli import main

    root = tmp_path_factory.mktemp("quickstart-sft")
    sft, model = root / "sft", root / "model"
    assert main(["train", "finetune-quickstart", f"run_dir={sft}", "train.steps=30", "eval.every=0",
                 "data.val_fraction=0", f"data.cache_dir={data_cache}", *QUICK]) == 0
    assert main(["export", str(sft), str(model)]) == 0
    return model


@pytest.fixture
def tiny_overrides(tmp_path, data_cache) -> list[str]:
    return TINY + [f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}"]


@pytest.fixture
def tiny_cfg(tiny_overrides):
    """tiny_cfg("train.steps=5", ...) -> a validated Config for a tiny run in this test's tmp dir."""

    def make(*extra: str) -> Config:
        return load_config(None, tiny_overrides + list(extra))

    return make


@pytest.fixture(scope="session")
def gpt_params():
    """gpt_params(cfg, seed=0) -> a GPT params tree (loop layout) of numpy noise, no compiles.

    LayerNorm scales are 1 + noise, every other tensor (biases included) is 0.02 * noise: nothing is a constant,
    so a swapped or transposed tensor shows up in any comparison.
    """
    from flax import nnx

    from jaxtune.models.gpt2 import GPT

    def make(cfg, seed: int = 0) -> dict:
        abstract = nnx.eval_shape(lambda: GPT(cfg.replace(scan_layers=False), rngs=nnx.Rngs(params=0)))
        rng = np.random.default_rng(seed)

        def fill(path, x):
            base = 1.0 if path[-1].key == "scale" else 0.0
            return jnp.asarray(base + 0.02 * rng.standard_normal(x.shape), x.dtype)

        return jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))

    return make


def _hf_gpt2_to_params(hf_model, n_layer: int) -> dict:
    """transformers GPT2LMHeadModel -> jaxtune params, through the real importer (save_pretrained + from_hf)."""
    import tempfile

    from flax import nnx

    from jaxtune.models import from_hf

    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        model = from_hf(d)
        assert model.cfg.n_layer == n_layer
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="session")
def hf_gpt2_to_params():
    """transformers GPT2LMHeadModel -> jaxtune GPT-2 params (loop layout)."""
    return _hf_gpt2_to_params


TORCHAX_LLAMA = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                 "tie_word_embeddings": True}


@pytest.fixture
def torchax_overrides(tiny_overrides, tmp_path) -> list[str]:
    """`tiny_overrides` for model.backend=torchax: a tiny random transformers Llama (its config.json) of the same
    size instead of the native model keys."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf-llama-config"
    transformers.LlamaConfig(**TORCHAX_LLAMA).save_pretrained(directory)
    return [o for o in tiny_overrides if not o.startswith("model.")] + ["model.backend=torchax",
                                                                       f"model.hf_config={directory}"]


CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_chatml_tokenizer(directory: Path, texts: list[str]) -> int:
    """A 300-id byte-level BPE trained on ``texts`` with the ChatML specials (ids 0, 1, 2), saved as a transformers
    tokenizer directory with the ChatML chat template; returns its vocabulary size."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxtune.data.chat import CHATML

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert [tok.token_to_id(s) for s in CHAT_SPECIALS] == [0, 1, 2]
    return tok.get_vocab_size()


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
