"""Fine-tuning end to end: packed SFT rows, LoRA from a HuggingFace checkpoint, PEFT/merged export, resume, the
eval/generate commands and a short run on real chat data. Tiny models (d_model 64, 2 layers), CPU.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref| over the whole tensor. Tolerances:
  * packed row vs each conversation alone (summed loss):           rel <= 1e-6, token counts equal
  * packed vs alone (gradients, per parameter):                     rel <= 1e-5
  * other segments' logits when one segment's tokens change:        bitwise equal
  * a batch with no trained token:                                  loss 0, grads 0 (finite), params unchanged
  * merged export: untargeted tensors vs the original checkpoint:   bitwise equal
  * merged export: targeted weights vs W + (alpha/r) (A B)^T:       rel <= 1e-6
  * PEFT adapter on transformers vs our LoRA model (logits):        rel <= 1e-5
  * merged export reloaded by transformers vs the PEFT model:       rel <= 1e-5
  * interrupted + resumed LoRA run vs an uninterrupted one:         losses and adapters bitwise equal
  * `jaxtune eval` of the merged export vs of the run:              rel <= 1e-4 on the loss
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from helpers.chat_stops import assert_stops_at_end_of_turn
from helpers.compare import rel
from helpers.export_padding import assert_pads_as_config, base_config_dir
from helpers.rows import write_jsonl
from helpers.shared_data import SHARED_DATA
from helpers.tiny_hf import peft_reload, save_chatml_tokenizer

from jaxtune.backends.native import NativeForward, NativeSpec
from jaxtune.cli import main
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_tokenizer
from jaxtune.data.encoded import Encoded, Examples, PackedRows
from jaxtune.io import SafetensorsFile
from jaxtune.loop import train
from jaxtune.models import model_config
from jaxtune.models.hf import HFCheckpoint, load_params
from jaxtune.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, write_adapter
from jaxtune.models.registry import FAMILIES, merge, model_layout
from jaxtune.run import load_run
from jaxtune.train.objectives import CrossEntropy
from jaxtune.train.state import init_state
from jaxtune.train.step import make_train_step, objective_loss

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CHAT_DATA = SHARED_DATA / "chat-en.jsonl"
HF_VOCAB = 320  # the checkpoints' vocabulary; the BPE below has 300 ids
# Our module paths -> the HF module names PEFT uses, per decoder layer.
HF_MODULES = {("attn", "q"): "self_attn.q_proj", ("attn", "k"): "self_attn.k_proj", ("attn", "v"): "self_attn.v_proj",
              ("attn", "o"): "self_attn.o_proj", ("mlp", "gate"): "mlp.gate_proj", ("mlp", "up"): "mlp.up_proj",
              ("mlp", "down"): "mlp.down_proj"}
# The LoRA run targets these (HF and native spellings mixed); k_proj and up_proj stay untouched.
TARGETS = "[q_proj,v,o,gate,down_proj]"
TARGETED = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


# --- packing: a packed row computes what its rows compute alone ------------------------------------------------------

VOCAB = 512
LENGTHS = (11, 17, 23)  # tokens per conversation: 10 + 16 + 22 = 48 positions, packed into 56 (8 of padding)
SEQ = 56


def _noise_params(abstract, seed: int) -> dict:
    """A params tree of numpy noise (norm scales 1 + noise, everything else 0.05 * noise): no init compile."""
    rng = np.random.default_rng(seed)

    def fill(path, a):
        base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(base + 0.05 * rng.standard_normal(a.shape), a.dtype)

    return jax.tree_util.tree_map_with_path(fill, abstract)


@pytest.fixture(scope="module")
def tiny_llama():
    cfg = model_config(load_config(None, ["model.family=llama"]).model, VOCAB)
    graphdef, abstract, _ = model_layout(cfg, None)
    assert isinstance(abstract, list) and len(abstract) == 1  # no LoRA: one group, everything trains
    return cfg, graphdef, _noise_params(abstract[0], 0)


def _conversations(seed: int = 0) -> Examples:
    """Three random conversations with random loss masks (each with some trained targets)."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in LENGTHS:
        mask = rng.random(n) < 0.6
        mask[-3:] = True
        rows.append(Encoded(rng.integers(0, VOCAB, n).astype(np.int32), mask))
    return Examples.of(rows)


def _stack(rows: list[dict], keys=("inputs", "targets", "loss_mask", "positions", "segment_ids")) -> dict:
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in keys}


def _packed_and_alone(examples: Examples) -> tuple[dict, dict]:
    """One row holding all three conversations (segments 1, 2, 3; two empty rows beside it), and each conversation
    alone in its own padded row. Both batches are (3, SEQ), so one compiled step serves both."""
    packed = PackedRows(examples, [[0, 1, 2], [], []], SEQ)
    alone = PackedRows(examples, [[0], [1], [2]], SEQ)
    row = packed[0]
    assert list(np.unique(row["segment_ids"])) == [0, 1, 2, 3] and row["positions"][LENGTHS[0] - 1] == 0
    return _stack([packed[i] for i in range(3)]), _stack([alone[i] for i in range(3)])


def test_packed_loss_and_grads_equal_unpacked(tiny_llama):
    """Three conversations packed into one row (segment ids, restarting positions) give the summed loss and token
    count of each alone in a padded row (rel <= 1e-6), and the same gradients (rel <= 1e-5 per parameter)."""
    _, graphdef, params = tiny_llama
    examples = _conversations()
    packed, alone = _packed_and_alone(examples)
    forward = NativeForward(graphdef, VOCAB)
    fn = jax.jit(jax.value_and_grad(lambda p, b: CrossEntropy()(forward, p, b, None)[:2], has_aux=True))
    (loss_p, n_p), g_p = fn(params, packed)
    (loss_a, n_a), g_a = fn(params, alone)
    assert float(n_p) == float(n_a) == sum(float(examples.row(i)[1][1:].sum()) for i in range(3))
    err = abs(float(loss_p) - float(loss_a)) / abs(float(loss_a))
    assert err <= 1e-6, (float(loss_p), float(loss_a))
    worst = max(jax.tree.leaves(jax.tree.map(rel, g_p, g_a)))
    assert worst <= 1e-5, worst
    # The check can fail: with one segment id for the whole row its later conversations see the earlier ones
    # (measured: rel 2.6e-3, far above the tolerance).
    leaky = {**packed, "segment_ids": jnp.where(packed["segment_ids"] > 0, 1, 0)}
    (loss_l, _), _ = fn(params, leaky)
    assert abs(float(loss_l) - float(loss_a)) > 1e-4 * abs(float(loss_a))


def test_no_attention_across_segments(tiny_llama):
    """Changing every token of segment 2 in a packed row leaves the logits of segments 1 and 3 bitwise unchanged
    (and does change segment 2's)."""
    _, graphdef, params = tiny_llama
    packed, _ = _packed_and_alone(_conversations())
    seg = np.asarray(packed["segment_ids"])
    tokens = np.asarray(packed["inputs"])
    perturbed = tokens.copy()
    perturbed[seg == 2] = (tokens[seg == 2] + 1 + np.arange((seg == 2).sum()) % 7) % VOCAB

    @jax.jit
    def logits(t):
        return merge(graphdef, params)(t, positions=packed["positions"], segment_ids=packed["segment_ids"])

    a, b = np.asarray(logits(jnp.asarray(tokens))), np.asarray(logits(jnp.asarray(perturbed)))
    for s in (1, 3):
        np.testing.assert_array_equal(a[seg == s], b[seg == s])
    assert np.abs(a[seg == 2] - b[seg == 2]).max() > 1e-3


def test_batch_without_trained_tokens():
    """A batch whose loss mask is all zero, through the LoRA train step (frozen base passed beside the state,
    two micro-batches): loss 0, tokens 0, gradient norm 0 (no NaN from 0/0), the step counted as finite, and
    (AdamW without weight decay) the adapters bitwise unchanged."""
    cfg = model_config(load_config(None, ["model.family=llama", "model.lora.rank=4"]).model, VOCAB)
    graphdef, abstract, _ = model_layout(cfg, None)
    assert len(abstract) == 2  # [adapters, frozen base]
    params, frozen = _noise_params(abstract[0], 1), _noise_params(abstract[1], 2)
    assert all(k in ("lora_a", "lora_b") for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
               for k in [p[-1].key])
    tx = optax.adamw(1e-2, weight_decay=0.0)
    loss = objective_loss(CrossEntropy(), NativeForward(graphdef, VOCAB), NativeSpec.weights)
    step = jax.jit(make_train_step(loss, tx, optax.constant_schedule(1e-2), micro_batches=2, use_dropout=False))
    examples = _conversations()
    batch = _stack([PackedRows(examples, [[0, 1]], SEQ)[0], PackedRows(examples, [[2]], SEQ)[0]])
    batch["loss_mask"] = jnp.zeros_like(batch["loss_mask"])
    state, m = step(init_state(params, tx, 0), batch, (frozen,))
    m = {k: float(v) for k, v in jax.device_get(m).items()}
    assert m["loss"] == 0.0 and m["count"] == 0.0 and m["grad_norm"] == 0.0 and m["finite"] == 1.0, m
    for a in jax.tree.leaves(state):
        assert np.isfinite(np.asarray(a, np.float64)).all()
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(params))


# --- LoRA from a HuggingFace checkpoint -------------------------------------------------------------------------

WORDS = ["red", "green", "blue", "cat", "dog", "fish", "one", "two", "three", "sun", "moon", "star", "tree", "river",
         "stone", "bird"]


def _chat_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.choice(WORDS), rng.choice(WORDS)
        rows.append({"messages": [{"role": "user", "content": f"say {a} then {b}"},
                                  {"role": "assistant", "content": f"{a} {b} {a}."}]})
    return rows


def _save_hf_model(directory: Path, config, seed: int, noise: float) -> None:
    """A random transformers model, every tensor perturbed (norm weights are constants otherwise)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """train.jsonl (40 conversations), test.jsonl (8) and tiny random Llama and Gemma 3 checkpoints, each with
    the BPE tokenizer (ChatML template) saved beside it."""
    root = tmp_path_factory.mktemp("finetune")
    rows = _chat_rows(48, seed=0)
    train_file = write_jsonl(root / "train.jsonl", rows[:40])
    test_file = write_jsonl(root / "test.jsonl", rows[40:])
    texts = [m["content"] for r in rows for m in r["messages"]]
    common = {"vocab_size": HF_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    dirs = {}
    for name, config, noise in [
        ("llama", transformers.LlamaConfig(**common, tie_word_embeddings=False), 0.1),
        ("gemma3", transformers.Gemma3TextConfig(**common, head_dim=32, sliding_window=8, query_pre_attn_scalar=32,
                                                 layer_types=["sliding_attention", "full_attention"]), 0.05),
    ]:
        d = root / name
        _save_hf_model(d, config, seed=len(dirs), noise=noise)
        assert save_chatml_tokenizer(d, texts) <= HF_VOCAB
        dirs[name] = d
    return {"root": root, "train": train_file, "test": test_file, **dirs}


def _lora_overrides(chat, run_dir: Path, *extra: str) -> list[str]:
    return [f"model.from_hf={chat['llama']}", "model.lora.rank=4", "model.lora.alpha=8",
            f"model.lora.targets={TARGETS}", "data.format=messages", f"data.sources=[{chat['train']}]",
            "data.seq_len=64", "data.val_fraction=0.2",
            "train.steps=6", "train.batch_size=4", "optim.lr=1e-2", "optim.warmup_steps=1",
            # the schedule's length is pinned: it otherwise follows train.steps, which the resume test changes
            "optim.decay_steps=6", "eval.batches=1", "checkpoint.every=3", "logging.every=1",
            "logging.progress=false", "logging.tensorboard=false", f"run_dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def lora_run(chat):
    """LoRA (rank 4, alpha 8) on the Llama checkpoint: 6 steps, checkpoints at 3 and 6."""
    cfg = load_config(None, _lora_overrides(chat, chat["root"] / "lora-run"))
    result = train(cfg)
    assert result.step == 6 and sorted(result.losses) == list(range(1, 7))
    return cfg, result


@pytest.fixture(scope="module")
def exports(lora_run, chat):
    """`jaxtune export RUN OUT --adapter` and `jaxtune export RUN OUT2` (merged)."""
    cfg, _ = lora_run
    adapter, merged = chat["root"] / "adapter", chat["root"] / "merged"
    assert main(["export", str(cfg.run_path), str(adapter), "--adapter"]) == 0
    assert main(["export", str(cfg.run_path), str(merged)]) == 0
    return adapter, merged


def _checkpoint_tree(run_dir: Path, step: int) -> dict[str, tuple]:
    """'path' -> shape of every array in a saved train state, read from Orbax's metadata (no template)."""
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata(run_dir / "checkpoints" / str(step) / "state")
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return {jax.tree_util.keystr(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _adapter_matrices(params) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """HF module name (model.layers.i.self_attn.q_proj) -> (A (in, r), B (r, out)) of a loop-layout adapters tree."""
    out = {}
    for i, layer in params["layers"].items():
        for (part, name), hf in HF_MODULES.items():
            node = layer.get(part, {}).get(name)
            if node is not None:
                out[f"model.layers.{i}.{hf}"] = (np.asarray(node["lora_a"]), np.asarray(node["lora_b"]))
    return out


def test_lora_checkpoint_holds_only_adapters(lora_run):
    """The saved train state holds the adapters of the targeted projections and nothing of the frozen base, and
    the optimizer's moments exist for the adapters only; the adapters moved away from their init (B = 0)."""
    cfg, result = lora_run
    tree = _checkpoint_tree(cfg.run_path, 6)
    params = {k: v for k, v in tree.items() if k.startswith("['params']")}
    assert params and all(k.endswith(("['lora_a']", "['lora_b']")) for k in params), sorted(params)
    assert len(params) == 2 * 2 * len(TARGETED)  # 2 layers x 5 targets x (A, B)
    assert not any(f"['{n}']" in k for k in params for n in ("k", "up", "embed", "lm_head", "norm", "attn_norm"))
    moments = {k for k, shape in tree.items() if k.startswith("['opt_state']") and shape != ()}
    assert moments and all(k.endswith(("['lora_a']", "['lora_b']")) for k in moments), sorted(moments)
    assert sum(np.prod(tree[k]) for k in moments) == 2 * sum(np.prod(s) for s in params.values())  # mu and nu
    run = load_run(cfg.run_path)
    assert run.step == 6 and len(run.frozen) == 1
    assert all(np.abs(b).max() > 1e-3 for _, b in _adapter_matrices(jax.device_get(run.params)).values())
    assert result.evals[0]["step"] == 0 and result.evals[-1]["step"] == 6
    assert result.evals[-1]["loss"] < result.evals[0]["loss"]


def test_merged_export_is_base_plus_low_rank_update(lora_run, exports, chat):
    """The merged export: every tensor LoRA does not target (embeddings, norms, head, k_proj, up_proj) bitwise
    the original checkpoint's; each targeted weight W + (alpha / r) (A B)^T (rel <= 1e-6), a real change."""
    cfg, _ = lora_run
    _, merged = exports
    original, out = HFCheckpoint(chat["llama"]), HFCheckpoint(merged)
    assert out.names() == original.names()
    adapters = _adapter_matrices(jax.device_get(load_run(cfg.run_path).params))
    assert len(adapters) == 2 * len(TARGETED)
    scale = 8 / 4
    worst = 0.0
    for name in sorted(original.names()):
        w0, w = np.asarray(original.get(name)), np.asarray(out.get(name))
        module = name.removesuffix(".weight")
        if module in adapters:
            a, b = adapters[module]
            delta = scale * (a.astype(np.float64) @ b).T
            assert np.abs(delta).max() > 1e-3 * np.abs(w0).max()  # the adapters changed the weight
            worst = max(worst, rel(w, w0 + delta))
        else:
            assert not module.endswith(TARGETED), name
            np.testing.assert_array_equal(w, w0, err_msg=name)
    assert worst <= 1e-6, worst


def _tokens(tokenizer, rows: list[dict]) -> np.ndarray:
    """A (2, T) batch: a ChatML-rendered conversation and random ids."""
    text = tokenizer.apply_chat_template(rows[0]["messages"])
    ids = tokenizer.encode_chat([text])[0]
    rand = np.random.default_rng(1).integers(0, tokenizer.vocab_size, len(ids))
    return np.stack([np.asarray(ids), rand]).astype(np.int64)


def _ours(run, ids: np.ndarray) -> np.ndarray:
    """Our LoRA model (adapters + frozen base, `registry.merge`) on ``ids``."""
    return np.asarray(merge(run.spec.graphdef, run.weights)(jnp.asarray(ids, jnp.int32)))


def _peft_logits(base_dir: Path, adapter_dir: Path, ids: np.ndarray) -> np.ndarray:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    model = peft_reload(base, adapter_dir)
    with torch.no_grad():
        return model(torch.from_numpy(ids)).logits.float().numpy()


def test_peft_adapter_and_merged_export_match_our_model(lora_run, exports, chat):
    """`jaxtune export --adapter` writes a PEFT adapter (config + safetensors with the adapters transposed,
    bitwise) that PeftModel loads on the original checkpoint with our LoRA model's logits (rel <= 1e-5); the
    merged export reloaded by transformers gives the PEFT model's logits (rel <= 1e-5)."""
    cfg, _ = lora_run
    adapter, merged = exports
    assert sorted(p.name for p in adapter.iterdir() if p.name.startswith("adapter")) == [ADAPTER_CONFIG,
                                                                                          ADAPTER_WEIGHTS]
    conf = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8 and conf["peft_type"] == "LORA"
    assert sorted(conf["target_modules"]) == sorted(TARGETED)
    assert conf["base_model_name_or_path"] == str(chat["llama"])
    run = load_run(cfg.run_path)
    st = SafetensorsFile(adapter / ADAPTER_WEIGHTS)
    expected = {}
    for module, (a, b) in _adapter_matrices(jax.device_get(run.params)).items():
        expected[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.T
        expected[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b.T
    assert sorted(st.entries) == sorted(expected)
    for name, x in expected.items():
        np.testing.assert_array_equal(st.get(name), x, err_msg=name)

    ids = _tokens(run.tokenizer, _chat_rows(1, seed=5))
    ours = _ours(run, ids)
    theirs = _peft_logits(chat["llama"], adapter, ids)
    assert ours.shape == theirs.shape == (2, ids.shape[1], HF_VOCAB)
    err_peft = rel(ours, theirs)
    assert err_peft <= 1e-5, err_peft
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    with torch.no_grad():
        merged_logits = hf(torch.from_numpy(ids)).logits.float().numpy()
    err_merged = rel(merged_logits, theirs)
    assert err_merged <= 1e-5, err_merged
    # The comparison can fail: the base model alone is far from the adapted one.
    base = transformers.AutoModelForCausalLM.from_pretrained(chat["llama"], attn_implementation="eager").eval()
    with torch.no_grad():
        assert rel(base(torch.from_numpy(ids)).logits.numpy(), theirs) > 1e-3


def _ours_jit(graphdef, weights, ids: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda w, t: merge(graphdef, w)(t))(weights, jnp.asarray(ids, jnp.int32)))


@pytest.mark.parametrize("family,extra", [("llama", ["model.scan_layers=true"]), ("gemma3", [])])
def test_peft_adapter_without_training(family, extra, exports, chat, tmp_path):
    """LoRA with scanned layers (adapters stacked over layers) writes the same PEFT tensor names and shapes as the
    loop layout; Gemma 3 maps to PEFT too. Random adapters on the checkpoint's LoRA model (no training): PEFT's
    logits on the checkpoint equal ours (rel <= 1e-5)."""
    run_cfg = load_config(None, [f"model.from_hf={chat[family]}", "model.lora.rank=4", "model.lora.alpha=8",
                                 f"model.lora.targets={TARGETS}", *extra])
    tok = load_tokenizer(run_cfg.tokenizer, run_cfg.data)  # the checkpoint's own
    cfg = model_config(run_cfg.model, tok.vocab_size)
    assert cfg.family == family and cfg.lora.targets == ("q", "v", "o", "gate", "down")
    graphdef, (abstract_adapters, abstract_base), _ = model_layout(cfg, None)
    base = load_params(HFCheckpoint(chat[family]), FAMILIES[family], abstract_base)
    adapters = _noise_params(abstract_adapters, 3)
    out = write_adapter(tmp_path / "adapter", FAMILIES[family], cfg.lora, adapters, base_model=str(chat[family]))
    names = {k: tuple(v["shape"]) for k, v in SafetensorsFile(out / ADAPTER_WEIGHTS).entries.items()}
    if family == "llama":
        loop_adapter, _ = exports
        assert names == {k: tuple(v["shape"]) for k, v in
                         SafetensorsFile(loop_adapter / ADAPTER_WEIGHTS).entries.items()}
    else:
        assert len(names) == 2 * 2 * len(TARGETED)
    ids = _tokens(tok, _chat_rows(1, seed=6))
    err = rel(_ours_jit(graphdef, (adapters, base), ids), _peft_logits(chat[family], out, ids))
    assert err <= 1e-5, (family, err)


# --- resume ---------------------------------------------------------------------------------------------------------

def test_lora_resume_is_bitwise(lora_run, chat, tmp_path):
    """A LoRA run stopped after 3 steps (train.steps=3) and resumed to 6 in the same run_dir has the losses and
    final adapters of the uninterrupted 6-step run, bitwise (the frozen base is re-read from model.from_hf)."""
    ref_cfg, ref = lora_run
    run_dir = tmp_path / "run"
    first = train(load_config(None, _lora_overrides(chat, run_dir, "train.steps=3")))
    assert sorted(first.losses) == [1, 2, 3]
    second = train(load_config(None, _lora_overrides(chat, run_dir)))
    assert sorted(second.losses) == [4, 5, 6]
    losses = {**first.losses, **second.losses}
    assert losses == ref.losses, (losses, ref.losses)  # exact float equality
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(load_run(run_dir).params),
                 jax.device_get(load_run(ref_cfg.run_path).params))
    assert second.evals[-1]["loss"] == ref.evals[-1]["loss"]


# --- commands -------------------------------------------------------------------------------------------------------

def _json_out(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_and_generate_commands(lora_run, exports, chat, capsys):
    """`jaxtune eval RUN --data test.jsonl` prints loss/perplexity/tokens; `jaxtune eval MERGED_EXPORT --data ...`
    (format read from the file) gives the same loss (rel <= 1e-4) on the same tokens; `jaxtune generate RUN`
    formats prompts as user turns by default for this chat-trained run (--chat's output), raw with --no-chat."""
    cfg, _ = lora_run
    _, merged = exports
    capsys.readouterr()
    assert main(["eval", str(cfg.run_path), "--data", str(chat["test"])]) == 0
    run_eval = _json_out(capsys)
    assert {"loss", "perplexity", "tokens"} <= set(run_eval) and run_eval["step"] == 6
    assert run_eval["tokens"] > 0 and np.isfinite(run_eval["loss"])
    assert abs(run_eval["perplexity"] - np.exp(run_eval["loss"])) <= 1e-6 * run_eval["perplexity"]
    assert run_eval["examples"] == 8
    assert main(["eval", str(merged), "--data", str(chat["test"])]) == 0
    hf_eval = _json_out(capsys)
    assert hf_eval["tokens"] == run_eval["tokens"]
    err = abs(hf_eval["loss"] - run_eval["loss"]) / run_eval["loss"]
    assert err <= 1e-4, (hf_eval, run_eval)
    generate = ["generate", str(cfg.run_path), "--prompt", "hi", "--prompt", "yo", "--max-new-tokens", "5",
                "--temperature", "0"]
    assert main([*generate, "--chat"]) == 0
    as_chat = capsys.readouterr().out
    assert main(generate) == 0  # a run trained on chat data: a prompt is a user turn without --chat, and it says so
    out = capsys.readouterr()
    assert out.out == as_chat and "trained on chat data: each prompt is a user turn (--no-chat" in out.err
    assert main([*generate, "--no-chat"]) == 0  # raw text continued
    assert capsys.readouterr().out != as_chat


# --- chat exports stop where the model's turn ends ------------------------------------------------------------------

def _short_chat_run(chat, name: str, *model: str) -> Path:
    """A 2-step SFT run on the conversations from the Llama checkpoint (its ChatML tokenizer; ``model``: more model
    keys), exported merged."""
    cfg = load_config(None, [f"model.from_hf={chat['llama']}", *model, "data.format=messages",
                             f"data.sources=[{chat['train']}]", "data.seq_len=64", "data.val_fraction=0",
                             "train.steps=2", "train.batch_size=4", "eval.every=0", "checkpoint.every=2",
                             "logging.progress=false", "logging.tensorboard=false", f"run_dir={chat['root'] / name}"])
    train(cfg)
    out = chat["root"] / f"{name}-export"
    assert main(["export", str(cfg.run_path), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def chat_export(exports, chat):
    """chat_export(kind) -> the export of a run trained on ChatML conversations, each made once: full weights, LoRA
    merged, the PEFT adapter and QLoRA (nf4) merged."""
    adapter, merged = exports
    made = {"full": [], "qlora": ["model.lora.rank=4", "model.quantize=nf4"]}
    done = {"merged": merged, "adapter": adapter}

    def get(kind: str) -> Path:
        if kind not in done:
            done[kind] = _short_chat_run(chat, f"{kind}-chat", *made[kind])
        return done[kind]

    return get


@pytest.mark.parametrize("kind", ["full", "merged", "adapter", "qlora"])
def test_chat_exports_stop_at_the_end_of_turn(kind, chat_export):
    """Every export of a run trained on ChatML conversations, loaded by transformers, stops at <|im_end|> as
    `jaxtune generate` does (`helpers.chat_stops`): full weights, LoRA merged, the PEFT adapter (through its own
    generation_config.json and tokenizer) and QLoRA (nf4) merged."""
    assert_stops_at_end_of_turn(chat_export(kind), adapter=kind == "adapter")


@pytest.mark.parametrize("kind", ["pretrain", "full", "merged", "adapter", "qlora"])
def test_every_export_pads_a_batch_in_transformers(kind, chat_export, tiny_cfg, tmp_path):
    """`AutoTokenizer.from_pretrained(export)(texts, padding=True)` pads with config.json's ``pad_token_id`` for
    every export kind (`helpers.export_padding`): a GPT-2 pretrained from scratch on jaxtune's BPE (no pad token of
    its own: its EOS, written in config.json and the tokenizer), and the ChatML run's exports, whose checkpoint names
    pad id 0 in config.json but no pad token in its tokenizer; an adapter's tokenizer pads with its base's pad id."""
    if kind == "pretrain":
        cfg = tiny_cfg("train.steps=2", "checkpoint.every=2", "eval.every=0")
        train(cfg)
        directory = tmp_path / "export"
        assert main(["export", str(cfg.run_path), str(directory)]) == 0
        config = json.loads((directory / "config.json").read_text())
        assert config["model_type"] == "gpt2" and config["pad_token_id"] == config["eos_token_id"]
    else:
        directory = chat_export(kind)
    base = base_config_dir(directory) if kind == "adapter" else None
    assert assert_pads_as_config(directory, base) == 0


# --- real data ------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not CHAT_DATA.is_file(), reason=f"real chat data not found at {CHAT_DATA}")
def test_real_chat_data_learns_and_reports(tmp_path, data_cache):
    """A tiny Llama from random init on the ChatterBot conversations (ChatML, our BPE with the ChatML specials):
    held-out loss falls over 40 steps, and report.md shows the prompts' samples before and after."""
    prompts = ["What is AI?", "Hello"]
    cfg = load_config(None, [
        "model.family=llama", "model.preset=tiny", "data.format=messages", f"data.sources=[{CHAT_DATA}]",
        "data.chat_template=chatml", "data.seq_len=128", "data.val_fraction=0.05", f"data.cache_dir={data_cache}",
        "tokenizer.kind=bpe", "tokenizer.vocab_size=512", "tokenizer.special_tokens=['<|im_start|>','<|im_end|>']",
        "train.steps=40", "train.batch_size=8", "optim.lr=3e-3", "optim.warmup_steps=4", "eval.batches=2",
        f"eval.prompts={json.dumps(prompts)}", "eval.temperature=0", "eval.max_new_tokens=12",
        "checkpoint.every=100", "logging.every=10", "logging.progress=false", "logging.tensorboard=false",
        f"run_dir={tmp_path / 'run'}"])
    result = train(cfg)
    assert [e["step"] for e in result.evals] == [0, 40]
    before, after = result.evals[0], result.evals[-1]
    assert before["loss"] > after["loss"], (before["loss"], after["loss"])
    assert len(before["samples"]) == len(after["samples"]) == 2
    assert all(s.startswith(f"user: {p}\nassistant: ") for p, s in zip(prompts, after["samples"]))
    report = (cfg.run_path / "report.md").read_text()
    assert "**Before (step 0):**" in report and "**After (step 40):**" in report
    for s in before["samples"] + after["samples"]:
        assert s in report


# --- configuration errors --------------------------------------------------------------------------------------------

def test_lora_config_errors():
    """LoRA on GPT-2 is refused naming the decoder families; targets that are not module names are refused at load,
    and names the native models lack when the model is built (torchax models check theirs); HF names and 'all' are
    accepted."""
    with pytest.raises(ConfigError, match="decoder families"):
        model_config(load_config(None, ["model.lora.rank=4"]).model, VOCAB)
    with pytest.raises(ConfigError, match="'foo' is not a projection of the native models"):
        model_config(load_config(None, ["model.family=llama", "model.lora.rank=2",
                                        "model.lora.targets=[q_proj, foo]"]).model, VOCAB)
    with pytest.raises(ConfigError, match="is not a module name"):
        load_config(None, ["model.lora.targets=[q_proj, 'foo bar']"])
    assert load_config(None, ["model.lora.targets=[q_proj, v]"]).model.lora.targets == ["q", "v"]
    assert len(load_config(None, ["model.lora.targets=all"]).model.lora.targets) == 7
    cfg = model_config(load_config(None, ["model.family=qwen3", "model.lora.rank=2", "model.lora.alpha=6"]).model)
    assert cfg.lora.scale == 3.0 and cfg.lora.targets == ("q", "k", "v", "o", "gate", "up", "down")


def test_bf16_frozen_base_and_full_adafactor_remat(chat, tmp_path):
    """LoRA with model.param_dtype=bfloat16 holds the frozen base in bf16 (read from the fp32 checkpoint) and the
    adapters in fp32, and trains; full fine-tuning with Adafactor, full remat and 2 micro-batches trains every
    parameter (the embedding moves), compiling once."""
    from jaxtune.backends import make_state_spec
    from jaxtune.sharding import make_mesh

    # data.val_fraction=0: nothing held out, so no evaluation and no eval step to compile in either run.
    cfg = load_config(None, _lora_overrides(chat, tmp_path / "bf16", "model.param_dtype=bfloat16",
                                            "model.compute_dtype=bfloat16", "train.steps=3", "optim.decay_steps=3",
                                            "data.val_fraction=0"))
    spec = make_state_spec(cfg, HF_VOCAB, make_mesh(-1, 1, 1))
    assert {a.dtype for a in jax.tree.leaves(spec.frozen_abstract)} == {jnp.dtype("bfloat16")}
    assert {a.dtype for a in jax.tree.leaves(spec.abstract.params)} == {jnp.dtype("float32")}
    result = train(cfg)
    assert result.step == 3 and all(np.isfinite(list(result.losses.values())))

    full = load_config(None, _lora_overrides(chat, tmp_path / "full", "model.lora.rank=0", "optim.name=adafactor",
                                             "model.remat=full", "train.micro_batches=2", "train.steps=3",
                                             "optim.decay_steps=3", "optim.lr=1e-2", "data.val_fraction=0"))
    spec = make_state_spec(full, HF_VOCAB, make_mesh(-1, 1, 1))
    assert spec.frozen_abstract == ()
    start = load_run(_config_file(full, tmp_path))  # no checkpoint yet: the checkpoint's weights
    result = train(full)
    assert result.step == 3 and result.step_compiles == len(result.step_lengths)
    assert all(np.isfinite(list(result.losses.values())))
    end = load_run(tmp_path / "full")
    embed = lambda run: np.asarray(run.params["embed"]["embedding"])
    assert not np.array_equal(embed(start), embed(end))


def _config_file(cfg, tmp_path: Path) -> Path:
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    return path
