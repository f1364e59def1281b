"""Prompts (jaxtune.data.prompts, data.format: prompts): TRL's GRPO prompt forms -> prompt ids, at most
max_prompt_tokens (left-truncated) -> (P,) items and (B, P) batches whose row index finds the row's other fields.

The tokenizers are `helpers.chat_templates.build_tokenizer`'s: a tiny byte-level BPE trained offline, here with
ChatML's special tokens and no template of its own (data.chat_template: chatml sets it), Llama 3's (its template
renders a BOS), and a plain one for text prompts."""

from __future__ import annotations

import pickle
import re
from collections import Counter

import numpy as np
import pytest
from helpers.chat_templates import FAMILIES, build_tokenizer
from helpers.rows import (
    A,
    S,
    U,
    assert_bad_row_message,
    assert_first_bad_line_named,
    bad_rows_file,
    build_chat_tokenizers,
    chatml_cfg,
    fresh,
    m,
    parsed,
    phrases,
    write_jsonl,
)

from jaxtune.config import DataConfig
from jaxtune.data import DataError, PromptData, PromptRows, prepare_prompts
from jaxtune.data.formats import FORMATS, REASONS, Prompt, detect_format, field_names, renders_chat
from jaxtune.data.pipeline import make_training_data, test_sequences
from jaxtune.data.prompts import PromptStats, encode_prompts, load_prompts
from jaxtune.data.row_policy import DROP_REASONS, completion_settings
from jaxtune.data.rows import BadRow, read_rows
from jaxtune.data.synthetic import arithmetic, arithmetic_prompts

LIMIT = "data.seq_len - objective.max_completion_length"


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    root = build_chat_tokenizers(tmp_path_factory.mktemp("tokenizers"))
    template, specials, eos, bos, _ = FAMILIES["llama3"]
    build_tokenizer(root / "llama3", template, specials, eos, bos)
    return root


@pytest.fixture
def tok(tok_dirs):
    return fresh(tok_dirs)


def cfg(**kw) -> DataConfig:
    return chatml_cfg("prompts", **kw)


def load(tok, data_cfg: DataConfig, max_prompt_tokens: int = 256, stats: PromptStats | None = None):
    completion_settings(data_cfg, tok)  # sets data.chat_template, as prepare_prompts does
    return load_prompts(data_cfg.sources, data_cfg, tok, max_prompt_tokens,
                        stats if stats is not None else PromptStats())


def rows_of(data: PromptRows) -> list[list[int]]:
    return [data.ids(i) for i in range(len(data))]


def check_item(item: dict, ids: list[int], row: int, max_prompt_tokens: int) -> None:
    """The item holds ``ids`` from position 0, then zeros, their length, and its own index."""
    assert {k: (v.shape, v.dtype) for k, v in item.items()} == {
        "prompt": ((max_prompt_tokens,), np.int32), "prompt_len": ((), np.int32), "row": ((), np.int32)}
    assert item["prompt"].tolist() == ids + [0] * (max_prompt_tokens - len(ids))
    assert (int(item["prompt_len"]), int(item["row"])) == (len(ids), row)


# --- 1. the forms ---

SYSTEM = "Réponds brièvement."
PROMPT = [m(S, SYSTEM), m(U, "What is 2+2?"), m(A, "4."), m(U, "And 3+3? Say it with an emoji 🙂")]
# PROMPT as ChatML renders it with the generation prompt, written out by hand.
RENDERED = ("<|im_start|>system\nRéponds brièvement.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n4.<|im_end|>\n<|im_start|>user\nAnd 3+3? Say it with an emoji 🙂<|im_end|>\n"
            "<|im_start|>assistant\n")
TEXT = "Q: 2+2? <|endoftext|>\nA:"


def test_each_form_gives_the_prompt_ids(tok, tmp_path):
    rows = [{"prompt": TEXT, "answer": "4"},
            {"prompt": PROMPT, "answer": "6"},
            {"messages": PROMPT, "answer": "6"},
            {"messages": [*PROMPT, m(A, "6 🙂")], "answer": 6, "id": "x"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    data_cfg = cfg(sources=[str(path)])
    assert [parsed(r, data_cfg) for r in rows] == [
        Prompt(text=TEXT, fields={"answer": "4"}), Prompt(messages=tuple(PROMPT), fields={"answer": "6"}),
        Prompt(messages=tuple(PROMPT), fields={"answer": "6"}),
        Prompt(messages=tuple(PROMPT), fields={"answer": 6, "id": "x", "reference": "6 🙂"})]

    data = prepare_prompts(data_cfg, tok, max_prompt_tokens=80)
    assert isinstance(data, PromptData) and data.val is None and data.max_prompt_tokens == 80
    text_ids = tok.encode_batch([TEXT])[0]  # raw text: no template, "<|endoftext|>" spelled out as text
    assert tok.eos_id not in text_ids
    chat_ids = tok.encode_chat([RENDERED])[0]
    assert chat_ids == tok.encode_chat([tok.apply_chat_template(PROMPT, add_generation_prompt=True)])[0]
    im_start = tok._tok.token_to_id("<|im_start|>")
    assert chat_ids.count(im_start) == 5 and tok.decode(chat_ids) == RENDERED  # the specials are single ids
    assert rows_of(data.train) == [text_ids, chat_ids, chat_ids, chat_ids]
    for i in range(4):
        check_item(data.train[i], data.train.ids(i), i, 80)
        assert data.train.where(i) == f"{path}:{i + 1}"
    assert [data.train.fields(i) for i in range(4)] == [{"answer": "4"}, {"answer": "6"}, {"answer": "6"},
                                                        {"answer": 6, "id": "x", "reference": "6 🙂"}]
    assert [data.train.prompt(i) for i in range(4)] == [TEXT, PROMPT, PROMPT, PROMPT]  # the reply is not the prompt
    # What a reward function gets is a copy: changing it changes nothing.
    data.train.fields(3)["answer"] = 7
    data.train.prompt(1)[0]["content"] = "changed"
    assert data.train.fields(3)["answer"] == 6 and data.train.prompt(1) == PROMPT
    assert data.stats.lines() == [(f"prompt data: 4 rows -> 4 training and 0 held-out prompts; the longest "
                                   f"{len(chat_ids)} tokens of at most 80")]


def test_template_with_bos(tok_dirs):
    """A template that renders the BOS: it is the one special id, first, as at inference."""
    llama = fresh(tok_dirs, "llama3")
    data_cfg = cfg(chat_template=None, sources=["unused"])
    (enc,) = encode_prompts(llama, [parsed({"prompt": [m(S, SYSTEM), m(U, "Hi")]}, data_cfg)])
    rendered = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nRéponds brièvement.<|eot_id|>"
                "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert enc.tolist() == llama.encode_chat([rendered])[0]
    assert enc[0] == llama._tok.token_to_id("<|begin_of_text|>")


def test_text_prompts_need_no_template(tok_dirs, tmp_path):
    plain = fresh(tok_dirs, "plain")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": TEXT}, {"prompt": "naïve café 🙂"}])
    data = prepare_prompts(cfg(chat_template=None, sources=[str(path)]), plain, max_prompt_tokens=64)
    assert rows_of(data.train) == [plain.encode(TEXT), plain.encode("naïve café 🙂")]
    assert plain.chat_template is None
    # A conversational prompt does need one: the error says what to set.
    chat = write_jsonl(tmp_path / "c.jsonl", [{"prompt": TEXT}, {"prompt": [m(U, "Hi")]}])
    with pytest.raises(DataError, match=r"no chat template.*set data.chat_template"):
        prepare_prompts(cfg(chat_template=None, sources=[str(chat)]), plain, max_prompt_tokens=64)


def test_renamed_fields(tok):
    data_cfg = cfg(fields={"prompt": "question", "role": "from", "content": "value"})
    row = {"question": [{"from": "user", "value": "Hi"}], "answer": 3, "meta": {"tags": ["a"]}}
    assert parsed(row, data_cfg) == Prompt(messages=(m(U, "Hi"),), fields={"answer": 3, "meta": {"tags": ["a"]}})
    # The default prompt field is now one more field of the row, and the row has no prompt.
    with pytest.raises(BadRow) as err:
        parsed({"prompt": [m(U, "Hi")]}, data_cfg)
    assert err.value.reason == "missing_field" and "no 'question' or 'messages' field" in err.value.detail
    convo = cfg(fields={"messages": "conversation"})
    assert parsed({"conversation": [m(U, "Hi"), m(A, "Hello")], "messages": 1}, convo) == Prompt(
        messages=(m(U, "Hi"),), fields={"messages": 1, "reference": "Hello"})
    with pytest.raises(DataError, match=r"data.fields.completion does not apply to data.format=prompts"):
        field_names(cfg(fields={"completion": "x"}))


@pytest.mark.parametrize("row,fmt", [
    ({"prompt": "a"}, "prompts"),
    ({"prompt": [m(U, "a")], "answer": "1"}, "prompts"),
    ({"prompt": "a", "completion": "b"}, "prompt_completion"),
    ({"prompt": "a", "chosen": "b", "rejected": "c"}, "preference"),
    ({"messages": [m(U, "a"), m(A, "b")]}, "messages"),
])
def test_detect_format(tmp_path, row, fmt):
    assert detect_format(str(write_jsonl(tmp_path / "rows.jsonl", [row]))) == fmt
    assert renders_chat("prompts")


def test_loss_on_other_than_assistant_is_refused(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match=r"data.loss_on=all does not apply to data.format=prompts"):
        prepare_prompts(cfg(sources=[str(path)], loss_on="all"), tok, max_prompt_tokens=8)


# --- 2. bad rows ---

# (reason, raw line, what the error says)
BAD = [
    ("non_utf8", b'{"prompt": "caf\xe9"}', "not valid UTF-8"),
    ("invalid_json", b'{"prompt": ', "not valid JSON"),
    ("missing_field", {"answer": "1"}, "no 'prompt' or 'messages' field (found ['answer'])"),
    ("missing_field", {"prompt": [{"role": U}]}, "no 'content' field"),
    ("missing_field", {"messages": [{"content": "x"}]}, "no 'role' field"),
    ("bad_type", {"prompt": 3}, "'prompt' must be a string (text) or a non-empty list of messages (it is int)"),
    ("bad_type", {"prompt": []}, "(it is an empty list)"),
    ("bad_type", {"prompt": ["hi"]}, "'prompt' message 0 is str, not an object"),
    ("bad_type", {"prompt": [m(U, 3)]}, "field 'content' is int, not a string"),
    ("bad_type", {"messages": "hi"}, "'messages' must be a non-empty list of turns"),
    ("bad_type", [1, 2], "a row must be a JSON object, not list"),
    ("unknown_role", {"prompt": [m("human", "p")]}, "'prompt' message 0 has role 'human'"),
    ("unknown_role", {"messages": [m(U, "p"), m("gpt", "q")]}, "turn 1 has role 'gpt'"),
    ("role_order", {"prompt": [m(U, "p"), m(A, "q")]}, "the prompt's last turn is 'assistant', not 'user'"),
    ("role_order", {"prompt": [m(S, "s")]}, "the prompt's last turn is 'system', not 'user'"),
    ("role_order", {"prompt": [m(A, "a"), m(U, "p")]}, "turn 0 is 'assistant' where 'user' was expected"),
    ("role_order", {"messages": [m(U, "p"), m(U, "q")]}, "turn 1 is 'user' where 'assistant' was expected"),
    ("role_order", {"messages": [m(S, "s")]}, "the conversation does not end with a user or an assistant turn"),
    ("role_order", {"messages": [m(A, "a")]}, "turn 0 is 'assistant' where 'user' was expected"),
    ("empty_content", {"prompt": " \n"}, "the prompt is empty"),
    ("empty_content", {"prompt": [m(U, "")]}, "'prompt' message 0 (user) has empty content"),
    ("empty_content", {"messages": [m(U, "p"), m(A, " ")]}, "turn 1 (assistant) has empty content"),
    ("bad_tool_call", {"prompt": [m(U, "p"), {"role": A, "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, {"role": "tool", "content": "1"},
        m(U, "q")]}, "(f): its arguments are not valid JSON"),
]
GOOD_ROWS = [{"prompt": [m(U, "Hi")], "answer": "1"}, {"messages": [m(U, "2+2?"), m(A, "4")]}, {"prompt": "Ciao"}]


def test_bad_rows_cover_every_reason():
    assert {reason for reason, _, _ in BAD} == {"non_utf8", "invalid_json", *FORMATS["prompts"].reasons}
    assert set(FORMATS["prompts"].reasons) == {"missing_field", "bad_type", "unknown_role", "role_order",
                                               "empty_content", "bad_tool_call"}
    assert set(REASONS) <= set(DROP_REASONS)


def test_bad_rows_drop_counts_each_reason(tok, tmp_path):
    data_cfg = cfg(sources=[str(bad_rows_file(tmp_path / "mixed.jsonl", GOOD_ROWS, BAD))], bad_rows="drop")
    data = prepare_prompts(data_cfg, tok, max_prompt_tokens=64)
    assert [data.train.prompt(i) for i in range(3)] == [[m(U, "Hi")], [m(U, "2+2?")], "Ciao"]
    assert [data.train.fields(i) for i in range(3)] == [{"answer": "1"}, {"reference": "4"}, {}]
    assert data.stats.dropped == Counter(reason for reason, _, _ in BAD)
    assert (data.stats.rows, data.stats.truncated) == (len(BAD) + 3, 0)
    assert data.stats.lines()[1] == ("dropped rows: non_utf8 1, invalid_json 1, missing_field 3, bad_type 6, "
                                     "unknown_role 2, role_order 6, empty_content 3, bad_tool_call 1")
    from jaxtune.data.formats import iter_turn_texts  # what a BPE learns from: the good prompts' texts

    assert list(iter_turn_texts(data_cfg)) == ["Hi", "2+2?", "Ciao"]


def test_bad_rows_raise_names_the_first_bad_line(tok, tmp_path):
    read = lambda path: prepare_prompts(cfg(sources=[str(path)]), tok, max_prompt_tokens=64)
    assert_first_bad_line_named(read, bad_rows_file(tmp_path / "mixed.jsonl", GOOD_ROWS, BAD))


@pytest.mark.parametrize("k", range(len(BAD)), ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_bad_row_raise_message(tok, tmp_path, k):
    _, line, message = BAD[k]
    read = lambda path: load(tok, cfg(sources=[str(path)]))
    assert_bad_row_message(read, tmp_path / "one.jsonl", GOOD_ROWS, line, message)


# --- 3. length ---

SHORT = {"prompt": [m(U, "Hi")]}
LONG = {"prompt": [m(S, "Be brief."), m(U, " ".join(f"question{i}" for i in range(40)))], "answer": "yes"}
LONG_TEXT = {"prompt": " ".join(f"w{i}" for i in range(40))}


@pytest.fixture
def overlong(tok, tmp_path):
    """(path of SHORT, LONG, LONG_TEXT, the limit, their full ids)."""
    path = write_jsonl(tmp_path / "p.jsonl", [SHORT, LONG, LONG_TEXT])
    full = [r.ids.tolist() for r in load(tok, cfg(sources=[str(path)]), max_prompt_tokens=10_000)]
    limit = len(full[0]) + 3
    assert len(full[1]) > limit and len(full[2]) > limit
    return path, limit, full


def test_overlong_truncate_keeps_the_last_tokens(tok, overlong):
    path, limit, full = overlong
    data = prepare_prompts(cfg(sources=[str(path)]), tok, max_prompt_tokens=limit)
    assert rows_of(data.train) == [full[0], full[1][-limit:], full[2][-limit:]]
    # The end of the prompt survives: the generation prompt the reply follows.
    assert tok.decode(data.train.ids(1)).endswith("question39<|im_end|>\n<|im_start|>assistant\n")
    assert data.train.fields(1) == {"answer": "yes"} and data.train.prompt(1) == LONG["prompt"]  # as given
    assert (data.stats.truncated, data.stats.dropped) == (2, Counter())
    assert "truncated prompts (data.overlong=truncate): 2" in data.stats.lines()
    for i in range(3):
        check_item(data.train[i], data.train.ids(i), i, limit)
    # A prompt of exactly the limit is whole; one token more loses its first.
    longest = max(len(ids) for ids in full)
    exact = prepare_prompts(cfg(sources=[str(path)]), tok, max_prompt_tokens=longest)
    assert rows_of(exact.train) == full and exact.stats.truncated == 0
    less = prepare_prompts(cfg(sources=[str(path)]), tok, max_prompt_tokens=longest - 1)
    assert rows_of(less.train) == [ids[1:] if len(ids) == longest else ids for ids in full]
    assert less.stats.truncated == 1


def test_max_prompt_length_cuts_before_the_overlong_rule(tok, overlong):
    """data.max_prompt_length: a longer prompt keeps its last tokens whatever data.overlong says (raise here),
    counted apart; the training loop's limit (data.seq_len less the completion) still applies after it."""
    path, limit, full = overlong
    data = prepare_prompts(cfg(sources=[str(path)], overlong="raise", max_prompt_length=limit), tok,
                           max_prompt_tokens=10_000)
    assert rows_of(data.train) == [full[0], full[1][-limit:], full[2][-limit:]]
    assert (data.stats.prompts_cut, data.stats.truncated) == (2, 0)
    assert "prompts cut to their last data.max_prompt_length tokens: 2" in data.stats.lines()
    with pytest.raises(DataError, match=":2: "):  # cut to limit + 1, then over the loop's limit: raise
        prepare_prompts(cfg(sources=[str(path)], overlong="raise", max_prompt_length=limit + 1), tok,
                        max_prompt_tokens=limit)


def test_overlong_drop(tok, overlong):
    path, limit, full = overlong
    data = prepare_prompts(cfg(sources=[str(path)], overlong="drop"), tok, max_prompt_tokens=limit)
    assert rows_of(data.train) == [full[0]] and data.train.where(0) == f"{path}:1"
    assert (data.stats.truncated, data.stats.dropped) == (0, Counter({"overlong": 2}))
    assert data.stats.lines()[1] == "dropped rows: overlong 2"


def test_overlong_raise(tok, overlong):
    path, limit, full = overlong
    with pytest.raises(DataError) as err:
        prepare_prompts(cfg(sources=[str(path)], overlong="raise"), tok, max_prompt_tokens=limit)
    assert str(err.value) == (f"{path}:2: {len(full[1])} tokens, more than {LIMIT} = {limit}; set "
                              "data.overlong=truncate or drop, or raise data.seq_len or lower "
                              "objective.max_completion_length")
    with pytest.raises(ValueError, match=r"max_prompt_tokens=0"):
        prepare_prompts(cfg(sources=[str(path)]), tok, max_prompt_tokens=0)


# --- 4. held out, batches ---

def many_prompts(n: int, salt: str = "") -> list[dict]:
    say = phrases(n, salt)
    out = []
    for i in range(n):
        question = f"{salt}q{i} {say()}"
        if i % 3 == 0:
            out.append({"prompt": [m(U, question)], "answer": str(i)})
        elif i % 3 == 1:
            out.append({"messages": [m(U, question), m(A, say())], "answer": str(i)})
        else:
            out.append({"prompt": question, "answer": str(i)})
    return out


def test_held_out_split(tok, tmp_path):
    distinct = many_prompts(60)
    path = write_jsonl(tmp_path / "p.jsonl", distinct + distinct[:30] + distinct[:10])  # duplicates
    data_cfg = cfg(sources=[str(path)], val_fraction=0.3)
    data = prepare_prompts(data_cfg, tok, max_prompt_tokens=48)
    train, val = rows_of(data.train), rows_of(data.val)
    assert len(train) + len(val) == 100 and train and val
    assert not {tuple(r) for r in train} & {tuple(r) for r in val}  # identical prompts share a split
    assert (data.stats.train_prompts, data.stats.val_prompts) == (len(train), len(val))
    again = prepare_prompts(data_cfg, tok, max_prompt_tokens=48)
    assert rows_of(again.val) == val and rows_of(again.train) == train  # deterministic
    # Each split keeps its rows' order, fields and places.
    everything = load(tok, data_cfg, 48)
    for split in (data.train, data.val):
        picked = [r for r in everything if r.where in {split.where(i) for i in range(len(split))}]
        assert [r.ids.tolist() for r in picked] == rows_of(split)
        assert [r.prompt.fields["answer"] for r in picked] == [split.fields(i)["answer"] for i in range(len(split))]

    other = write_jsonl(tmp_path / "held.jsonl", many_prompts(7, salt="held"))
    with_val = prepare_prompts(data_cfg.model_copy(update={"val_sources": [str(other)]}), tok, max_prompt_tokens=48)
    assert (with_val.stats.train_prompts, with_val.stats.val_prompts) == (100, 7)
    expected = load(tok, data_cfg.model_copy(update={"sources": [str(other)]}), 48)
    assert rows_of(with_val.val) == [r.ids.tolist() for r in expected]
    assert [with_val.val.where(i) for i in range(7)] == [f"{other}:{i + 1}" for i in range(7)]


def test_make_training_data_batches_prompts(tok, tmp_path):
    rows = many_prompts(40)
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", rows))], val_fraction=0.2)
    with pytest.raises(ValueError, match=r"data.format=prompts needs max_prompt_tokens"):
        make_training_data(data_cfg, tok, batch_size=4, seed=0, eval_batches=10)
    data = make_training_data(data_cfg, tok, batch_size=4, seed=0, eval_batches=10, max_prompt_tokens=32)
    try:
        prompts = data.prompts
        assert data.eval_batches == [] and data.eval_examples == [] and data.pairs is None
        assert data.report == prompts.stats.lines() and data.report[0].startswith("prompt data: 40 rows -> ")
        assert len(prompts.train) + len(prompts.val) == 40 and prompts.max_prompt_tokens == 32
        seen = set()
        for _ in range(len(prompts.train) // 4 + 1):
            batch = next(data.train_iter)
            assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
                "prompt": ((4, 32), np.int32), "prompt_len": ((4,), np.int32), "row": ((4,), np.int32)}
            for b in range(4):
                row, n = int(batch["row"][b]), int(batch["prompt_len"][b])
                seen.add(row)
                assert batch["prompt"][b, :n].tolist() == prompts.train.ids(row) and not batch["prompt"][b, n:].any()
                # The row index finds the row's fields: its answer names its question.
                answer = prompts.train.fields(row)["answer"]
                question = rows[int(answer)]
                assert prompts.train.prompt(row) == (question.get("prompt") or question["messages"][:1])
                assert prompts.train.where(row) == f"{data_cfg.sources[0]}:{int(answer) + 1}"
        assert len(seen) > len(prompts.train) // 2  # shuffled over the whole split
    finally:
        data.close()


def test_test_sequences_refuses_prompts(tok, tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", many_prompts(3))
    with pytest.raises(DataError, match=r"held-out loss does not apply to data.format=prompts"):
        test_sequences(cfg(sources=["unused.jsonl"]), tok, str(path))


def test_rows_pickle(tok, tmp_path):
    """Grain pickles its source into worker processes: it travels whole."""
    data = prepare_prompts(cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", many_prompts(9)))]), tok,
                           max_prompt_tokens=24)
    back = pickle.loads(pickle.dumps(data.train))
    assert len(back) == 9 and rows_of(back) == rows_of(data.train)
    for i in range(9):
        assert all(np.array_equal(back[i][k], v) for k, v in data.train[i].items())
        assert (back.fields(i), back.prompt(i), back.where(i)) == (data.train.fields(i), data.train.prompt(i),
                                                                   data.train.where(i))


# --- 5. generated prompts: synthetic:arithmetic-prompts ---

def test_arithmetic_prompts():
    rows = list(arithmetic_prompts())
    assert len(rows) == 10_000 and rows == list(arithmetic_prompts())  # deterministic
    assert rows != list(arithmetic_prompts(seed=1))
    for row, sft in zip(rows, arithmetic(), strict=True):
        assert set(row) == {"prompt", "answer"}
        assert row["prompt"] == sft["messages"][:1]  # the same sums in the same order and phrasings
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert row["answer"] == str(a + b)
    assert len({r["prompt"][0]["content"] for r in rows}) == 10_000


def test_arithmetic_prompts_source(tok):
    data_cfg = cfg(sources=["synthetic:arithmetic-prompts"], val_fraction=0.05)
    data = prepare_prompts(data_cfg, tok, max_prompt_tokens=64)
    assert len(data.train) + len(data.val) == 10_000 and 300 < len(data.val) < 700
    assert data.stats.truncated == 0 and not data.stats.dropped
    first = data.train.where(0)
    assert re.fullmatch(r"synthetic:arithmetic-prompts\[\d+\]", first)
    k = int(first[first.index("[") + 1:-1])
    question = list(arithmetic_prompts())[k]
    assert data.train.prompt(0) == question["prompt"] and data.train.fields(0) == {"answer": question["answer"]}
    assert tok.decode(data.train.ids(0)) == (f"<|im_start|>user\n{question['prompt'][0]['content']}<|im_end|>\n"
                                             "<|im_start|>assistant\n")
    with pytest.raises(DataError, match=r"synthetic:arithmetic-prompts holds prompts rows; set data.format=prompts"):
        list(read_rows(data_cfg.sources, cfg(format="messages")))
    with pytest.raises(DataError, match=r"synthetic:arithmetic holds messages rows; set data.format=messages"):
        list(read_rows(["synthetic:arithmetic"], data_cfg))
