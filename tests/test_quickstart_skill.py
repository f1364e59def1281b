"""The fine-tuning quickstart teaches a skill and says so (issue items 13 and 14).

13: ``synthetic:arithmetic`` asks every sum once, worked digit by digit, so held-out sums are unseen; the training
loop's evaluations score held-out exact match (``eval.exact_match``) into metrics.jsonl and report.md, and an empty
answer shows as ``(empty)``. The real 3-minute quickstart run (≥ 80% held-out exact match) is measured by hand, not
here: these tests use tiny models and a few steps.
14: ``synthetic:chat-small``, human-written chat shipped with the package under its licence, trains.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import ConfigError, load_config
from jaxtune.data import load_tokenizer, make_training_data, question
from jaxtune.data.sft import Encoder, prepare_sft
from jaxtune.data.synthetic import CHAT_SMALL, GENERATORS
from jaxtune.evaluator import EMPTY_ANSWER, Evaluator, exact_match, shown
from jaxtune.loop import train
from jaxtune.train.metrics import StepLog
from jaxtune.train.objectives import make_objective
from jaxtune.train.step import jit_steps

ROOT = Path(__file__).resolve().parents[1]
EQUATION = re.compile(r"(\d)\+(\d)(\+1)?=(\d+)")

# A tiny chat model on generated sums, with the quickstart's tokenizer settings; steps and evaluation per test.
TINY_CHAT = [
    "model.family=llama", "model.preset=tiny", "model.n_layer=2", "model.d_model=64", "model.n_head=4",
    "model.n_kv_head=2", "model.d_ff=128", "model.max_seq_len=128",
    "data.format=messages", "data.sources=[synthetic:arithmetic]", "data.chat_template=chatml", "data.seq_len=128",
    "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=['<|im_start|>','<|im_end|>']",
    "train.batch_size=4", "eval.batches=1", "eval.temperature=0", "eval.max_new_tokens=32",
    "checkpoint.every=1000", "logging.every=10", "logging.progress=false", "logging.tensorboard=false",
]


def _cfg(tmp_path: Path, data_cache: Path, *extra: str):
    return load_config(None, [*TINY_CHAT, f"data.cache_dir={data_cache}", f"run_dir={tmp_path / 'run'}", *extra])


# --- the generated task --------------------------------------------------------------------------------------------

def test_every_sum_once_worked_right():
    """10,000 rows: each sum a + b (0 ≤ a, b ≤ 99) asked once, so a held-out row is a sum never trained on; each
    answer's ones and tens steps and its total are right (checked by computing them, not by the generator)."""
    rows = list(GENERATORS["arithmetic"]())
    seen = set()
    for row in rows:
        user, assistant = (m["content"] for m in row["messages"])
        a, b = map(int, re.search(r"(\d+) plus (\d+)", user).groups())
        seen.add((a, b))
        (o1, o2, _, ones), (t1, t2, carry, tens) = EQUATION.findall(assistant)
        assert (int(o1), int(o2)) == (a % 10, b % 10) and int(ones) == a % 10 + b % 10, assistant
        assert (int(t1), int(t2)) == (a // 10, b // 10) and bool(carry) == (int(ones) >= 10), assistant
        assert int(tens) == a // 10 + b // 10 + bool(carry), assistant
        assert assistant.endswith(f", so {a + b}."), assistant
    assert len(rows) == len(seen) == 100 * 100


def test_the_careless_tutor_forgets_carries_only():
    """synthetic:arithmetic-careless (the RL quickstarts' SFT data): the arithmetic rows, same sums, order and
    questions; a sum without a carry is worked right, and a sum with one forgets it in 85% ± 2 of the 4,500 (a binomial
    draw: ±2 points is over 4 standard deviations), its working and total agreeing with the slip: the RL quickstarts
    start near 56% because of exactly this mistake, which sampling still avoids now and then."""
    right, careless = list(GENERATORS["arithmetic"]()), list(GENERATORS["arithmetic-careless"]())
    forgot = carries = 0
    for good, row in zip(right, careless, strict=True):
        assert good["messages"][0] == row["messages"][0]
        answer = row["messages"][1]["content"]
        (_, _, _, ones), (t1, t2, carry, tens) = EQUATION.findall(answer)
        if int(ones) < 10:
            assert answer == good["messages"][1]["content"]
            continue
        carries += 1
        forgot += not carry
        assert int(tens) == int(t1) + int(t2) + bool(carry), answer
        assert answer.endswith(f", so {int(tens) * 10 + int(ones) % 10}."), answer
    assert carries == 4500 and abs(forgot / carries - 0.85) <= 0.02, (forgot, carries)


def test_quickstart_tokenizer_keeps_digits_apart(data_cache):
    """The recipe's 300-token BPE has no token holding two digits (so a sum is learnt digit by digit), and its held-out
    rows are all available as questions (none truncated)."""
    cfg = load_config("finetune-quickstart", [f"data.cache_dir={data_cache}"])
    tok = load_tokenizer(cfg.tokenizer, cfg.data)
    assert tok.vocab_size == 300
    tokens = [tok.decode([i]) for i in range(tok.vocab_size)]
    multi = [t for t in tokens if sum(c.isdigit() for c in t) > 1]
    assert multi == []
    sft = prepare_sft(cfg.data, tok)
    assert len(sft.held_out) == sft.stats.val_examples >= cfg.eval.exact_match


# --- exact match ---------------------------------------------------------------------------------------------------

def test_question_is_what_training_saw(tmp_path, data_cache):
    """`question` gives the prompt ids the training encoding has before the last reply, and that reply's content:
    for a generated sum and for a multi-turn conversation of the shipped chat set."""
    for source in ("synthetic:arithmetic", "synthetic:chat-small"):
        cfg = _cfg(tmp_path, data_cache, f"data.sources=[{source}]", "data.seq_len=512", "model.max_seq_len=512")
        tok = load_tokenizer(cfg.tokenizer, cfg.data)
        examples = prepare_sft(cfg.data, tok).held_out
        multi_turn = [ex for ex in examples if len(ex.messages) > 2]
        for ex in examples[:3] + multi_turn[:2]:
            prompt, reference = question(tok, ex)
            (enc,) = Encoder(tok, cfg.data).encode([ex])
            assert list(enc.ids[:len(prompt)]) == prompt
            tail, trained = enc.ids[len(prompt):], enc.mask[len(prompt):]
            assert tok.decode(list(tail[trained])) == reference + "<|im_end|>"
        assert source == "synthetic:arithmetic" or multi_turn


def test_exact_match_of_references_and_wrong_answers(tmp_path, data_cache):
    """Held-out references decoded from their own ids score 1 against themselves; answers to other questions score
    0; surrounding whitespace does not count, anything else does."""
    cfg = _cfg(tmp_path, data_cache)
    tok = load_tokenizer(cfg.tokenizer, cfg.data)
    refs = [question(tok, ex)[1] for ex in prepare_sft(cfg.data, tok).held_out[:20]]
    assert exact_match([tok.decode(tok.encode_chat([r])[0]) for r in refs], refs) == 1.0
    assert exact_match(refs[1:] + refs[:1], refs) == 0.0
    assert exact_match(["  42.\n", "42", ""], ["42.", "42.", "42."]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        exact_match([], [])


def test_a_model_that_answers_right_scores_1_and_before_0(tmp_path, data_cache):
    """End to end through the training loop: a tiny model memorising 8 rows, held out as themselves (val_sources), is
    scored 0 before training and 1 after; metrics.jsonl's eval rows and report.md's table carry exact match, and the
    report states it before and after."""
    rows = [next(r for i, r in enumerate(GENERATORS["arithmetic"]()) if i == k) for k in range(8)]
    path = tmp_path / "eight.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, data_cache, f"data.sources=[{path}]", f"data.val_sources=[{path}]", "train.steps=150",
               "optim.lr=1e-2", "optim.warmup_steps=10", "eval.exact_match=8", "eval.batches=2")
    result = train(cfg)
    assert [(e["step"], e["exact_match"]) for e in result.evals] == [(0, 0.0), (150, 1.0)]
    evals = [json.loads(line) for line in (cfg.run_path / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["exact_match"]) for e in evals if e["kind"] == "eval"] == [(0, 0.0), (150, 1.0)]
    report = (cfg.run_path / "report.md").read_text()
    assert "| step | held-out loss | perplexity | exact match |" in report
    assert "| 150 |" in report and "| 100.0% (8/8) |" in report
    assert "0.0% (0/8) before (step 0), 100.0% (8/8) after (step 150)" in report


def test_empty_answers_show_as_empty(tmp_path, data_cache):
    """A real model with every weight zero gives equal logits, so greedy decoding picks token 0 (EOS) and stops: empty
    answers, which score 0 and read `(empty)` in the samples and report.md, not blank lines."""
    assert shown("") == shown(" \n\n ") == EMPTY_ANSWER and shown(" 42") == " 42"
    cfg = _cfg(tmp_path, data_cache, "eval.exact_match=4", "eval.prompts=['What is 2 plus 2?']")
    tok = load_tokenizer(cfg.tokenizer, cfg.data)
    data = make_training_data(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0, eval_batches=1)
    spec = make_state_spec(cfg, tok.vocab_size, sharding.make_mesh(-1, 1, 1))
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train)
    cfg.run_path.mkdir(parents=True)
    evaluator = Evaluator(cfg, steps, tok, data.eval_batches, cfg.run_path, StepLog(cfg.run_path, cfg, 0,
                          spec.model_cfg), data.eval_examples)
    zero = jax.tree.map(jnp.zeros_like, spec.init(0).params)
    with sharding.use_mesh(spec.mesh):
        evaluator.run(0, zero, spec.load_frozen(0))
        evaluator.run(1, zero, spec.load_frozen(0))
    evaluator.write_report()
    data.close()
    assert evaluator.evals[-1]["exact_match"] == 0.0
    assert evaluator.samples == ["user: What is 2 plus 2?\nassistant: (empty)"]
    report = (cfg.run_path / "report.md").read_text()
    assert report.count("assistant: (empty)") == 2 and "\n\n\n\n" not in report


def test_exact_match_needs_held_out_rows(tmp_path, data_cache):
    """eval.exact_match with nothing held out is an error naming the key, before any step."""
    cfg = _cfg(tmp_path, data_cache, "data.val_fraction=0", "eval.exact_match=4", "train.steps=1")
    with pytest.raises(ConfigError, match="eval.exact_match=4"):
        train(cfg)


# --- item 14: the shipped chat set ---------------------------------------------------------------------------------

def test_chat_small_ships_with_its_licence_and_trains(tmp_path, data_cache):
    """chat_small.jsonl is package data with its licence beside it (BSD-3-Clause, the copyright line kept), readable
    as synthetic:chat-small, and a tiny model trains on it: the loss falls and the held-out loss is measured."""
    readme = CHAT_SMALL.with_name("chat_small.README.md").read_text()
    assert "BSD-3-Clause" in readme and "Copyright (c) 2017, Gunther Cox" in readme
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"data/chat_small.jsonl", "data/chat_small.README.md"} <= set(package_data["jaxtune"])
    rows = [json.loads(line) for line in CHAT_SMALL.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 552 and all(r["messages"][-1]["role"] == "assistant" for r in rows)

    cfg = _cfg(tmp_path, data_cache, "data.sources=[synthetic:chat-small]", "tokenizer.vocab_size=512",
               "train.steps=20", "train.batch_size=8", "optim.lr=3e-3", "optim.warmup_steps=2", "eval.exact_match=4")
    result = train(cfg)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert result.step == 20 and np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert result.eval_loss is not None and result.evals[-1]["exact_match"] is not None
