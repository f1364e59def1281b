"""Training from a HuggingFace checkpoint (model.from_hf), chunked cross-entropy, and the export/parity commands."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxtune.backends.native import NativeForward
from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.data import load_tokenizer
from jaxtune.loop import train
from jaxtune.models import build_model, from_hf
from jaxtune.models.gemma3 import PRESETS as GEMMA3
from jaxtune.run import load_run
from jaxtune.train.logprobs import chunked_token_logps, loss_chunk_size
from jaxtune.train.objectives import CrossEntropy

DATA = ["data.sources=[python-stdlib]", "data.max_bytes=300000", "data.seq_len=32", "data.val_fraction=0.05",
        "optim.lr=1e-3", "train.steps=4", "train.batch_size=4", "eval.batches=1", "checkpoint.every=2",
        "logging.progress=false", "logging.tensorboard=false"]
TOKENIZER = ["tokenizer.kind=bpe", "tokenizer.vocab_size=512", "tokenizer.train_bytes=300000"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory, data_cache):
    """A tiny random Llama checkpoint with the (BPE) tokenizer the tests' corpus trains, saved together."""
    d = tmp_path_factory.mktemp("hf-llama")
    cfg = load_config(None, DATA + TOKENIZER + [f"data.cache_dir={data_cache}"])
    tok = load_tokenizer(cfg.tokenizer, cfg.data)
    torch.manual_seed(0)
    c = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False, eos_token_id=tok.eos_id, bos_token_id=tok.eos_id)
    transformers.LlamaForCausalLM(c).save_pretrained(d)
    tok.save(d)
    return d


def test_chunked_loss_equals_plain_loss():
    """Chunked cross-entropy (4 chunks of 8 positions) equals the plain loss and its gradients (<=1e-6 rel)."""
    cfg = GEMMA3["tiny"]()
    model = build_model(cfg, 0)
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    batch = {"inputs": jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 32)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 32)), jnp.int32),
             "loss_mask": jnp.asarray(rng.random((2, 32)) > 0.2, jnp.float32)}

    def value_and_grads(chunk):
        forward = NativeForward(graphdef, cfg.vocab_size, chunk)
        return jax.jit(jax.value_and_grad(lambda p: CrossEntropy()(forward, p, batch, None)[0]))(params)

    (plain, g_plain), (chunked, g_chunked) = value_and_grads(32), value_and_grads(8)
    assert abs(float(chunked) - float(plain)) <= 1e-6 * abs(float(plain))
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_chunked)):
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-6 * max(np.abs(np.asarray(a)).max(), 1e-6)


def test_chunked_loss_never_materialises_full_logits():
    """The compiled chunked loss (value and gradient) holds a few chunks of logits at a time (<= 3 chunks of
    temporaries), where the plain loss holds the whole (B, T, V) float32 logits."""
    b, t, d, v, chunk = 2, 512, 16, 32768, 64
    h = jnp.ones((b, t, d), jnp.float32)
    w = jnp.ones((d, v), jnp.float32) * 0.01
    tgt = jnp.zeros((b, t), jnp.int32)
    ones = jnp.ones((b, t), jnp.float32)

    def temp_bytes(c):
        fn = jax.jit(jax.grad(lambda w: -jnp.sum(chunked_token_logps(lambda x: x @ w, h, tgt, c) * ones)))
        return fn.lower(w).compile().memory_analysis().temp_size_in_bytes

    full, per_chunk = b * t * v * 4, b * chunk * v * 4
    assert temp_bytes(t) >= full
    assert temp_bytes(chunk) <= 3 * per_chunk
    assert loss_chunk_size(8, 2048, 262144) < 2048  # Gemma's vocabulary at a long batch chunks by default
    assert loss_chunk_size(8, 256, 8192) == 256  # a small model does not
    # the budgets are a device's: 32k positions of Qwen's vocabulary split 8 ways by the context axis chunk 8 times
    # as many positions at once (each chunk spread over the 8), and rows split over data x fsdp count once a device
    assert loss_chunk_size(1, 32768, 151936) == 256 and loss_chunk_size(1, 32768, 151936, split=(1, 8, 1)) == 2048
    assert loss_chunk_size(8, 2048, 262144, split=(8, 1, 1)) == loss_chunk_size(1, 2048, 262144)
    assert loss_chunk_size(16, 64, 262144, split=(16, 1, 2)) == 64  # a device's share fits whole


def test_train_from_hf_checkpoint_and_export(hf_llama, tmp_path, data_cache):
    """model.from_hf starts from the checkpoint's weights (bitwise) with its tokenizer; the run trains, and
    `jaxtune export` writes a model transformers loads with our logits (<=1e-5 rel) and the run's EOS."""
    overrides = DATA + [f"model.from_hf={hf_llama}", f"run_dir={tmp_path / 'run'}", f"data.cache_dir={data_cache}"]
    cfg = load_config(None, overrides)
    assert cfg.tokenizer.kind == "hf" and cfg.tokenizer.path == str(hf_llama)
    config_file = tmp_path / "cfg.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    start = load_run(config_file)  # no checkpoint yet: the initial state
    ref = nnx.to_pure_dict(nnx.state(from_hf(hf_llama, param_dtype="float32"), nnx.Param))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(start.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    result = train(cfg)
    assert result.step == 4 and all(np.isfinite(list(result.losses.values())))
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2  # never overwrites silently
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = np.asarray([tok.encode("def main():\n    return 0\n")])
    run = load_run(tmp_path / "run")
    ours = np.asarray(nnx.merge(run.spec.graphdef, run.params)(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    # pretraining, not chat: the model and the tokenizer keep the run's one EOS
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == run.tokenizer.eos_id
    assert hf.config.eos_token_id == tok.eos_token_id == run.tokenizer.eos_id


def test_from_hf_refuses_shape_overrides(hf_llama):
    from jaxtune.config import ConfigError
    from jaxtune.models import model_config

    cfg = load_config(None, [f"model.from_hf={hf_llama}", "model.n_layer=4"])
    with pytest.raises(ConfigError, match="model.n_layer cannot be set with model.from_hf"):
        model_config(cfg.model)


def test_parity_command(hf_llama, capsys):
    """`jaxtune parity` passes on a faithful checkpoint and fails (exit 1) when the tolerance is impossible."""
    assert main(["parity", str(hf_llama), "--new-tokens", "8", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "greedy agreement:       8/8, 8/8" in out and "tokenized sample text" in out
    assert main(["parity", str(hf_llama), "--new-tokens", "0", "--seq", "16", "--tolerance", "0"]) == 1


@pytest.mark.parametrize(("ours", "theirs", "expected"), [
    # transformers stopped at EOS (2) after 3 tokens, ours emitted the same EOS and went on: they agree (the bug was
    # scoring the length difference as disagreement)
    ([5, 6, 2, 7, 8], [5, 6, 2], (3, 3, "both stopped at EOS after 3")),
    # transformers stopped at EOS where ours emits another token: a disagreement at that position
    ([5, 6, 9, 7], [5, 6, 2], (2, 3, "transformers stopped at EOS after 3")),
    ([5, 6, 9, 2], [5, 6, 9, 4], (3, 4, "ours stopped at EOS after 4")),
    ([5, 6, 9, 4], [5, 6, 9, 4], (4, 4, "")),  # neither stopped: all compared
])
def test_greedy_agreement_compares_up_to_the_first_eos_of_either_side(ours, theirs, expected):
    from jaxtune.parity import Comparison, ParityReport, greedy_agreement

    assert greedy_agreement(ours, theirs, {2}) == expected
    agree, compared, stop = expected
    report = ParityReport("llama", [Comparison("native", 0.0, 0.0, [agree], [compared], [stop])], new_tokens=5)
    assert report.ok == (agree == compared)
    assert f"greedy agreement:       {agree}/{compared}" in report.format()


def test_pretrained_gpt2_run_exports_to_transformers(tiny_cfg, tmp_path):
    """A GPT-2 pretrained from scratch (our BPE, scanned layers) exports to a directory that transformers loads
    (model and tokenizer) with our logits (<=1e-5 rel); bf16 export halves the weights."""
    cfg = tiny_cfg("train.steps=2", "model.scan_layers=true")
    train(cfg)
    out = tmp_path / "gpt2-export"
    assert main(["export", str(cfg.run_path), str(out)]) == 0
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(hf).__name__ == "GPT2LMHeadModel" and not info["missing_keys"]
    ids = np.asarray([transformers.AutoTokenizer.from_pretrained(out).encode("import os\nprint(os.getcwd())")])
    run = load_run(cfg.run_path)
    ours = np.asarray(nnx.merge(run.spec.graphdef, run.params)(jnp.asarray(ids)))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    assert main(["export", str(cfg.run_path), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    size = lambda d: (d / "model.safetensors").stat().st_size
    assert size(tmp_path / "bf16") < 0.55 * size(out)
