"""A reward model as a GRPO reward (``objective.rewards: [{name: model, path: ...}]``, `jaxtune.rollout.model_reward`)
against TRL 1.16.0's ``GRPOTrainer._calculate_rewards`` with the same model as its reward function, and against
transformers' sequence classifier.

The reward model is a tiny random fp32 `LlamaForSequenceClassification` (num_labels 1, pad id 0) over the quickstart's
tokenizer (its BPE and chatml template, copied beside it), the policy the quickstart's SFT export, as the users'
chain has them. Tolerances:
  * conversational prompts: each completion's score vs GRPOTrainer's (the same rendered text)          rel <= 1e-5
  * text prompts: each score vs the classifier's logit on jaxtune's tokens of the sequence (its BOS, prompt,
    completion and EOS: what the reward model trained on; TRL scores the text without the EOS), batched and
    right-padded by transformers                                                                     rel <= 1e-5
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from helpers.compare import rel
from helpers.reward_models import classifier
from helpers.trl_reference import MESH, TOL, TRL_VERSION

from jaxtune.companions import load_reward_model
from jaxtune.config import ConfigError, RewardConfig, objective_config
from jaxtune.data import load_tokenizer_dir
from jaxtune.rollout.rewards import RewardError, make_rewards

torch = pytest.importorskip("torch", reason="the reward model is checked against transformers")
transformers = pytest.importorskip("transformers", reason="the reward model is a transformers checkpoint")

PROMPTS = ["What is 58 plus 67?", "Compute 4 plus 5.", "What is 12 plus 30?"]
COMPLETIONS = ["58+67: 8+7=15, 5+6+1=12, so 125.", "9", "It is 42.", "", "so 1234567"]


@pytest.fixture(scope="module")
def reward_dir(quickstart_sft_model, tmp_path_factory):
    return classifier(quickstart_sft_model, tmp_path_factory.mktemp("rm") / "model")


@pytest.fixture(scope="module")
def policy_tokenizer(quickstart_sft_model):
    return load_tokenizer_dir(quickstart_sft_model)


def loaded(path, policy_tokenizer, chat=True, **keys):
    return load_reward_model(RewardConfig(name="model", path=str(path), **keys), "objective.rewards[0]", MESH,
                             policy_tokenizer, chat)


def test_model_reward_scores_as_grpo_trainer(reward_dir, quickstart_sft_model, policy_tokenizer, tmp_path):
    """Conversations: the scores equal GRPOTrainer's ``_calculate_rewards`` with the checkpoint as its reward model
    (its own tokenizer and template), weighted beside a built-in reward as TRL weighs them."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from trl import GRPOConfig, GRPOTrainer

    assert trl.__version__ == TRL_VERSION
    prompts = [[{"role": "user", "content": PROMPTS[i % 3]}] for i in range(len(COMPLETIONS))]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    tokenizer = transformers.AutoTokenizer.from_pretrained(reward_dir)
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, num_generations=5,
                      per_device_train_batch_size=5, reward_weights=[0.5, 1.0])
    number = lambda completions, **_: [float(c[0]["content"].endswith("125.")) for c in completions]
    trainer = GRPOTrainer(model=str(quickstart_sft_model), reward_funcs=[str(reward_dir), number], args=args,
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["x"]}), processing_class=tokenizer,
                          reward_processing_classes=[tokenizer, None])
    ids = [[5]] * len(COMPLETIONS)
    theirs = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts, completions, ids).numpy()

    model = loaded(reward_dir, policy_tokenizer)
    cfg = objective_config(name="grpo", rewards=[{"name": "model", "path": str(reward_dir), "weight": 0.5},
                                                 {"name": "format", "pattern": r".*125\.", "weight": 1.0}])
    ours = make_rewards(cfg, {0: model}).score(prompts, COMPLETIONS, [{}] * 5, [1] * 5, ["t:1"] * 5)
    assert rel(ours.per_function[:, 0], theirs[:, 0]) <= TOL, (ours.per_function, theirs)
    np.testing.assert_array_equal(ours.per_function[:, 1], theirs[:, 1])
    assert rel(ours.total, theirs @ np.array([0.5, 1.0], np.float32)) <= TOL
    assert np.ptp(ours.per_function[:, 0]) > 1e-3  # the completions score apart


def test_text_prompts_score_as_the_classifier(reward_dir, policy_tokenizer):
    """Text prompts: the score of each sequence as jaxtune encodes it equals the classifier's logit on those tokens,
    batched and right-padded by transformers; scoring in chunks (``batch_size``) gives the same scores; one program
    per (rows, width) met."""
    model = loaded(reward_dir, policy_tokenizer, chat=False)
    prompts = [PROMPTS[i % 3] for i in range(len(COMPLETIONS))]
    scores, problems = model(prompts, COMPLETIONS)
    assert problems == {} and model.compiles == 1
    sequences = model.encode(prompts, COMPLETIONS)
    assert all(s[-1] == model.tokenizer.eos_id for s in sequences)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    width = max(map(len, sequences))
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        theirs = hf(ids, attention_mask=(torch.arange(width)[None] < torch.tensor([len(s) for s in sequences])[:, None])
                    .long()).logits[:, 0].numpy()
    assert rel(scores, theirs) <= TOL, (scores, theirs)

    chunked = loaded(reward_dir, policy_tokenizer, chat=False, batch_size=2)
    np.testing.assert_allclose(chunked(prompts, COMPLETIONS)[0], scores, rtol=1e-5, atol=1e-6)
    assert chunked.compiles == 1  # three chunks of 2 rows, one width
    model(prompts[:2], COMPLETIONS[:2])  # 2 rows, the same width bucket: a second program
    model(prompts[:2], ["x" * 40, "y"])  # a wider bucket
    model(prompts[:2], ["z", "w"])  # met before
    assert model.compiles == 3


def test_what_a_model_reward_refuses(reward_dir, quickstart_sft_model, policy_tokenizer, tmp_path):
    """One line each, naming the entry's key: no path; accuracy on a reward model; a causal LM (no score head); a
    path that is no model; a reward-model run with no checkpoint; a tokenizer without a chat template for
    conversations; one that cannot write the policy's text back; a classifier with two labels. A sequence longer
    than the reward model's context stops the run naming the row, or scores 0 (counted) under reward_errors: zero."""
    with pytest.raises(ValueError, match=r"reward model needs a path"):
        RewardConfig(name="model")
    with pytest.raises(ValueError, match=r"a reward model's score is no such count"):
        RewardConfig(name="model", path="x", accuracy=True)
    with pytest.raises(ConfigError, match=r"objective.rewards\[0\].path=.*: not a reward model \(a language model, no "
                                          r"score head\); train one with objective.name=reward"):
        loaded(quickstart_sft_model, policy_tokenizer)
    with pytest.raises(ConfigError, match=r"objective.rewards\[0\].path=\S*nowhere/rm: no such run directory"):
        loaded(tmp_path / "nowhere" / "rm", policy_tokenizer)
    plain = tmp_path / "plain"
    shutil.copytree(reward_dir, plain)
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(ConfigError, match=r"prompts are conversations, and the reward model's tokenizer has no chat "
                                          r"template"):
        loaded(plain, policy_tokenizer)
    words = tmp_path / "words"
    shutil.copytree(plain, words)
    from helpers.trl_reference import word_tokenizer
    for f in ("tokenizer.json", "tokenizer_config.json", "jaxtune_tokenizer.json"):
        (words / f).unlink(missing_ok=True)
    word_tokenizer(300).save_pretrained(words)
    with pytest.raises(ConfigError, match=r"the reward model's tokenizer cannot read the policy's text"):
        loaded(words, policy_tokenizer, chat=False)
    two = classifier(quickstart_sft_model, tmp_path / "two", num_labels=2)
    with pytest.raises(ConfigError, match=r"objective.rewards\[0\].path=.*two: .*num_labels=2; jaxtune reads reward "
                                          r"models, whose score head has one label"):
        loaded(two, policy_tokenizer)

    short = classifier(quickstart_sft_model, tmp_path / "short", max_position_embeddings=32)
    model = loaded(short, policy_tokenizer)
    prompts = [[{"role": "user", "content": "2+2?"}]] * 2
    for policy, outcome in (("raise", None), ("zero", 1)):
        cfg = objective_config(name="grpo", reward_errors=policy, rewards=[{"name": "model", "path": str(short)}])
        rewards = make_rewards(cfg, {0: model})
        if outcome is None:
            with pytest.raises(RewardError, match=r"reward 'model' cannot score the completion of the row t:2: its \d+ "
                                                  r"tokens exceed the reward model's context \(32\)"):
                rewards.score(prompts, ["4", "4" * 60], [{}] * 2, [1, 60], ["t:1", "t:2"])
        else:
            done = rewards.score(prompts, ["4", "4" * 60], [{}] * 2, [1, 60], ["t:1", "t:2"])
            assert done.errors == {"model": 1} and done.per_function[1, 0] == 0 and done.per_function[0, 0] != 0


def test_a_reward_model_run_scores_untrained_never(quickstart_sft_model, policy_tokenizer, tmp_path):
    """A reward-model run that has not saved yet is refused: its head is untrained."""
    from jaxtune.config import dump_config, load_config

    run = tmp_path / "rm-run"
    run.mkdir()
    cfg = load_config(None, [f"model.from_hf={quickstart_sft_model}", "objective.name=reward",
                             "data.format=preference", "data.sources=[synthetic:arithmetic-preferences]",
                             "data.chat_template=chatml", f"run_dir={run}"])
    dump_config(cfg, run / "config.yaml")
    with pytest.raises(ConfigError, match=r"the run has no checkpoint yet, so its score head is untrained"):
        loaded(run, policy_tokenizer)


def liking(model) -> None:
    """A reward model whose score rises with the share of "liked" tokens (every id ≡ 3 mod 10) in the sequence: no
    query or key (each position attends to all before it alike), values and output the identity, no MLP, and the
    score head reading the one embedding dimension that only liked tokens have."""
    d = model.config.hidden_size
    e = torch.randn(model.config.vocab_size, d)
    liked = torch.arange(model.config.vocab_size) % 10 == 3
    e[:, 0] = 0.0
    e[liked, 0] = 3.0
    model.model.embed_tokens.weight.copy_(e)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.zero_()
        layer.self_attn.k_proj.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(d))
        layer.self_attn.o_proj.weight.copy_(torch.eye(d))
        layer.mlp.down_proj.weight.zero_()
    model.score.weight.zero_()
    model.score.weight[0, 0] = 1.0


def test_grpo_learns_from_a_reward_model(quickstart_sft_model, tmp_path, data_cache):
    """GRPO through `train()` with a reward model as its only reward: a tiny policy from scratch (the quickstart's
    tokenizer and chat template) learns to write what the model likes: the held-out reward (greedy answers to 16
    held-out prompts, scored by the model) and the sampled completions' reward rise. `jaxtune eval` of the run scores
    its held-out answers as its last evaluation did."""
    from helpers.run_outputs import metric_rows

    from jaxtune.config import load_config
    from jaxtune.evaluate import evaluate
    from jaxtune.loop import train

    rm = classifier(quickstart_sft_model, tmp_path / "rm", liking, num_hidden_layers=1, num_key_value_heads=2)
    run = tmp_path / "run"
    cfg = load_config("grpo-quickstart", [
        "model.from_hf=null", "model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64",
        "model.n_head=4", "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=128", "tokenizer.kind=hf",
        f"tokenizer.path={quickstart_sft_model}", f"run_dir={run}", f"data.cache_dir={data_cache}",
        f"objective.rewards=[{{name: model, path: {rm}}}]", "objective.prompts_per_step=4",
        "objective.num_generations=8", "objective.max_completion_length=16", "optim.lr=1e-2", "optim.warmup_steps=1",
        "train.steps=15", "eval.every=15", "eval.exact_match=16", "checkpoint.every=15", "logging.every=1",
        "logging.progress=false", "logging.tensorboard=false"])
    train(cfg)
    held_out = [r["reward"] for r in metric_rows(run, "eval")]
    rewards = [r["rewards/model/mean"] for r in metric_rows(run, "train")]
    assert len(held_out) == 2 and held_out[1] > held_out[0] + 0.5, held_out
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.3, rewards
    result = evaluate(str(run), [])  # `jaxtune eval` of the run loads its reward model too: the last evaluation's score
    assert (result["step"], result["prompts"]) == (15, 16) and result["reward"] == pytest.approx(held_out[1], rel=1e-5)
