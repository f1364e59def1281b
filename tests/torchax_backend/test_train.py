"""The torchax backend through the whole trainer: train/eval/generate/resume/export, LoRA through PEFT on an
architecture jaxtune has no native model for (Phi-3), sharding over 8 devices, remat, mixed precision, and the
config errors. (Loss/gradient parity with PyTorch eager per family: test_torchax.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.compare import rel
from helpers.export_padding import assert_pads_as_config
from helpers.processes import beside
from helpers.tiny_hf import peft_reload

from jaxtune.config import ConfigError, load_config
from jaxtune.loop import train

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOL = 1e-5  # relative: max|a - b| / max|b|


def _torchax_logits(run, tokens):
    """The trained model's logits, as the torchax backend computes them (what training optimised)."""
    return np.asarray(jax.jit(run.spec.model.logits)(run.weights, jnp.asarray(tokens)))


def test_trains_evaluates_resumes_and_exports(torchax_overrides, tmp_path):
    """Compile once, learn, eval + samples, resume with one more compile only, then a merged export that
    transformers reloads with tied weights still tied and the same logits."""
    from jaxtune.export import export
    from jaxtune.run import load_run

    cfg = load_config(None, torchax_overrides + ["train.steps=10", "eval.prompts=['def f(x):']",
                                                 "eval.max_new_tokens=6"])
    result = train(cfg)
    assert result.step == 10 and result.step_compiles == len(result.step_lengths)
    assert result.losses[10] < result.losses[1] - 0.3  # it learns
    assert result.eval_loss is not None and np.isfinite(result.eval_loss)
    assert result.samples and result.samples[0].startswith("def f(x):")
    assert (cfg.run_path / "report.md").is_file()

    more = train(load_config(None, torchax_overrides + ["train.steps=15", "eval.prompts=['def f(x):']",
                                                        "eval.max_new_tokens=6"]))
    assert sorted(more.losses) == list(range(11, 16)) and more.step_compiles == len(more.step_lengths)

    out = export(cfg.run_path, tmp_path / "export")
    assert_pads_as_config(out)  # no pad id of its own: its EOS, in config.json and the tokenizer
    run = load_run(cfg.run_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # still tied
    assert sum(p.numel() for p in hf.parameters()) == run.spec.model_cfg.num_params()
    tokens = np.random.default_rng(0).integers(0, 512, (2, 24)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert rel(_torchax_logits(run, tokens), ref) <= TOL


@pytest.fixture
def phi3_dir(tmp_path):
    """A tiny random Phi-3 checkpoint (fused qkv_proj / gate_up_proj: no native jaxtune model)."""
    torch.manual_seed(0)
    cfg = transformers.Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    directory = tmp_path / "phi3"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory, safe_serialization=True)
    return directory


def test_phi3_lora_exports_a_peft_adapter_peft_reloads(phi3_dir, tiny_overrides, tmp_path):
    from jaxtune.export import export
    from jaxtune.models.hf import read_hf_config
    from jaxtune.models.unsupported import UnsupportedModelError
    from jaxtune.run import load_run

    with pytest.raises(UnsupportedModelError):
        read_hf_config(phi3_dir)  # really not a native family
    over = [o for o in tiny_overrides if not o.startswith("model.")] + [
        "model.backend=torchax", f"model.from_hf={phi3_dir}", "model.lora.rank=4", "model.lora.alpha=8",
        "model.lora.targets=[qkv_proj, o_proj, gate_up_proj, down_proj]", "optim.lr=1e-2", "train.steps=8"]
    cfg = load_config(None, over)
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths) and result.losses[8] < result.losses[1]
    run = load_run(cfg.run_path)
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(run.params)]
    assert names and all("lora_A" in n or "lora_B" in n for n in names)  # only adapters train and are saved
    assert any(float(jnp.abs(b).max()) > 0 for p, b in jax.tree_util.tree_leaves_with_path(run.params)
               if "lora_B" in jax.tree_util.keystr(p))  # B moved off its zero init

    tokens = np.random.default_rng(1).integers(0, 512, (2, 24)).astype(np.int32)
    ours = _torchax_logits(run, tokens)
    adapter = export(cfg.run_path, tmp_path / "adapter", adapter=True)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    base = transformers.AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32)
    reloaded = peft_reload(base, adapter)
    with torch.no_grad():
        theirs = reloaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert rel(ours, theirs) <= TOL

    merged = export(cfg.run_path, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in hf.named_parameters())
    with torch.no_grad():
        assert rel(hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy(), theirs) <= TOL

    # `jaxtune eval` on the exported directory picks the torchax backend itself (Phi-3 has no native model).
    from jaxtune.evaluate import evaluate

    res = evaluate(merged, overrides=[o for o in over if o.startswith("data.")], batches=1)
    assert np.isfinite(res["loss"]) and res["tokens"] > 0


def test_chat_lora_exports_stop_at_the_end_of_turn(tmp_path):
    """A LoRA run on the torchax backend trained 2 steps on ChatML conversations: its merged export and its PEFT
    adapter, loaded by transformers, stop at <|im_end|> (`helpers.chat_stops`), as the native backend's do."""
    from helpers.chat_stops import assert_stops_at_end_of_turn
    from helpers.rows import write_jsonl
    from helpers.tiny_hf import TEXTS, tiny_llama

    from jaxtune.export import export

    turns = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
             for t in TEXTS[:2]]
    cfg = load_config(None, [
        "model.backend=torchax", f"model.from_hf={tiny_llama(tmp_path / 'llama')}", "model.lora.rank=4",
        "data.format=messages", f"data.sources=[{write_jsonl(tmp_path / 'chat.jsonl', turns * 8)}]",
        f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64", "data.val_fraction=0", "train.steps=2",
        "train.batch_size=2", "eval.every=0", "checkpoint.every=2", "logging.progress=false",
        "logging.tensorboard=false", f"run_dir={tmp_path / 'run'}"])
    train(cfg)
    assert_stops_at_end_of_turn(export(cfg.run_path, tmp_path / "merged"))
    assert_stops_at_end_of_turn(export(cfg.run_path, tmp_path / "adapter", adapter=True), adapter=True)


def test_unknown_lora_target_names_the_model_modules(phi3_dir, tiny_overrides):
    over = [o for o in tiny_overrides if not o.startswith("model.")] + [
        "model.backend=torchax", f"model.from_hf={phi3_dir}", "model.lora.rank=4", "model.lora.targets=[q_proj]"]
    with pytest.raises(ConfigError, match="qkv_proj"):
        train(load_config(None, over))


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from jaxtune.config import load_config
    from jaxtune.loop import train

    assert jax.device_count() == 8
    layouts, base = json.loads(sys.argv[1]), sys.argv[2:]
    out = {}
    for name, (d, f) in layouts.items():
        run_dir = next(o for o in base if o.startswith("run_dir=")) + "-" + name
        result = train(load_config(None, base + [run_dir, f"mesh.data={d}", f"mesh.fsdp={f}"]))
        out[name] = {"losses": {str(k): v for k, v in result.losses.items()}, "compiles": result.step_compiles}
    print("RESULT" + json.dumps(out))
    """
)


def test_sharded_layouts_match_single_device(torchax_overrides):
    """Data parallel and FSDP-by-shape on 8 simulated devices give the 1-device losses (1e-5), compiled once;
    under fsdp=8 every large parameter and its Adam moments hold 1/8 per device."""
    from jaxtune.backends.torchax.model import fsdp_axes
    from jaxtune.data import load_tokenizer, prepare_tokens

    base = torchax_overrides + ["train.steps=6", "checkpoint.every=100"]
    cfg = load_config(None, base)
    prepare_tokens(cfg.data, load_tokenizer(cfg.tokenizer, cfg.data))  # built once, before two processes read it
    layouts = {"data8": (8, 1), "fsdp8": (1, 8), "data2_fsdp4": (2, 4)}
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, json.dumps(layouts), *base], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    single, out = beside(proc, lambda: train(cfg))  # the one-device reference while the 8-device one runs
    for name, r in out.items():
        assert r["compiles"] == 1, name
        for step, loss in r["losses"].items():
            ref = single.losses[int(step)]
            assert abs(loss - ref) <= 1e-5 * abs(ref), (name, step, loss, ref)
    # The shape rule: the largest dimension that divides, else replicated.
    assert fsdp_axes((512, 64), 8) == ("fsdp", None) and fsdp_axes((64, 128), 8) == (None, "fsdp")
    assert fsdp_axes((64,), 8) == (None,) and fsdp_axes((6, 10), 8) == (None, None)


def test_fsdp_shards_parameters_and_moments(torchax_overrides):
    """Placement, not just equal losses: with fsdp=8 each device holds 1/8 of every matrix and its moments."""
    code = textwrap.dedent(
        """
        import sys
        import jax
        from jaxtune.config import load_config
        from jaxtune.sharding import make_mesh
        from jaxtune.backends import make_state_spec
        cfg = load_config(None, sys.argv[1:] + ["mesh.data=1", "mesh.fsdp=8"])
        spec = make_state_spec(cfg, 512, make_mesh(1, 8, 1))
        state = spec.init(0)
        bad = [(jax.tree_util.keystr(p), x.shape) for p, x in jax.tree_util.tree_leaves_with_path(
               (state.params, state.opt_state)) if x.ndim == 2 and x.addressable_shards[0].data.size * 8 != x.size]
        print("BAD", bad)
        """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, *torchax_overrides], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "BAD []" in proc.stdout, proc.stdout[-2000:]


def _hf_config(overrides: list[str]) -> str:
    return next(o for o in overrides if o.startswith("model.hf_config=")).split("=", 1)[1]


def _model(hf_config: str, **kw):
    from jaxtune.backends.torchax.model import TorchaxModel, build_torch_model
    from jaxtune.config import TorchaxModelConfig

    mc = TorchaxModelConfig(hf_config=hf_config, **kw)
    return TorchaxModel(build_torch_model(mc, 0), remat=mc.remat, compute_dtype=mc.compute_dtype)


def _loss_and_grads(model, tokens, frozen=()):
    from jaxtune.backends.torchax.model import merge_weights

    def loss(p):
        lg = model.logits(merge_weights(p, frozen), tokens)[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), tokens[:, 1:, None], -1))

    params = model.initial()[0]
    return jax.value_and_grad(loss), params


def test_remat_is_applied_and_changes_nothing_numerically(torchax_overrides, capsys):
    """model.remat=full wraps every block in jax.checkpoint (the jaxpr has one checkpoint per layer) and gives
    the same loss and gradients as no remat (1e-6); so does model.remat=offload, which keeps each block's input (its
    hidden states, not the mask or rotary tables all blocks share) in host memory."""
    hf_config = _hf_config(torchax_overrides)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 32)).astype(np.int32))
    out = {}
    for remat in ("none", "full", "offload"):
        fn, params = _loss_and_grads(_model(hf_config, remat=remat), tokens)
        out[remat] = (jax.jit(fn)(params), str(jax.make_jaxpr(fn)(params)))
    remat = re.compile(r"\b(?:remat2?|checkpoint)\[")  # the primitive's name differs across JAX versions
    assert len(remat.findall(out["full"][1])) == 2 and not remat.findall(out["none"][1])
    from jaxtune.backends.torchax.model import merge_weights

    model = _model(hf_config, remat="offload")
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(lambda p: model.logits(merge_weights(p, ()), tokens).sum(),
                                            model.initial()[0])
    on_host = [line for line in capsys.readouterr().out.splitlines() if "<host>" in line]
    assert len(on_host) == 2 and all("f32<host>[2,32,64]" in line for line in on_host), on_host  # a block's input
    (l0, g0) = out["none"][0]
    for kind in ("full", "offload"):
        l1, g1 = out[kind][0]
        assert rel(l1, l0) <= 1e-6
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(jnp.abs(b).max())),
                     g1, g0)


def test_bf16_compute_and_bf16_frozen_base(torchax_overrides):
    """compute_dtype=bfloat16 runs the forward in bf16 (logits differ from float32 by bf16 rounding, not more),
    gradients come back float32 for the float32 master weights; a LoRA base held in bf16 trains its adapters."""
    hf_config = _hf_config(torchax_overrides)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 32)).astype(np.int32))
    fn32, p = _loss_and_grads(_model(hf_config), tokens)
    fn16, _ = _loss_and_grads(_model(hf_config, compute_dtype="bfloat16"), tokens)
    (l32, _), (l16, g16) = jax.jit(fn32)(p), jax.jit(fn16)(p)
    assert 0 < abs(float(l16) - float(l32)) <= 2e-2 * float(l32)  # really bf16, and close
    assert {x.dtype for x in jax.tree.leaves(g16)} == {jnp.dtype("float32")}
    lora = _model(hf_config, compute_dtype="bfloat16", param_dtype="bfloat16", lora={"rank": 4})
    adapters, base = lora.initial("bfloat16")
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype("float32")}
    fn, _ = _loss_and_grads(lora, tokens, (base,))
    loss, grads = jax.jit(fn)(adapters)
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of model.from_hf"):
        load_config(None, ["model.backend=torchax"])
    with pytest.raises(ConfigError, match="model.n_layer does not apply"):
        load_config(None, ["model.backend=torchax", "model.hf_config=x", "model.n_layer=2"])
    with pytest.raises(ConfigError, match="mesh.tensor must be 1"):
        train(load_config(None, ["model.backend=torchax", "model.hf_config=x", "mesh.tensor=2"]))
    with pytest.raises(ConfigError, match="model.hf_config is for model.backend=torchax"):
        load_config(None, ["model.hf_config=x"])
    cfg = load_config(None, ["model.backend=torchax", f"model.hf_config={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="no such config.json"):
        train(cfg)


def test_dropout_draws_from_the_step_key(torchax_overrides, tmp_path):
    """LoRA dropout under torchax is drawn from the step's key: two runs are bitwise equal, and differ from no
    dropout."""
    # data.val_fraction=0: no held-out windows, so no evaluation (and no eval step to compile) in these runs.
    losses = [train(load_config(None, torchax_overrides + [f"run_dir={tmp_path / f'd{i}'}", "model.lora.rank=4",
                                                           f"model.lora.dropout={d}", "train.steps=3",
                                                           "data.val_fraction=0"])).losses
              for i, d in enumerate((0.0, 0.3, 0.3))]
    assert losses[1] == losses[2] and losses[1] != losses[0]


def test_parity_command_with_the_torchax_backend(phi3_dir, tmp_path, capsys):
    """`jaxtune parity --backend torchax`: native vs torchax vs eager for a native family, torchax vs eager for
    one without a native model; the plain command still refuses the latter by name."""
    from jaxtune.cli import main

    torch.manual_seed(0)
    llama = tmp_path / "llama"
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(llama)
    assert main(["parity", str(llama), "--backend", "torchax", "--new-tokens", "4", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "[native vs transformers eager]" in out and "[torchax vs transformers eager]" in out and "PASS" in out
    assert main(["parity", str(phi3_dir), "--backend", "torchax", "--new-tokens", "4", "--seq", "16"]) == 0
    out = capsys.readouterr().out
    assert "[native" not in out and "[torchax vs transformers eager]" in out and "phi3" in out
    assert main(["parity", str(phi3_dir), "--new-tokens", "0", "--seq", "16"]) != 0
    assert "torchax" in capsys.readouterr().err
