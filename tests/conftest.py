"""Shared fixtures: a tiny, fast training config over real text (the stdlib source), CPU-sized. What tests share
besides fixtures (constants, functions) is in tests/helpers/, which test modules import; not this file."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_config import QUICK, TINY, TORCHAX_LLAMA

from jaxtune.config import Config, load_config


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the session: tests share the tokenized corpus, not run state."""
    return tmp_path_factory.mktemp("jaxtune-cache")


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


@pytest.fixture(scope="session")
def agent_model(tmp_path_factory, data_cache) -> Path:
    """The agent recipe's first step, shortened and done once for the session: `jaxtune train agent-sft-quickstart`
    for 60 steps on the rows of synthetic:multiply-hasty that call the tool (so that it writes well-formed calls
    of the multiply tool in most of its samples, not yet with the right arguments), then `jaxtune export` of it.
    The exported model directory."""
    import itertools

    from helpers.rows import write_jsonl

    from jaxtune.cli import main
    from jaxtune.data.synthetic import multiply_hasty

    root = tmp_path_factory.mktemp("agent-sft")
    rows = write_jsonl(root / "calls.jsonl", (r for r in itertools.islice(multiply_hasty(), 3000)
                                              if len(r["messages"]) == 4))
    assert main(["train", "agent-sft-quickstart", f"run_dir={root / 'sft'}", f"data.cache_dir={data_cache}",
                 f"data.sources=[{rows}]", "train.steps=60", "train.batch_size=8", "eval.every=0",
                 "data.val_fraction=0", "checkpoint.every=1000", *QUICK]) == 0
    assert main(["export", str(root / "sft"), str(root / "model")]) == 0
    return root / "model"


@pytest.fixture(scope="module")
def gguf_module_root(tmp_path_factory, request):
    """A directory of the test module's own, jaxtune's GGUF import cache in it (``JAXTUNE_GGUF_CACHE``, for the
    module's tests): its conversions are made (and checked) apart from other modules'."""
    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXTUNE_GGUF_CACHE", str(root / "cache"))
        yield root


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


@pytest.fixture
def torchax_overrides(tiny_overrides, tmp_path) -> list[str]:
    """`tiny_overrides` for model.backend=torchax: a tiny random transformers Llama (its config.json) of the same
    size instead of the native model keys."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path / "hf-llama-config"
    transformers.LlamaConfig(**TORCHAX_LLAMA).save_pretrained(directory)
    return [o for o in tiny_overrides if not o.startswith("model.")] + ["model.backend=torchax",
                                                                       f"model.hf_config={directory}"]
