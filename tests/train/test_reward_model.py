"""Reward models (``objective.name=reward``) against TRL 1.16.0's `RewardTrainer` and transformers' sequence
classifier, on a tiny random fp32 `LlamaForSequenceClassification` (num_labels 1, ``pad_token_id`` 0) saved with
``save_pretrained`` and read by jaxtune (``model.from_hf``: its score head with it).

The pairs are made by hand: 4 prompts of 2 to 6 tokens, each with a chosen and a rejected completion of 1 to 7
tokens ending in EOS (ids >= 3 otherwise: never the pad id, where transformers' classifier looks for the last real
token). Ours lays them out as the data pipeline does (`PairRows`: (B, 2, T) right-padded rows of prompt then
completion); TRL's input is what its collator makes: ``input_ids`` (2B, L), the chosen sequences then the rejected
ones, right-padded with the pad id, ``attention_mask``, and ``margin`` (B,) where the check gives one.

Error measure: rel(ours, ref) = max|ours - ref| / max|ref|, float32 on both sides. Tolerances:
  * the loss, the gradients of the embedding, a q_proj, an mlp down_proj, the final norm and the score head, and the
    metrics accuracy, margin, mean_reward, min_reward and max_reward vs RewardTrainer's ``compute_loss`` (train
    mode): plain, with per-pair margins, and with center_rewards_coefficient 0.01                  rel <= 1e-5
  * each sequence's reward vs the classifier's logits on the sequence alone (no padding)            rel <= 1e-5
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from helpers import trl_reference
from helpers.compare import rel
from helpers.export_padding import assert_pads_as_config
from helpers.tiny_hf import peft_reload
from helpers.trl_reference import BOS, EOS, MESH, PAD, TOL, TRL_VERSION, Native, Ours, TRLResult

from jaxtune import sharding
from jaxtune.config import objective_config
from jaxtune.data.encoded import Encoded
from jaxtune.data.preference import PairRows
from jaxtune.train.objectives import make_objective
from jaxtune.train.step import per_unit

torch = pytest.importorskip("torch", reason="the TRL comparisons run PyTorch")
trl = pytest.importorskip("trl", reason="the reward model is checked against TRL's RewardTrainer")
transformers = pytest.importorskip("transformers", reason="the tiny checkpoint is a transformers model")
datasets = pytest.importorskip("datasets", reason="RewardTrainer takes a datasets.Dataset")

V, T = 64, 16
PAIRS = [  # (prompt, chosen, rejected)
    ([BOS, 5, 6], [7, 8, EOS], [9, EOS]),
    ([BOS, 10, 11, 12, 13, 14], [15, EOS], [16, 17, 18, 19, 20, 21, EOS]),
    ([BOS, 22], [23, 24, 25, 26, EOS], [27, 28, 29, EOS]),
    ([BOS, 30, 31, 32], [EOS], [33, 34, EOS]),
]
MARGINS = [0.5, 0.0, 1.5, -0.25]
# jaxtune param path -> (HF tensor, whether ours is its transpose)
GRADS = {**{k: v for k, v in trl_reference.GRAD_PARAMS.items() if k[0] != "lm_head"},
         ("score", "kernel"): ("score.weight", True)}
RUN = ("objective.name=reward", "data.format=preference", "data.sources=[pairs.jsonl]", f"data.seq_len={T}",
       "train.batch_size=4")

MODEL_TINY = ["model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
              "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=128"]

torch_one_thread = pytest.fixture(scope="module", autouse=True)(trl_reference.one_torch_thread)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny LlamaForSequenceClassification (seed 0, num_labels 1), saved."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.1, bos_token_id=BOS,
                                      eos_token_id=EOS, pad_token_id=PAD, num_labels=1)
    model = transformers.LlamaForSequenceClassification(config).float()
    directory = tmp_path_factory.mktemp("reward") / "model"
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def native(checkpoint) -> Native:
    _, spec = trl_reference.tiny_spec(checkpoint, *RUN)
    return Native(spec, spec.init(0).params, None)


def pair_batch(margins=None, shared: bool = False) -> dict[str, np.ndarray]:
    """PAIRS as the data pipeline lays them out: (B, 2, T) `PairRows` arrays, or with ``shared`` prompts (B, 2T)
    rows; ``margin`` (B, 2) when given (each pair's on both of its sequences, as `PairRows` gives it)."""
    encoded = [tuple(Encoded(np.array(p + c, np.int32), np.array([0] * len(p) + [1] * len(c), bool)) for c in (ch, rj))
               for p, ch, rj in PAIRS]
    rows = PairRows.of(encoded, T, shared)
    batch = {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in rows[0]}
    return batch if margins is None else {**batch, "margin": np.repeat(np.asarray(margins, np.float32)[:, None], 2, 1)}


def ours(native: Native, margins=None, shared: bool = False, **keys) -> Ours:
    cfg = objective_config(name="reward", **keys)
    means = lambda metrics, count: {k: float(v) for k, v in per_unit(metrics, count).items()}
    return trl_reference.objective_result(native, make_objective(cfg), cfg, native.policy,
                                          pair_batch(margins, shared), means)


def trl_reward(checkpoint, tmp_path, margins=None, **config) -> TRLResult:
    """RewardTrainer's ``compute_loss`` on the pairs (its collator's layout), the metrics it logged and the
    gradients."""
    from trl import RewardConfig, RewardTrainer

    assert trl.__version__ == TRL_VERSION
    model = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint, dtype=torch.float32)
    args = RewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
                        per_device_train_batch_size=len(PAIRS), **config)
    data = datasets.Dataset.from_dict({"chosen": ["w3"], "rejected": ["w4"]})
    trainer = RewardTrainer(model=model, args=args, train_dataset=data,
                            processing_class=trl_reference.word_tokenizer(V))
    trainer.model.train()
    seqs = [p + c for p, c, _ in PAIRS] + [p + r for p, _, r in PAIRS]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    inputs = {"input_ids": ids, "attention_mask": (ids != PAD).long()}
    if margins is not None:
        inputs["margin"] = torch.tensor(margins, dtype=torch.float32)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    params = dict(trainer.model.named_parameters())
    grads = {name: params[name].grad.detach().numpy().copy() for name, _ in GRADS.values()}
    return TRLResult(loss.item(), metrics, grads)


TRL_NAMES = {"accuracy": "accuracy", "margin": "margin", "mean_reward": "mean_reward", "reward/min": "min_reward",
             "reward/max": "max_reward"}


def assert_matches(mine: Ours, theirs: TRLResult) -> None:
    errors = {"loss": rel(mine.loss, theirs.loss)}
    errors |= {k: rel(mine.metrics[k], theirs.metrics[t]) for k, t in TRL_NAMES.items()}
    for path, (name, transposed) in GRADS.items():
        node = mine.grads
        for k in path:
            node = node[k]
        errors[name] = rel(node.T if transposed else node, theirs.grads[name])
    bad = {k: v for k, v in errors.items() if not v <= TOL}
    assert not bad, (bad, mine.loss, theirs.loss, mine.metrics, theirs.metrics)


@pytest.mark.parametrize("margins, keys", [(None, {}), (MARGINS, {}), (None, {"center_rewards_coefficient": 0.01})],
                         ids=["plain", "margins", "centered"])
def test_reward_model_matches_trl(checkpoint, native, tmp_path, margins, keys):
    """The Bradley-Terry loss on each sequence's score at its last token: loss, gradients (score head included) and
    RewardTrainer's five metrics equal its ``compute_loss``'s, with per-pair margins and the centering term too, in
    rows of one sequence and in rows of a pair with its prompt shared."""
    theirs = trl_reward(checkpoint, tmp_path, margins, **keys)
    assert 0.0 < theirs.metrics["accuracy"] < 1.0  # the random head orders some pairs each way
    for shared in (False, True):  # a row per sequence, or each pair's prompt once (the default layout)
        mine = ours(native, margins, shared, **keys)
        assert mine.count == len(PAIRS)
        assert_matches(mine, theirs)


def test_rewards_are_the_classifier_logits(checkpoint, native):
    """Each sequence's reward (the score at its last token) equals transformers' sequence classifier's logit on the
    sequence alone."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint, dtype=torch.float32).eval()
    objective = make_objective(objective_config(name="reward"))
    with sharding.use_mesh(MESH):
        rewards = jax.jit(lambda p, b: objective.rewards(native.spec.forward(), p, b, None))(
            native.policy, sharding.global_batch(MESH, pair_batch()))
    theirs = []
    with torch.no_grad():
        for p, c, r in PAIRS:
            theirs.append([model(torch.tensor([p + s])).logits[0, 0].item() for s in (c, r)])
    assert rel(np.asarray(rewards), np.asarray(theirs)) <= TOL


def test_a_gpt2_reward_model_scores_and_exports_as_its_classifier(tmp_path):
    """GPT-2 has the score head too: a random GPT2ForSequenceClassification read by jaxtune scores each pair's
    sequences as transformers does (the rewards the objective reads), and written back (`write_model`) it is a
    GPT2ForSequenceClassification (num_labels 1, its pad id) whose logits are the original's."""
    from jaxtune.models.hf import write_model

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=BOS,
                                     eos_token_id=EOS, pad_token_id=PAD, num_labels=1, initializer_range=0.1)
    model = transformers.GPT2ForSequenceClassification(config).float().eval()
    model.save_pretrained(tmp_path / "gpt2")
    _, spec = trl_reference.tiny_spec(tmp_path / "gpt2", *RUN)
    assert spec.model_cfg.family == "gpt2" and spec.model_cfg.num_labels == 1
    params = spec.init(0).params
    objective = make_objective(objective_config(name="reward"))
    with sharding.use_mesh(MESH):
        rewards = jax.jit(lambda p, b: objective.rewards(spec.forward(), p, b, None))(
            params, sharding.global_batch(MESH, pair_batch()))
    with torch.no_grad():
        theirs = [[model(torch.tensor([p + s])).logits[0, 0].item() for s in (c, r)] for p, c, r in PAIRS]
    assert rel(np.asarray(rewards), np.asarray(theirs)) <= TOL

    out = write_model(spec.model_cfg, params, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2ForSequenceClassification"] and config["num_labels"] == 1
    assert config["pad_token_id"] == PAD
    back = transformers.AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[BOS, 5, 6, 7, EOS, PAD, PAD], [BOS, 9, 10, 11, 12, 13, EOS]])
    with torch.no_grad():
        np.testing.assert_allclose(back(ids).logits.numpy(), model(ids).logits.numpy(), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- end to end

REST = ["data.format=preference", "data.chat_template=chatml", "data.seq_len=64", "data.val_fraction=0.1",
        "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
        "objective.name=reward", "optim.lr=3e-3", "optim.warmup_steps=0", "train.batch_size=8", "train.steps=12",
        "eval.every=6", "eval.batches=2", "eval.exact_match=0", "checkpoint.every=6", "logging.every=1",
        "logging.progress=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    import itertools

    from helpers.rows import write_jsonl

    from jaxtune.data.synthetic import arithmetic_preferences

    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl",
                       itertools.islice(arithmetic_preferences(), 240))


def classifier_matches(run_dir, hf) -> float:
    """A transformers sequence classifier (``hf``: a directory, or a loaded model) against the run's own rewards (its
    checkpoint, as `jaxtune export` reads it) on 6 conversations of 5 to 14 tokens, right-padded in one batch with
    the classifier's pad id: rel error of the scores."""
    from jaxtune.export import load_run

    run = load_run(run_dir)
    if not isinstance(hf, torch.nn.Module):
        hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf, dtype=torch.float32).eval()
    eos = run.tokenizer.eos_id
    texts = ["3 plus 4", "What is 58 plus 67?", "125", "1 + 1 = 2", "nine", "the sum is 12"]
    seqs = [run.tokenizer.encode(t)[:13] + [eos] for t in texts]
    width = max(map(len, seqs))
    pad = hf.config.pad_token_id
    ids = np.array([s + [pad] * (width - len(s)) for s in seqs], np.int32)
    real = np.array([[1] * len(s) + [0] * (width - len(s)) for s in seqs], np.int32)
    rows = {"inputs": ids, "positions": np.maximum(np.cumsum(real, 1) - 1, 0).astype(np.int32), "segment_ids": real}
    with sharding.use_mesh(run.spec.mesh):
        scores = jax.jit(run.spec.forward().scores)(run.weights, sharding.global_batch(run.spec.mesh, rows))
    ours = np.asarray(scores)[np.arange(len(seqs)), [len(s) - 1 for s in seqs]]
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(real)).logits[:, 0].numpy()
    return rel(ours, theirs)


@pytest.mark.parametrize("lora, backend", [(False, "native"), (True, "native"), (True, "torchax")],
                         ids=["full", "lora", "torchax-lora"])
def test_a_reward_model_trains_and_exports_as_a_classifier(pairs_file, tmp_path, data_cache, quickstart_sft_model,
                                                           lora, backend):
    """A reward model through `train()`: from scratch (full), or with LoRA from a causal LM (the quickstart's SFT
    export: its LM head left out, a fresh score head trained with the adapters; with the torchax backend, transformers'
    own LlamaForSequenceClassification under PEFT's SEQ_CLS task). The step compiles once; train and
    eval rows carry RewardTrainer's metrics; held-out accuracy is in report.md. `jaxtune export` writes a sequence
    classifier (num_labels 1, a pad id that is no end token, its tokenizer's pad token) whose batched, padded scores
    equal the run's to 1e-5; with LoRA, --adapter writes PEFT's SEQ_CLS adapter (the score head in modules_to_save,
    the tokenizer's pad token the classifier's) that scores the same on the causal LM read as a classifier; --gguf is
    refused for it, and so is `jaxtune generate`."""
    from helpers.run_outputs import metric_rows

    from jaxtune.cli import main
    from jaxtune.config import load_config
    from jaxtune.loop import train

    run = tmp_path / "run"
    start = ([f"model.from_hf={quickstart_sft_model}", "model.lora.rank=4", "data.chat_template=null"] if lora
             else [*MODEL_TINY, "tokenizer.kind=bpe"])
    rest = [r for r in REST if not (lora and r.startswith(("tokenizer.", "data.chat_template")))]
    rest += [f"model.backend={backend}"]
    cfg = load_config(None, [*rest, *start, f"data.sources=[{pairs_file}]", f"data.cache_dir={data_cache}",
                             f"run_dir={run}"])
    result = train(cfg)
    assert result.step_compiles == len(result.step_lengths)
    names = ("accuracy", "margin", "mean_reward", "reward/min", "reward/max")
    for row in metric_rows(run, "train") + metric_rows(run, "eval"):
        assert set(names) <= set(row) and np.isfinite([row[k] for k in names]).all(), row
        assert row["reward/min"] <= row["mean_reward"] <= row["reward/max"]
    assert "| step | held-out loss | reward accuracy |" in (run / "report.md").read_text()
    out = tmp_path / "model"
    assert main(["export", str(run), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    # one label: jaxtune writes num_labels; transformers' save_pretrained (torchax) only id2label, as it reads it
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert config.get("num_labels", len(config.get("id2label", ()))) == 1
    eos = config["eos_token_id"]
    assert config["pad_token_id"] not in (eos if isinstance(eos, list) else [eos])
    assert_pads_as_config(out)  # its tokenizer pads a batch to score with the classifier's pad id
    assert classifier_matches(run, out) <= TOL
    assert main(["generate", str(run), "--prompt", "What is 2 plus 2?"]) == 2  # a score head generates nothing
    assert main(["export", str(run), str(tmp_path / "other.gguf"), "--gguf"]) == 2
    adapter = tmp_path / "adapter"
    assert main(["export", str(run), str(adapter), "--adapter"]) == (0 if lora else 2)
    if lora:  # PEFT's SEQ_CLS adapter (the score head in modules_to_save) on the causal LM read as a classifier
        pytest.importorskip("peft")
        assert "score" in json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"]
        assert_pads_as_config(adapter, out)  # the classifier's pad id, which the base is loaded with
        base = transformers.AutoModelForSequenceClassification.from_pretrained(
            quickstart_sft_model, num_labels=1, pad_token_id=config["pad_token_id"], dtype=torch.float32)
        assert classifier_matches(run, peft_reload(base, adapter)) <= TOL


def test_what_a_reward_model_refuses(checkpoint, tmp_path):
    """One line each, naming the key and what to do: an evaluation that generates, a sequence classifier's checkpoint
    for an objective that trains a language model (either backend), and a classifier with num_labels other than 1."""
    from jaxtune.backends import make_state_spec
    from jaxtune.config import ConfigError, load_config

    base = [f"model.from_hf={checkpoint}", *RUN]
    with pytest.raises(ValueError, match=r"eval.exact_match generates text, and objective.name=reward trains a score "
                                         r"head that generates none: set eval.exact_match=0"):
        load_config(None, [*base, "eval.exact_match=8"])
    with pytest.raises(ConfigError, match=r"is a reward model \(a sequence classifier's score head, no language-model "
                                          r"head\); this objective trains a language model"):
        make_state_spec(load_config(None, [f"model.from_hf={checkpoint}", "objective.name=dpo", "model.backend=torchax",
                                           "data.format=preference"]), None, MESH)
    with pytest.raises(ConfigError, match=r"is a reward model \(a sequence classifier's score head, no "
                                          r"language-model head\); objective.name=dpo trains a language model"):
        make_state_spec(load_config(None, [f"model.from_hf={checkpoint}", "objective.name=dpo",
                                           "data.format=preference"]), None, MESH)
    two = tmp_path / "two-labels"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, pad_token_id=PAD, num_labels=2)
    transformers.LlamaForSequenceClassification(config).save_pretrained(two)
    with pytest.raises(ConfigError, match=r"two-labels: config.json: a sequence classifier with num_labels=2; jaxtune "
                                          r"reads reward models, whose score head has one label"):
        make_state_spec(load_config(None, [f"model.from_hf={two}", *RUN]), None, MESH)
