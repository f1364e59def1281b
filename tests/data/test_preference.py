"""Preference pairs (jaxtune.data.preference, data.format: preference): TRL's three row forms -> a chosen and a
rejected sequence after the same prompt -> (2, T) items and (B, 2, T) batches.

The tokenizers are `helpers.chat_templates.build_tokenizer`'s: a tiny byte-level BPE trained offline, here with
ChatML's special tokens and no template of its own (data.chat_template: chatml sets it), and a plain one for raw-text
pairs."""

from __future__ import annotations

import pickle
import re
from collections import Counter

import numpy as np
import pytest
from helpers.rows import (
    A,
    S,
    U,
    assert_bad_row_message,
    assert_first_bad_line_named,
    bad_rows_file,
    chatml_cfg,
    fresh,
    m,
    parsed,
    phrases,
    write_jsonl,
)

from jaxtune.config import DataConfig
from jaxtune.data import DataError
from jaxtune.data.formats import FORMATS, REASONS, Example, Pair, detect_format, field_names, parse_row, renders_chat
from jaxtune.data.pipeline import make_sequence_batches, make_training_data, test_sequences
from jaxtune.data.preference import PairRows, PreferenceStats, load_pairs, prepare_preference
from jaxtune.data.row_policy import DROP_REASONS, completion_settings
from jaxtune.data.rows import BadRow, read_rows
from jaxtune.data.sft import question
from jaxtune.data.synthetic import arithmetic, arithmetic_preferences, worked_sum

IM_END = "<|im_end|>"


def cfg(**kw) -> DataConfig:
    """A row per completion (the layout these tests read; the shared-prompt row is
    `tests/train/test_shared_prompts`)."""
    kw.setdefault("share_prompts", False)
    return chatml_cfg("preference", **kw)


def load(tok, data_cfg: DataConfig, stats: PreferenceStats | None = None):
    completion_settings(data_cfg, tok)  # sets data.chat_template, as prepare_preference does
    return load_pairs(data_cfg.sources, data_cfg, tok, stats if stats is not None else PreferenceStats())


def trained(tok, enc) -> str:
    return tok.decode(enc.ids[enc.mask].tolist())


def item_targets(tok, item: dict, row: int) -> str:
    """The decoded targets the loss counts in row ``row`` (0 chosen, 1 rejected) of a PairRows item."""
    return tok.decode(item["targets"][row][item["loss_mask"][row] > 0].tolist())


def check_item(item: dict, pair, seq_len: int) -> None:
    """Row r of the item is pair[r] shifted by one from position 0, then padding: segment 0, no loss, zeros."""
    assert {k: v.shape for k, v in item.items() if k != "ref_logps"} == {
        k: (2, seq_len) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    assert item["loss_mask"].dtype == np.float32 and item["inputs"].dtype == np.int32
    for r, enc in enumerate(pair):
        n = len(enc.ids) - 1
        assert item["inputs"][r, :n].tolist() == enc.ids[:-1].tolist()
        assert item["targets"][r, :n].tolist() == enc.ids[1:].tolist()
        assert item["loss_mask"][r, :n].tolist() == enc.mask[1:].astype(np.float32).tolist()
        assert item["positions"][r, :n].tolist() == list(range(n))
        assert item["segment_ids"][r].tolist() == [1] * n + [0] * (seq_len - n)
        for key in ("inputs", "targets", "positions", "loss_mask"):
            assert not item[key][r, n:].any()


# --- 1. the three forms ---

SYSTEM = "Réponds brièvement."
PROMPT = [m(S, SYSTEM), m(U, "What is 2+2?"), m(A, "4."), m(U, "And 3+3? Say it with an emoji 🙂")]
GOOD, BAD_REPLY = "6 🙂", "7, naïvely."


def test_conversational_pair(tok, tmp_path):
    row = {"prompt": PROMPT, "chosen": [m(A, GOOD)], "rejected": [m(A, BAD_REPLY)]}
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", [row]))], seq_len=96)
    assert parsed(row, data_cfg) == Pair(Example(messages=(*PROMPT, m(A, GOOD))),
                                         Example(messages=(*PROMPT, m(A, BAD_REPLY))), prompt_turns=4)
    (pair,) = load(tok, data_cfg)
    chosen, rejected = pair
    # The loss is on the completion only (not on the prompt's own assistant turn "4."), with its end of turn.
    assert (trained(tok, chosen), trained(tok, rejected)) == (GOOD + IM_END, BAD_REPLY + IM_END)
    prompt = tok.encode_chat([tok.apply_chat_template(PROMPT, add_generation_prompt=True)])[0]
    assert chosen.ids[:len(prompt)].tolist() == rejected.ids[:len(prompt)].tolist() == prompt
    assert not chosen.mask[:len(prompt)].any() and chosen.mask[len(prompt)]
    full = tok.encode_chat([tok.apply_chat_template([*PROMPT, m(A, GOOD)])])[0]
    assert tok.decode(chosen.ids.tolist()) == tok.decode(full)

    data = prepare_preference(data_cfg, tok)
    assert len(data.train) == 1 and data.val is None
    item = data.train[0]
    check_item(item, pair, 96)
    assert (item_targets(tok, item, 0), item_targets(tok, item, 1)) == (GOOD + IM_END, BAD_REPLY + IM_END)


def test_implicit_prompt(tok, tmp_path):
    shared = PROMPT[1:]
    implicit = {"chosen": [*shared, m(A, GOOD)], "rejected": [*shared, m(A, BAD_REPLY)]}
    explicit = {"prompt": shared, "chosen": [m(A, GOOD)], "rejected": [m(A, BAD_REPLY)]}
    data_cfg = cfg(seq_len=96)
    assert parsed(implicit, data_cfg) == parsed(explicit, data_cfg)
    assert parsed(implicit, data_cfg).prompt_turns == 3
    # The completions may go on for several turns; the loss is on each assistant turn of the completion.
    multi = {"chosen": [m(U, "Hi"), m(A, "Hello."), m(U, "Bye"), m(A, "Bye!")], "rejected": [m(U, "Hi"), m(A, "Go.")]}
    assert parsed(multi, data_cfg).prompt_turns == 1
    path = write_jsonl(tmp_path / "p.jsonl", [implicit, explicit, multi])
    pairs = load(tok, data_cfg.model_copy(update={"sources": [str(path)]}))
    assert [p[0].ids.tolist() for p in pairs[:1]] == [p[0].ids.tolist() for p in pairs[1:2]]
    assert [trained(tok, enc) for enc in pairs[2]] == [f"Hello.{IM_END}Bye!{IM_END}", f"Go.{IM_END}"]


def test_text_pair_needs_no_template(tok_dirs, tmp_path):
    plain = fresh(tok_dirs, "plain")
    row = {"prompt": "Q: 2+2? <|endoftext|>\nA:", "chosen": " 4, naïve 🙂", "rejected": " 5"}
    data_cfg = cfg(chat_template=None, seq_len=64)
    assert parsed(row, data_cfg) == Pair(Example(prompt=row["prompt"], completion=row["chosen"]),
                                         Example(prompt=row["prompt"], completion=row["rejected"]), 0)
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    ((chosen, rejected),) = load(plain, data_cfg.model_copy(update={"sources": [str(path)]}))
    prompt = plain.encode(row["prompt"])
    assert chosen.ids.tolist() == prompt + plain.encode(row["chosen"]) + [plain.eos_id]
    assert rejected.ids.tolist() == prompt + plain.encode(row["rejected"]) + [plain.eos_id]
    assert chosen.mask.tolist() == [False] * len(prompt) + [True] * (len(chosen.ids) - len(prompt))
    assert trained(plain, chosen) == " 4, naïve 🙂<|endoftext|>"
    assert plain.chat_template is None
    # A conversational pair does need one: the error says what to set.
    chat = write_jsonl(tmp_path / "c.jsonl", [row, {"prompt": [m(U, "x")], "chosen": [m(A, "y")],
                                                    "rejected": [m(A, "z")]}])
    with pytest.raises(DataError, match=r"no chat template.*set data.chat_template"):
        load(plain, data_cfg.model_copy(update={"sources": [str(chat)]}))


def test_text_and_chat_pairs_mix(tok, tmp_path):
    rows = [{"prompt": "2+2=", "chosen": "4", "rejected": "5"},
            {"prompt": [m(U, "2+2?")], "chosen": [m(A, "4")], "rejected": [m(A, "5")]}]
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", rows))], seq_len=32)
    text, chat = load(tok, data_cfg)
    assert [trained(tok, e) for e in text] == ["4<|endoftext|>", "5<|endoftext|>"]
    assert [trained(tok, e) for e in chat] == [f"4{IM_END}", f"5{IM_END}"]


def test_renamed_fields(tok, tmp_path):
    data_cfg = cfg(fields={"prompt": "question", "chosen": "good", "rejected": "bad", "role": "from",
                           "content": "value"}, seq_len=64)
    row = {"question": [{"from": "user", "value": "Hi"}], "good": [{"from": "assistant", "value": "Hello!"}],
           "bad": [{"from": "assistant", "value": "Go away."}]}
    assert parsed(row, data_cfg) == parsed({"prompt": [m(U, "Hi")], "chosen": [m(A, "Hello!")],
                                            "rejected": [m(A, "Go away.")]}, cfg())
    with pytest.raises(BadRow) as err:
        parsed({"prompt": [m(U, "Hi")], "chosen": [m(A, "a")], "rejected": [m(A, "b")]}, data_cfg)
    assert err.value.reason == "missing_field" and "'good'" in err.value.detail
    with pytest.raises(DataError, match=r"data.fields.messages does not apply to data.format=preference"):
        field_names(cfg(fields={"messages": "x"}))


def test_detection_and_template(tmp_path):
    row = {"prompt": "a", "chosen": "b", "rejected": "c"}
    assert detect_format(str(write_jsonl(tmp_path / "p.jsonl", [row]))) == "preference"
    assert detect_format(str(write_jsonl(tmp_path / "i.jsonl", [{"chosen": [m(U, "a")]}]))) == "preference"
    assert detect_format(str(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a", "completion": "b"}]))) == (
        "prompt_completion")
    assert renders_chat("preference") and not renders_chat("prompt_completion")


def test_loss_on_other_than_assistant_is_refused(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    with pytest.raises(DataError, match=r"data.loss_on=all does not apply to data.format=preference"):
        prepare_preference(cfg(sources=[str(path)], loss_on="all"), tok)


# --- 2. bad rows ---

P1 = [m(U, "p")]
# (reason, raw line, what the error says)
BAD = [
    ("non_utf8", b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}', "not valid UTF-8"),
    ("invalid_json", b'{"prompt": "a", "chosen": ', "not valid JSON"),
    ("missing_field", {"prompt": "p", "chosen": "c"}, "no 'rejected' field (found ['chosen', 'prompt'])"),
    ("missing_field", {"chosen": "c", "rejected": "r"}, "no 'prompt' field"),
    ("missing_field", {"prompt": P1, "chosen": [{"role": A}], "rejected": [m(A, "r")]}, "no 'content' field"),
    ("bad_type", {"prompt": "p", "chosen": "c", "rejected": [m(A, "r")]},
     "'chosen' and 'rejected' must both be strings (text) or both lists of messages, not str and list"),
    ("bad_type", {"prompt": "p", "chosen": [m(A, "c")], "rejected": [m(A, "r")]},
     "'prompt' must be a non-empty list of messages when the completions are (it is str)"),
    ("bad_type", {"prompt": P1, "chosen": "c", "rejected": "r"}, "field 'prompt' is list, not a string"),
    ("bad_type", {"prompt": P1, "chosen": ["c"], "rejected": [m(A, "r")]}, "'chosen' message 0 is str, not an object"),
    ("bad_type", [1, 2], "a row must be a JSON object, not list"),
    ("unknown_role", {"prompt": [m("human", "p")], "chosen": [m(A, "c")], "rejected": [m(A, "r")]},
     "'prompt' message 0 has role 'human'"),
    ("role_order", {"prompt": [m(U, "p"), m(A, "q")], "chosen": [m(A, "c")], "rejected": [m(A, "r")]},
     "the prompt's last turn is 'assistant', not 'user'"),
    ("role_order", {"prompt": P1, "chosen": [m(U, "c"), m(A, "d")], "rejected": [m(A, "r")]},
     "turn 1 is 'user' where 'assistant' was expected"),
    ("role_order", {"prompt": [m(U, "p"), m(S, "s"), m(U, "q")], "chosen": [m(A, "c")], "rejected": [m(A, "r")]},
     "turn 1 is 'system' where 'assistant' was expected"),
    ("role_order", {"prompt": P1, "chosen": [m(A, "c"), m(U, "d")], "rejected": [m(A, "r")]},
     "does not end with an assistant turn"),
    ("empty_content", {"prompt": "p", "chosen": " \n", "rejected": "r"}, "the chosen completion is empty"),
    ("empty_content", {"prompt": P1, "chosen": [m(A, "c")], "rejected": []}, "the rejected completion has no message"),
    ("empty_content", {"prompt": P1, "chosen": [m(A, "c")], "rejected": [m(A, "")]},
     "'rejected' message 0 (assistant) has empty content"),
    ("bad_tool_call", {"prompt": P1, "chosen": [{"role": A, "content": "", "tool_calls": [{"type": "function"}]},
                                               {"role": "tool", "content": "1"}, m(A, "c")], "rejected": [m(A, "r")]},
     "has no function name"),
    ("bad_tools", {"tools": "{not json", "prompt": P1, "chosen": [m(A, "c")], "rejected": [m(A, "r")]},
     "'tools' is a string but not JSON"),
    ("identical", {"prompt": "p", "chosen": "same", "rejected": "same"}, "are the same"),
    ("identical", {"chosen": [m(U, "p"), m(A, "c")], "rejected": [m(U, "p"), m(A, "c")]}, "are the same"),
    ("prompt_mismatch", {"chosen": [m(U, "p"), m(A, "c")], "rejected": [m(U, "q"), m(A, "r")]},
     "no 'prompt' field, and the two conversations' shared start (0 messages) does not end with a user turn"),
    ("prompt_mismatch", {"chosen": [m(U, "p"), m(A, "c"), m(U, "x"), m(A, "y")],
                         "rejected": [m(U, "p"), m(A, "c"), m(U, "z"), m(A, "w")]}, "shared start (2 messages)"),
]
GOOD_ROWS = [{"prompt": [m(U, "Hi")], "chosen": [m(A, "Hello!")], "rejected": [m(A, "No.")]},
             {"chosen": [m(U, "2+2?"), m(A, "4")], "rejected": [m(U, "2+2?"), m(A, "5")]},
             {"prompt": "Ciao", "chosen": " Salut 🙂", "rejected": " Bye"}]


def test_bad_rows_cover_every_reason():
    assert {reason for reason, _, _ in BAD} == {"non_utf8", "invalid_json", *FORMATS["preference"].reasons}
    assert set(FORMATS["preference"].reasons) == {"missing_field", "bad_type", "unknown_role", "role_order",
                                                  "empty_content", "identical", "prompt_mismatch",
                                                  "bad_tool_call", "bad_tools"}
    assert set(REASONS) <= set(DROP_REASONS)


def test_bad_rows_drop_counts_each_reason(tok, tmp_path):
    data_cfg = cfg(sources=[str(bad_rows_file(tmp_path / "mixed.jsonl", GOOD_ROWS, BAD))], bad_rows="drop",
                   seq_len=64)
    stats = PreferenceStats()
    pairs = load(tok, data_cfg, stats)
    assert [[trained(tok, e) for e in p] for p in pairs] == [
        [f"Hello!{IM_END}", f"No.{IM_END}"], [f"4{IM_END}", f"5{IM_END}"],
        [" Salut 🙂<|endoftext|>", " Bye<|endoftext|>"]]
    assert stats.dropped == Counter({"non_utf8": 1, "invalid_json": 1, "missing_field": 3, "bad_type": 5,
                                     "unknown_role": 1, "role_order": 4, "empty_content": 3, "identical": 2,
                                     "prompt_mismatch": 2, "bad_tool_call": 1, "bad_tools": 1})
    assert stats.dropped == Counter(reason for reason, _, _ in BAD)
    assert (stats.rows, stats.truncated) == (len(BAD) + 3, 0)
    from jaxtune.data.formats import iter_turn_texts  # what a BPE learns from: the good rows' texts, prompt once

    assert list(iter_turn_texts(data_cfg)) == ["Hi\nHello!\nNo.", "2+2?\n4\n5", "Ciao\n Salut 🙂\n Bye"]

    data = prepare_preference(data_cfg, tok)
    assert data.stats.lines() == [
        (f"preference data: {len(BAD) + 3} rows -> 3 training and 0 held-out pairs; {data.stats.trained_tokens} "
         "trained tokens"),
        ("dropped rows: non_utf8 1, invalid_json 1, missing_field 3, bad_type 5, unknown_role 1, role_order 4, "
         "empty_content 3, bad_tool_call 1, bad_tools 1, identical 2, prompt_mismatch 2")]
    assert data.stats.trained_tokens == sum(int(e.mask[1:].sum()) for p in pairs for e in p)


def read_pairs(tok):
    """path -> its pairs, read with the default data.bad_rows=raise."""
    return lambda path: load(tok, cfg(sources=[str(path)]))


def test_bad_rows_raise_names_the_first_bad_line(tok, tmp_path):
    assert_first_bad_line_named(read_pairs(tok), bad_rows_file(tmp_path / "mixed.jsonl", GOOD_ROWS, BAD))


@pytest.mark.parametrize("k", range(len(BAD)), ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_bad_row_raise_message(tok, tmp_path, k):
    _, line, message = BAD[k]
    assert_bad_row_message(read_pairs(tok), tmp_path / "one.jsonl", GOOD_ROWS, line, message)


# --- 3. length ---

LONG_PROMPT = {"prompt": [m(U, " ".join(f"question{i}" for i in range(40)))], "chosen": [m(A, "Yes.")],
               "rejected": [m(A, "No, not at all.")]}
LONG_REPLY = {"prompt": [m(U, "Tell me a story, please.")], "chosen": [m(A, " ".join(f"w{i}" for i in range(40)))],
              "rejected": [m(A, "No.")]}
SHORT = GOOD_ROWS[0]


@pytest.fixture
def overlong(tok, tmp_path):
    """(path of SHORT, LONG_PROMPT, LONG_REPLY, seq_len, their full encodings with prompt lengths)."""
    path = write_jsonl(tmp_path / "p.jsonl", [SHORT, LONG_PROMPT, LONG_REPLY])
    full = load(tok, cfg(sources=[str(path)], seq_len=1024))
    prompts = [int(np.argmax(p[0].mask)) for p in full]
    seq_len = max(len(e.ids) for e in full[0]) + 2
    replies = [max(len(e.ids) for e in p) - n for p, n in zip(full, prompts)]
    assert prompts[1] + replies[1] > seq_len + 1 and replies[1] < seq_len  # only its prompt must be cut
    assert replies[2] > seq_len  # its completion alone is too long
    return path, seq_len, full, prompts


def test_overlong_truncate_cuts_the_prompt_first(tok, overlong):
    path, seq_len, full, prompts = overlong
    limit = seq_len + 1
    stats = PreferenceStats()
    pairs = load(tok, cfg(sources=[str(path)], seq_len=seq_len), stats)
    assert (stats.truncated, stats.dropped) == (2, Counter())
    assert [e.ids.tolist() for e in pairs[0]] == [e.ids.tolist() for e in full[0]]
    # Long prompt: its start is cut so the longer sequence is exactly limit tokens; the completions stay whole.
    cut = max(len(e.ids) for e in full[1]) - limit
    assert 0 < cut < prompts[1]
    assert [e.ids.tolist() for e in pairs[1]] == [e.ids[cut:].tolist() for e in full[1]]
    assert max(len(e.ids) for e in pairs[1]) == limit
    assert [trained(tok, e) for e in pairs[1]] == [f"Yes.{IM_END}", f"No, not at all.{IM_END}"]
    # Long completion: one prompt token is kept, then the completions are cut to limit tokens from the right.
    start = prompts[2] - 1
    assert [e.ids.tolist() for e in pairs[2]] == [e.ids[start:start + limit].tolist() for e in full[2]]
    assert [e.mask.tolist() for e in pairs[2]] == [e.mask[start:start + limit].tolist() for e in full[2]]
    assert len(pairs[2][0].ids) == limit and trained(tok, pairs[2][1]) == f"No.{IM_END}"
    data = prepare_preference(cfg(sources=[str(path)], seq_len=seq_len, val_fraction=0.0), tok)
    assert "truncated pairs (data.overlong=truncate): 2" in data.stats.lines()
    for i in range(3):
        check_item(data.train[i], pairs[i], seq_len)


def test_overlong_drop(tok, overlong):
    path, seq_len, full, _ = overlong
    stats = PreferenceStats()
    pairs = load(tok, cfg(sources=[str(path)], seq_len=seq_len, overlong="drop"), stats)
    assert [[e.ids.tolist() for e in p] for p in pairs] == [[e.ids.tolist() for e in full[0]]]
    assert (stats.truncated, stats.dropped) == (0, Counter({"overlong": 2}))


def test_overlong_raise(tok, overlong):
    path, seq_len, full, _ = overlong
    with pytest.raises(DataError) as err:
        load(tok, cfg(sources=[str(path)], seq_len=seq_len, overlong="raise"))
    longest = max(len(e.ids) for e in full[1])
    assert str(err.value).startswith(f"{path}:2: {longest} tokens, more than data.seq_len + 1 = {seq_len + 1}; set "
                                     "data.overlong=truncate or drop, or raise data.seq_len")


def test_max_prompt_length_keeps_a_prompts_last_tokens_whatever_overlong_says(tok, overlong):
    """data.max_prompt_length (TRL's max_prompt_length): a longer prompt keeps its last tokens, the completions stay
    whole, counted apart from data.overlong's truncations; under overlong=raise too (the user asked for the cut)."""
    path, _, full, prompts = overlong
    keep = prompts[0]  # the short pair's prompt is exactly this long: whole
    stats = PreferenceStats()
    pairs = load(tok, cfg(sources=[str(path)], seq_len=1024, max_prompt_length=keep, overlong="raise"), stats)
    assert (stats.prompts_cut, stats.truncated, stats.dropped) == (2, 0, Counter())
    for pair, whole, n in zip(pairs, full, prompts):
        cut = max(0, n - keep)
        assert [e.ids.tolist() for e in pair] == [e.ids[cut:].tolist() for e in whole]
        assert [e.mask.tolist() for e in pair] == [e.mask[cut:].tolist() for e in whole]
        assert int(np.argmax(pair[0].mask)) == min(n, keep)
    assert "prompts cut to their last data.max_prompt_length tokens: 2" in stats.drop_lines("pairs")


# --- 4. held out, reference log-probs, batches ---

def many_pairs(n: int, salt: str = "") -> list[dict]:
    say = phrases(n, salt)
    out = []
    for i in range(n):
        prompt, good, bad = f"{salt}q{i} {say()}", f"yes {say()}", f"no {say()}"
        if i % 2:
            out.append({"prompt": [m(U, prompt)], "chosen": [m(A, good)], "rejected": [m(A, bad)]})
        else:
            out.append({"chosen": [m(U, prompt), m(A, good)], "rejected": [m(U, prompt), m(A, bad)]})
    return out


def key(pair) -> tuple:
    return tuple(pair[0].ids.tolist()), tuple(pair[1].ids.tolist())


def item_key(item: dict) -> tuple:
    return tuple(tuple(item["inputs"][r][item["segment_ids"][r] > 0].tolist()) for r in range(2))


def test_held_out_split(tok, tmp_path):
    distinct = many_pairs(60)
    path = write_jsonl(tmp_path / "p.jsonl", distinct + distinct[:30] + distinct[:10])  # duplicates
    data_cfg = cfg(sources=[str(path)], seq_len=64, val_fraction=0.3)
    data = prepare_preference(data_cfg, tok)
    train = [item_key(data.train[i]) for i in range(len(data.train))]
    val = [item_key(data.val[i]) for i in range(len(data.val))]
    assert len(train) + len(val) == 100 and train and val
    assert not set(train) & set(val)  # identical pairs share a split
    assert (data.stats.train_pairs, data.stats.val_pairs) == (len(train), len(val))
    again = prepare_preference(data_cfg, tok)
    assert [item_key(again.val[i]) for i in range(len(again.val))] == val  # deterministic
    # The held-out pairs' chosen conversations, in order: the questions the evaluations ask.
    held = [p for p in load(tok, data_cfg) if tuple(tuple(e.ids[:-1].tolist()) for e in p) in set(val)]
    assert data.held_out == [p[0].example for p in held] and len(data.held_out) == len(val)
    for ex, pair in zip(data.held_out, held):
        prompt, reference = question(tok, ex)
        assert pair[0].ids[:len(prompt)].tolist() == prompt
        assert trained(tok, pair[0]) == reference + IM_END

    other = write_jsonl(tmp_path / "held.jsonl", many_pairs(7, salt="held"))
    with_val = prepare_preference(data_cfg.model_copy(update={"val_sources": [str(other)]}), tok)
    assert (with_val.stats.train_pairs, with_val.stats.val_pairs) == (100, 7)
    expected = load(tok, data_cfg.model_copy(update={"sources": [str(other)]}))
    for i, pair in enumerate(expected):
        check_item(with_val.val[i], pair, 64)


def test_truncated_pairs_are_not_questions(tok, overlong):
    path, seq_len, _, _ = overlong
    data = prepare_preference(cfg(sources=[str(path)], seq_len=seq_len, val_sources=[str(path)]), tok)
    assert data.held_out == [parsed(SHORT, cfg()).chosen]


def test_with_reference(tok, tmp_path):
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", many_pairs(5)))], seq_len=48)
    rows = prepare_preference(data_cfg, tok).train
    logps = -np.arange(10, dtype=np.float64).reshape(5, 2) - 0.5
    ref = rows.with_reference(logps)
    assert len(ref) == len(rows) == 5 and "ref_logps" not in rows[0]
    for i in range(5):
        item = ref[i]
        assert item["ref_logps"].dtype == np.float32 and item["ref_logps"].tolist() == logps[i].tolist()
        assert all(np.array_equal(item[k], v) for k, v in rows[i].items())
    with pytest.raises(ValueError, match=r"5 pairs need \(5, 2\)"):
        rows.with_reference(logps[:4])
    # Grain pickles its source into worker processes: it travels whole, and small.
    back = pickle.loads(pickle.dumps(ref))
    assert all(np.array_equal(back[i][k], ref[i][k]) for i in range(5) for k in ref[i])
    assert len(pickle.dumps(ref)) < 8 * 2 * 48 * 5 + 4096

    batches = make_sequence_batches(ref, batch_size=4, num_batches=5)
    assert len(batches) == 2 and batches[1]["ref_logps"].shape == (4, 2)
    assert batches[1]["ref_logps"][0].tolist() == logps[4].tolist() and not batches[1]["ref_logps"][1:].any()


def test_make_training_data_batches_pairs(tok, tmp_path):
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", many_pairs(40)))], seq_len=96, val_fraction=0.3,
                   packing=True)  # pairs are never packed, whatever data.packing says
    data = make_training_data(data_cfg, tok, batch_size=4, seed=0, eval_batches=10)
    try:
        pairs = data.pairs
        assert data.report == pairs.stats.lines() and data.report[0].startswith("preference data: 40 rows -> ")
        assert len(pairs.train) + len(pairs.val) == 40 and pairs.stats.truncated == 0
        assert len(pairs.val) % 4  # the last eval batch is padded
        batch = next(data.train_iter)
        assert {k: v.shape for k, v in batch.items()} == {
            k: (4, 2, 96) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
        assert all(batch["segment_ids"].max(axis=-1).ravel() == 1)  # one sequence per row: no packing
        assert (batch["loss_mask"].sum(axis=-1) > 0).all()
        train = {item_key(pairs.train[i]) for i in range(len(pairs.train))}
        assert all(tuple(tuple(b["inputs"][r][b["segment_ids"][r] > 0].tolist()) for r in range(2)) in train
                   for b in [{k: v[j] for k, v in batch.items()} for j in range(4)])

        assert len(data.eval_batches) == -(-len(pairs.val) // 4)
        last = data.eval_batches[-1]
        real = len(pairs.val) % 4
        assert all(v.shape == (4, 2, 96) for v in last.values())
        assert not last["loss_mask"][real:].any() and not last["segment_ids"][real:].any()  # padding pairs
        assert (last["loss_mask"][:real].sum(axis=-1) > 0).all()
        assert data.eval_examples == pairs.held_out and len(data.eval_examples) == len(pairs.val)
    finally:
        data.close()


def test_a_batch_larger_than_the_data_and_a_held_out_set_under_a_batch_are_said(tok, tmp_path):
    """40 pairs, 30% held out, batches of 32: the training pairs cannot fill a batch without repeats, and the
    held-out ones are fewer than a batch: one warning line each, naming the key and what to do; none at 4."""
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", many_pairs(40)))], seq_len=96, val_fraction=0.3)
    for size, expected in ((32, 2), (4, 0)):
        data = make_training_data(data_cfg, tok, batch_size=size, seed=0, eval_batches=10)
        data.close()
        warnings = [line for line in data.report if line.startswith("warning: ")]
        assert len(warnings) == expected, data.report
    data = make_training_data(data_cfg, tok, batch_size=32, seed=0, eval_batches=10)
    data.close()
    n_train, n_val = len(data.pairs.train), len(data.pairs.val)
    assert n_train + n_val == 40 and n_train < 32
    train_line, val_line = [line for line in data.report if line.startswith("warning: ")]
    assert f"train.batch_size=32 is more than the {n_train} training pairs" in train_line
    assert "lower train.batch_size" in train_line
    assert val_line.startswith(f"warning: {n_val} held-out pairs, fewer than a batch")
    assert "data.val_fraction" in val_line


def test_test_sequences_reads_every_pair(tok, tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", many_pairs(6) + [{"prompt": "p", "chosen": "x", "rejected": "x"}])
    data_cfg = cfg(sources=["unused.jsonl"], seq_len=48, val_fraction=0.3, bad_rows="drop")
    source, info = test_sequences(data_cfg, tok, str(path))
    assert info == {"rows": 7, "pairs": 6, "dropped": {"identical": 1}}
    expected = load(tok, data_cfg.model_copy(update={"sources": [str(path)]}))
    assert isinstance(source, PairRows) and len(source) == 6
    for i, pair in enumerate(expected):
        check_item(source[i], pair, 48)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"not json\n")
    with pytest.raises(DataError, match=r"--data .*bad.jsonl: no usable pairs \(1 read, dropped {'invalid_json': 1}\)"):
        test_sequences(data_cfg, tok, str(bad))


def test_parquet_rows(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in many_pairs(6) if "prompt" in r]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    from_parquet = load(tok, cfg(sources=[str(tmp_path / "p.parquet")], seq_len=48))
    assert [key(p) for p in from_parquet] == [key(p) for p in load(tok, cfg(sources=[str(jsonl)], seq_len=48))]
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "chosen": "b", "rejected": "b"}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path / 'bad.parquet'}[row 0]: the chosen and the rejected")):
        load(tok, cfg(sources=[str(tmp_path / "bad.parquet")]))


# --- 5. generated pairs: synthetic:arithmetic-preferences ---

def test_arithmetic_preferences():
    rows = list(arithmetic_preferences())
    assert len(rows) == 10_000 and rows == list(arithmetic_preferences())  # deterministic
    assert rows != list(arithmetic_preferences(seed=1))
    sums = list(arithmetic())
    carries = 0
    for row, sft in zip(rows, sums):
        assert row["prompt"] == sft["messages"][:1]  # the same sums in the same order and phrasings
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        (chosen,), (rejected,) = row["chosen"], row["rejected"]
        assert chosen == m(A, worked_sum(a, b)) == sft["messages"][1]
        assert rejected["role"] == A and rejected["content"] != chosen["content"]
        ones, tens, total = map(int, re.fullmatch(r"\d\+\d=(\d+), \d\+\d=(\d+), so (\d+)\.",
                                                  rejected["content"]).groups())
        assert total != a + b
        if a % 10 + b % 10 >= 10:  # the carry forgotten
            carries += 1
            assert rejected["content"] == (f"{a % 10}+{b % 10}={a % 10 + b % 10}, {a // 10}+{b // 10}="
                                           f"{a // 10 + b // 10}, so {a + b - 10}.")
        else:  # one digit off by one, the working agreeing with the answer
            assert total == tens * 10 + ones and 0 <= ones <= 9
            assert abs(ones - (a % 10 + b % 10)) + abs(tens - (a // 10 + b // 10)) == 1
    assert carries == 4500
    assert len({r["rejected"][0]["content"] for r in rows}) > 9000


def test_arithmetic_preferences_source(tmp_path):
    data_cfg = cfg(sources=["synthetic:arithmetic-preferences"])
    fields = field_names(data_cfg)
    read = [(where, parse_row(record, data_cfg, fields)) for where, record in read_rows(data_cfg.sources, data_cfg)]
    assert len(read) == 10_000 and read[0][0] == "synthetic:arithmetic-preferences[0]"
    assert all(p.prompt_turns == 1 for _, p in read)
    with pytest.raises(DataError, match=r"synthetic:arithmetic-preferences holds preference rows; set "
                                        r"data.format=preference"):
        list(read_rows(data_cfg.sources, cfg(format="messages", sources=data_cfg.sources)))
    with pytest.raises(DataError, match=r"synthetic:arithmetic holds messages rows; set data.format=messages"):
        list(read_rows(["synthetic:arithmetic"], data_cfg))


def test_the_margin_column_is_read_for_a_reward_model(tok, tmp_path):
    """TRL's optional ``margin`` column: with ``margins`` (an objective that reads them: the reward model) each item
    carries its pair's margin on both sequences (0 where a row gives none), batches a (B, 2) "margin", held-out ones
    too, and the report counts them; without, items carry none and the report says they are ignored. A margin that
    is not a finite number is a bad row at its file:line."""
    rows = many_pairs(24)
    for i, row in enumerate(rows):
        if i % 3:
            row["margin"] = float(i) / 4
    data_cfg = cfg(sources=[str(write_jsonl(tmp_path / "p.jsonl", rows))], seq_len=96, val_fraction=0.25)
    data = make_training_data(data_cfg, tok, batch_size=4, seed=0, eval_batches=10, margins=True)
    try:
        given = {round(float(i) / 4, 4) for i in range(24) if i % 3} | {0.0}
        seen = {round(float(v), 4) for i in range(len(data.pairs.train)) for v in data.pairs.train[i]["margin"]}
        assert seen <= given and len(seen) > 3
        assert all(data.pairs.train[i]["margin"][0] == data.pairs.train[i]["margin"][1] for i in range(8))
        assert next(data.train_iter)["margin"].shape == (4, 2) and data.eval_batches[0]["margin"].shape == (4, 2)
        assert "16 with a margin, which the reward model's loss subtracts" in data.report[0]
    finally:
        data.close()
    plain = make_training_data(data_cfg, tok, batch_size=4, seed=0, eval_batches=10)
    plain.close()
    assert "margin" not in plain.pairs.train[0] and "which only objective.name=reward reads (ignored here)" in \
        plain.report[0]
    bad = write_jsonl(tmp_path / "bad.jsonl", [rows[1], {**rows[2], "margin": "high"}])
    with pytest.raises(DataError, match=r"bad.jsonl:2: .*'margin' is 'high'; it must be a finite number"):
        load(tok, cfg(sources=[str(bad)], seq_len=96, bad_rows="raise"))
