"""Context parallelism (``mesh.context``, issue 47) on 8 simulated CPU devices: each sequence's positions are split
across devices, and every family's logits and gradients, full and LoRA, over packed rows, equal the unsharded ones;
pretraining, packed SFT, DPO, KTO, GRPO and GKD runs give the single-device losses; a checkpoint written with the axis
restores without it and the other way round, bitwise; the axis really divides what a device holds.

Tolerances (float32): logits 1e-5 absolute (they are O(1)), gradients 1e-5 of each leaf's largest entry, losses
1e-5 relative. Sharded contractions add partial sums in another order; the data-, fsdp- and tensor-parallel layouts
differ from one device by as much (test_sharding.py). LoRA's adapters are moved off their zero start by 0.05 x
N(0, 1): larger moves make the tiny model ill-conditioned and every layout, not only this axis, drifts to ~1e-4."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.processes import beside
from helpers.rows import write_jsonl
from helpers.tiny_config import QUICK, TINY
from helpers.tiny_runs import MODEL

from jaxtune.backends import backend_of
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_tokenizer, prepare_tokens
from jaxtune.data.synthetic import arithmetic_preferences, arithmetic_prompts
from jaxtune.loop import train

ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")

MODEL_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config

    assert jax.device_count() == 8, jax.devices()
    T = 64
    rng = np.random.default_rng(0)
    inputs = rng.integers(1, 256, (2, T)).astype(np.int32)
    segment_ids, positions = np.zeros((2, T), np.int32), np.zeros((2, T), np.int32)
    for r, cuts in enumerate([(0, 20, 41, T), (0, 33, T)]):  # packed rows: three documents, then two
        for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
            segment_ids[r, a:b], positions[r, a:b] = s + 1, np.arange(b - a)
    targets = np.roll(inputs, -1, 1)
    targets[:, -1] = -1
    batch = {"inputs": inputs, "targets": targets, "positions": positions, "segment_ids": segment_ids}

    def run(family, lora, shape, t=T, chunk=0):
        cfg = load_config(None, [f"model.family={family}", "model.preset=tiny", "model.n_layer=2",
                                 "model.d_model=64", "model.n_head=4", "model.vocab_size=256",
                                 f"model.max_seq_len={t}"]
                          + (["model.n_kv_head=2", "model.d_ff=128"] if family != "gpt2" else [])
                          + (["model.lora.rank=4"] if lora else []))
        d, f, tp, c = shape
        mesh = sharding.make_mesh(d, f, tp, jax.devices()[:d * f * tp * c], context=c)
        spec = make_state_spec(cfg, 256, mesh)
        params, frozen = spec.init(0).params, spec.load_frozen(0)
        if lora:  # B != 0, so the adapters change the logits and have gradients of their own
            moved = np.random.default_rng(1)
            params = jax.tree.map(lambda x: jax.device_put(np.asarray(x) + 0.05 * moved.standard_normal(x.shape)
                                                           .astype(np.float32), x.sharding), params)
        fwd = spec.forward(chunk)
        rows = batch if t == T else {"inputs": np.ones((1, t), np.int32), "targets": np.ones((1, t), np.int32)}
        b = jax.device_put(rows, sharding.batch_sharding(mesh))

        def loss(params, frozen, b):
            lp = fwd.token_logps(spec.weights(params, frozen), b)
            return -jnp.sum(jnp.where(b["targets"] >= 0, lp, 0.0)) / jnp.sum(b["targets"] >= 0)

        def both(params, frozen, b):  # LoRA: the gradients of the adapters and of every base weight, one program
            grads = jax.grad(loss, argnums=(0, 1) if lora else 0)(params, frozen, b)
            return fwd.logits(spec.weights(params, frozen), b), grads

        with sharding.use_mesh(mesh):
            compiled = jax.jit(both).lower(params, frozen, b).compile()
            logits, grads = compiled(params, frozen, b)
        return {"logits": np.asarray(logits).tolist(), "grads": [np.asarray(g).ravel().tolist()
                                                                 for g in jax.tree.leaves(grads)],
                "logits_spec": str(logits.sharding.spec), "temp": compiled.memory_analysis().temp_size_in_bytes}

    out = {}
    for family in ("gpt2", "llama", "qwen3", "mistral", "gemma3"):
        lora = family != "gpt2"
        shapes = [(1, 1, 1, 1), (2, 1, 1, 4)] + ([(1, 2, 1, 4), (1, 1, 2, 4)] if family == "llama" else [])
        for shape in shapes:
            out[f"{family}-{'lora' if lora else 'full'}-{'x'.join(map(str, shape))}"] = run(family, lora, shape)
    # log-probs 16 positions at a time (train.loss_chunk): each chunk spread over the context group; and the
    # attention scores of each device's 16 queries in 4 chunks of 4 (`layers.query_chunks`, budget lowered)
    from jaxtune.models import layers
    budget, smallest = layers.SCORES_BUDGET, layers.MIN_QUERY_CHUNK
    layers.SCORES_BUDGET, layers.MIN_QUERY_CHUNK = 4 * 64 * 4, 4
    assert layers.query_chunks(1, 16, 4, 64) == 4
    try:
        out["llama-chunked-2x1x1x4"] = run("llama", True, (2, 1, 1, 4), chunk=16)
    finally:
        layers.SCORES_BUDGET, layers.MIN_QUERY_CHUNK = budget, smallest
    # what one device holds: a 1024-token row's train-step temporaries, on one device and split 8 ways
    out["temp"] = {c: run("llama", False, (1, 1, 1, c), 1024)["temp"] for c in (1, 8)}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.slow
def test_every_family_full_and_lora_matches_one_device():
    """Logits and gradients of each family (gpt2, llama, qwen3, mistral, gemma3 with its sliding window), full and
    LoRA, over packed rows (segments, positions restarting), under data=2 x context=4 (and for llama fsdp=2 x
    context=4 and tensor=2 x context=4) equal one device's; the logits come back split along the sequence; a
    1024-token row's step needs under a third of one device's temporaries with the sequence split 8 ways. Full and
    LoRA are one program a layout: with adapters on (the decoder families), the gradients of the adapters and of
    every base weight (what full fine-tuning trains, sharded by the same rules) are taken together; GPT-2 is full. The
    loss's log-probs computed 16 positions at a time (`train.loss_chunk`), with each device's queries scored 4 at a
    time (`layers.query_chunks`), give the same logits and gradients under the axis."""
    proc = subprocess.run([sys.executable, "-c", MODEL_SCRIPT], capture_output=True, text=True, env=ENV,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    temp = out.pop("temp")
    assert temp["8"] * 3 < temp["1"], temp
    checked = 0
    for key, got in out.items():
        family, kind, shape = key.split("-")
        if shape == "1x1x1x1":
            continue
        one = out[f"{family}-{'lora' if kind == 'chunked' else kind}-1x1x1x1"]
        assert "context" in got["logits_spec"], (key, got["logits_spec"])
        assert np.abs(np.array(got["logits"]) - np.array(one["logits"])).max() <= 1e-5, key
        assert len(got["grads"]) == len(one["grads"]), key
        for a, b in zip(got["grads"], one["grads"], strict=True):
            a, b = np.array(a), np.array(b)
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), key
        checked += 1
    assert checked == 5 + 2 + 1  # 5 families; llama under two more layouts, and with chunked log-probs


# --- whole runs ------------------------------------------------------------------------------------------------------

TOK = ["tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
       "data.chat_template=chatml"]
COMMON = [*QUICK, "logging.every=1", "checkpoint.every=3", "checkpoint.keep=10"]
MESH = ["mesh.data=2", "mesh.context=4"]
REWARDS = "objective.rewards=[{name: exact_number, field: answer}, {name: length, max_tokens: 12, buffer: 8}]"

RUN_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jaxtune import sharding
    from jaxtune.backends import make_state_spec
    from jaxtune.config import load_config
    from jaxtune.loop import train
    from jaxtune.job.checkpoint import Checkpointer

    def _config(over):  # a recipe name first is the config file, the rest overrides
        return load_config(over[0], over[1:]) if "=" not in over[0] else load_config(None, over)

    assert jax.device_count() == 8, jax.devices()
    runs, out = json.loads(sys.argv[1]), {}
    for name, over in runs.items():
        result = train(_config(over))
        summary = json.loads((result.run_dir / "summary.json").read_text())
        out[name] = {"losses": {str(k): v for k, v in result.losses.items()}, "compiles": result.step_compiles,
                     "step": result.step, "whole": summary["context_whole_rows"]}

    def restored(cfg, step, mesh):
        ckpt = Checkpointer(cfg.run_path / "checkpoints", cfg.checkpoint)
        try:
            return ckpt.restore(step, make_state_spec(cfg, 300, mesh).abstract)[1]
        finally:
            ckpt.close()

    # written under data=2 x context=4; read back under that mesh, without the axis (data=8), and split 8 ways
    cfg = _config(runs["sft"])
    mine = restored(cfg, out["sft"]["step"], sharding.mesh_of(cfg.mesh))
    moved = {"data8": sharding.make_mesh(8, 1, 1), "context8": sharding.make_mesh(1, 1, 1, context=8)}
    out["restore"] = {}
    for name, mesh in moved.items():
        state = restored(cfg, out["sft"]["step"], mesh)
        same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), mine, state)
        out["restore"][name] = {"bitwise": all(jax.tree.leaves(same)),
                                "mesh": dict(jax.tree.leaves(state.params)[0].sharding.mesh.shape)}
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("context-data")
    return {"prompts": write_jsonl(root / "prompts.jsonl", itertools.islice(arithmetic_prompts(), 200)),
            "pairs": write_jsonl(root / "pairs.jsonl", itertools.islice(arithmetic_preferences(), 240))}


def _runs(tmp_path, data_cache, sources) -> dict[str, list[str]]:
    """Five tiny runs, each a few steps: pretraining GPT-2 windows, packed SFT (LoRA), DPO (LoRA), KTO (full, its
    KL rows too) and GRPO (full, with a KL reference; its sampler runs under the same mesh)."""
    cache = f"data.cache_dir={data_cache}"
    return {
        "pretrain": [*TINY, cache, *COMMON, "model.n_head=8", "train.steps=3"],
        "sft": ["finetune-quickstart", *MODEL, "model.lora.rank=4", cache, *COMMON, "data.seq_len=64",
                "train.batch_size=4", "train.steps=3", "eval.every=3", "eval.batches=1", "optim.warmup_steps=0"],
        "dpo": [*MODEL, *TOK, cache, *COMMON, f"data.sources=[{sources['pairs']}]", "data.format=preference",
                "data.seq_len=64", "data.val_fraction=0.1", "objective.name=dpo", "model.lora.rank=4",
                "optim.lr=1e-2", "train.batch_size=8", "train.steps=3", "eval.every=3", "eval.batches=1"],
        "kto": ["kto-quickstart", "model.from_hf=null", *MODEL, *TOK, cache, *COMMON, "data.seq_len=64",
                "data.length_buckets=0", "tokenizer.train_bytes=1000000", "optim.lr=1e-2", "optim.warmup_steps=0",
                "train.batch_size=8", "train.steps=3", "eval.every=3", "eval.batches=1"],
        "grpo": [*MODEL, *TOK, cache, *COMMON, f"data.sources=[{sources['prompts']}]", "data.format=prompts",
                 "data.seq_len=48", "data.val_fraction=0", "objective.name=grpo", "objective.num_generations=4",
                 "objective.max_completion_length=16", "objective.beta=0.04", "objective.prompts_per_step=4",
                 REWARDS, "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=3", "eval.every=0"],
    }


def _config(over: list[str]):
    """A run's config: a recipe name first is the config file, the rest overrides."""
    return load_config(over[0], over[1:]) if "=" not in over[0] else load_config(None, over)


@pytest.mark.slow
def test_runs_match_one_device_and_checkpoints_cross_meshes(tmp_path, data_cache, sources, capsys):
    """Each run under data=2 x context=4 gives the single-device run's losses (<= 1e-5 relative) with as many
    train-step compiles; the SFT run's checkpoint restores bitwise under data=8 and under context=8. A run trained on
    the 8 devices loads in this process's one (its mesh does not fit: said on stderr) and exports a model with its
    logits (1e-6)."""
    runs = _runs(tmp_path, data_cache, sources)
    for over in runs.values():  # tokenizers and token caches built once, before two processes read them
        cfg = _config(over)
        tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
        if cfg.data.format == "text":
            prepare_tokens(cfg.data, tokenizer)
    mine = {n: [*o, f"run_dir={tmp_path / ('ctx-' + n)}", *MESH] for n, o in runs.items()}
    proc = subprocess.Popen([sys.executable, "-c", RUN_SCRIPT, json.dumps(mine)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)

    def here():
        return {n: train(_config([*o, f"run_dir={tmp_path / ('one-' + n)}"])) for n, o in runs.items()}

    ref, out = beside(proc, here)
    for name, one in ref.items():
        got = out[name]
        assert sorted(int(s) for s in got["losses"]) == sorted(one.losses) != [], name
        for step, loss in got["losses"].items():
            assert abs(loss - one.losses[int(step)]) <= 1e-5 * abs(one.losses[int(step)]), (name, step)
        assert got["compiles"] == one.step_compiles, name
        whole, rows = got["whole"]  # the rows the axis left whole, of those stepped (said in summary.json)
        assert 0 <= whole <= rows and rows > 0, (name, got["whole"])
    for name, moved in out["restore"].items():
        assert moved["bitwise"], name
    assert out["restore"]["context8"]["mesh"]["context"] == 8 and out["restore"]["data8"]["mesh"]["context"] == 1
    import jax

    from jaxtune.cli import main
    from jaxtune.run import load_run

    assert jax.device_count() == 1
    capsys.readouterr()
    run = load_run(tmp_path / "ctx-pretrain")
    assert run.step == 3 and run.cfg.mesh.context == 1
    assert "does not fit the 1 device(s) here" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ctx-pretrain"), str(tmp_path / "pretrain-model")]) == 0
    model, batch = load_run(tmp_path / "pretrain-model"), {"inputs": np.arange(1, 17, dtype=np.int32)[None]}
    ours = np.asarray(run.spec.forward().logits(run.weights, batch))
    exported = np.asarray(model.spec.forward().logits(model.weights, batch))
    assert np.abs(exported - ours).max() <= 1e-6 * np.abs(ours).max()


def test_context_axis_limits_are_one_line(torchax_overrides):
    """The torchax backend refuses the axis before anything is built, naming the key; sizes are checked like the
    other axes'."""
    cfg = load_config(None, [*torchax_overrides, "mesh.context=2", "mesh.data=1"])
    with pytest.raises(ConfigError, match=r"mesh\.context must be 1 with model\.backend=torchax"):
        backend_of(cfg)
    with pytest.raises(ValueError, match="mesh axes are positive sizes"):
        load_config(None, ["mesh.context=0"])
