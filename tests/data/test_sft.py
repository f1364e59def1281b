"""Supervised fine-tuning data (jaxtune.data.sft): rows -> conversations -> ids + loss mask -> packed sequences.

Every tokenizer here is built offline: a tiny byte-level BPE trained on a few KB, saved with a
tokenizer_config.json that carries a real-world-shaped chat template (ChatML/Qwen, Llama 3, Gemma,
transformers' {% generation %} markers), then loaded the way a checkpoint's tokenizer is.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from helpers.chat_templates import (
    ASSISTANT,
    CHATML_GENERATION,
    CONVO,
    FAMILIES,
    GEMMA,
    LLAMA3,
    MISTRAL,
    SYSTEM,
    build_tokenizer,
    messages_cfg,
)
from helpers.rows import parsed, write_jsonl
from helpers.shared_data import SHARED_DATA

from jaxtune.config import ConfigError, DataConfig, TokenizerConfig, load_config
from jaxtune.data import DataError, load_tokenizer
from jaxtune.data.chat import encode_prompt, end_of_turn_ids, format_sample, stop_ids
from jaxtune.data.encoded import Encoded, Examples, PackedRows
from jaxtune.data.formats import FORMATS, REASONS, Example, detect_format, field_names, parse_row
from jaxtune.data.pipeline import make_sequence_batches, test_sequences
from jaxtune.data.row_policy import DROP_REASONS
from jaxtune.data.rows import READ_REASONS
from jaxtune.data.sft import Encoder, SFTStats, load_examples, pack, prepare_sft, question, sequences
from jaxtune.data.templates import SHIPPED_TEMPLATES
from jaxtune.data.tokenizer import _train_bpe


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """name -> tokenizer directory, built once per module."""
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, (template, specials, eos, bos, _) in FAMILIES.items():
        build_tokenizer(root / name, template, specials, eos, bos)
        out[name] = root / name
    build_tokenizer(root / "plain", None, [], "<|endoftext|>")
    build_tokenizer(root / "mistral", MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "</s>", "<s>")
    out["mistral"] = root / "mistral"
    out["plain"] = root / "plain"
    return out


def fresh(tok_dirs, name):
    """A new Tokenizer object (prepare_sft may set its chat_template, so tests do not share one)."""
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(tok_dirs[name])), DataConfig())


@pytest.fixture(scope="module")
def chatml(tok_dirs):
    return fresh(tok_dirs, "chatml")


def masked_text(tok, enc: Encoded) -> str:
    return tok.decode(enc.ids[enc.mask].tolist())


def mask_runs(mask: np.ndarray) -> int:
    """Number of contiguous True runs."""
    m = np.concatenate([[False], mask, [False]]).astype(np.int8)
    return int((np.diff(m) == 1).sum())


def conv(*turns: str, system: str | None = None) -> dict:
    roles = ["user", "assistant"] * len(turns)
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": r, "content": t} for r, t in zip(roles, turns)]
    return {"messages": msgs}


# --- 1. the assistant mask, per chat template ---


@pytest.mark.parametrize("family", list(FAMILIES))
def test_assistant_mask_per_template(tok_dirs, family):
    template, specials, eos, bos, eot = FAMILIES[family]
    tok = fresh(tok_dirs, family)
    assert tok.chat_template == template
    assert tok.eos_id == tok._tok.token_to_id(eos)

    # Every special token of the template is one id when chat text is encoded (and text when text is).
    for s in specials:
        sid = tok._tok.token_to_id(s)
        assert sid is not None
        assert tok.encode_chat([s]) == [[sid]]
        assert tok.encode(s) != [sid]

    data_cfg = messages_cfg()
    ex = parse_row({"messages": list(CONVO)}, data_cfg, field_names(data_cfg))
    assert ex.messages == CONVO
    full = tok.apply_chat_template(list(CONVO))
    (enc,) = Encoder(tok, data_cfg).encode([ex])
    assert enc.ids.dtype == np.int32 and enc.mask.dtype == bool and enc.ids.shape == enc.mask.shape
    # The pieces together are the whole rendered conversation, special tokens as single ids.
    assert tok.decode(enc.ids.tolist()) == full
    assert enc.ids.tolist().count(tok._tok.token_to_id(eot)) == (4 if family == "gemma" else 5)
    if bos is not None:
        assert enc.ids[0] == tok._tok.token_to_id(bos) and not enc.mask[0]
    # Trained: each assistant reply and the end-of-turn token that closes it; nothing else.
    assert masked_text(tok, enc) == "".join(a + eot for a in ASSISTANT)
    assert mask_runs(enc.mask) == 2
    assert SYSTEM not in masked_text(tok, enc)
    # The prompt before the first reply is exactly what inference feeds the model (generation prompt included).
    first = int(np.argmax(enc.mask))
    prompt = tok.apply_chat_template(list(CONVO[:2]), add_generation_prompt=True)
    assert enc.ids[:first].tolist() == tok.encode_chat([prompt])[0]
    assert tok.decode(enc.ids[first:first + 1].tolist()) != ""

    (last,) = Encoder(tok, messages_cfg(loss_on="last_assistant")).encode([ex])
    assert last.ids.tolist() == enc.ids.tolist()
    assert masked_text(tok, last) == ASSISTANT[-1] + eot
    assert mask_runs(last.mask) == 1

    (everything,) = Encoder(tok, messages_cfg(loss_on="all")).encode([ex])
    assert everything.mask.all()
    assert tok.decode(everything.ids.tolist()) == full

    assert end_of_turn_ids(tok) == [tok._tok.token_to_id(eot)]


def test_template_specific_renderings(tok_dirs):
    gemma = fresh(tok_dirs, "gemma")
    text = gemma.apply_chat_template(list(CONVO), add_generation_prompt=False)
    # Gemma: no system turn; the system message opens the first user turn; the assistant is "model".
    assert text.startswith(f"<bos><start_of_turn>user\n{SYSTEM}\n\n{CONVO[1]['content']}<end_of_turn>\n"
                           f"<start_of_turn>model\n{ASSISTANT[0]}<end_of_turn>\n")
    assert "<start_of_turn>system" not in text and "<start_of_turn>assistant" not in text
    assert text.count("<start_of_turn>model\n") == 2 and text.count("<start_of_turn>user\n") == 2
    assert gemma.apply_chat_template(list(CONVO[:2]), add_generation_prompt=True).endswith("<start_of_turn>model\n")
    # Gemma trims content: surrounding whitespace of a reply is not trained on (nor rendered).
    padded = [dict(m) for m in CONVO]
    padded[2]["content"] = "\n  " + ASSISTANT[0] + "  \n"
    (enc,) = Encoder(gemma, messages_cfg()).encode([Example(messages=tuple(padded))])
    assert masked_text(gemma, enc) == "".join(a + "<end_of_turn>" for a in ASSISTANT)

    llama = fresh(tok_dirs, "llama3")
    assert llama.apply_chat_template(list(CONVO[:2]), add_generation_prompt=True) == (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{CONVO[1]['content']}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_mistral_template_without_system(tok_dirs):
    """A template with no generation prompt: the reply piece starts right after [/INST] (its leading space
    included) and ends with the EOS that closes the turn."""
    tok = fresh(tok_dirs, "mistral")
    ex = Example(messages=CONVO[1:])
    (enc,) = Encoder(tok, messages_cfg()).encode([ex])
    assert tok.decode(enc.ids.tolist()) == (f"<s>[INST] {CONVO[1]['content']}[/INST] {ASSISTANT[0]}</s>"
                                            f"[INST] {CONVO[3]['content']}[/INST] {ASSISTANT[1]}</s>")
    assert masked_text(tok, enc) == "".join(f" {a}</s>" for a in ASSISTANT)
    assert enc.ids[enc.mask].tolist().count(tok.eos_id) == 2
    assert set(end_of_turn_ids(tok)) <= {tok.eos_id}  # the turn ends with EOS itself


def test_generation_markers_render_and_mask_like_plain_chatml(tok_dirs, chatml):
    marked = fresh(tok_dirs, "generation")
    for gen in (False, True):
        assert marked.apply_chat_template(list(CONVO), gen) == chatml.apply_chat_template(list(CONVO), gen)
    # The same vocabulary, template given as data.chat_template text: identical ids and mask.
    same_vocab = fresh(tok_dirs, "chatml")
    data_cfg = messages_cfg(chat_template=CHATML_GENERATION)
    from jaxtune.data.chat import resolve_chat_template

    resolve_chat_template(data_cfg, same_vocab)
    assert same_vocab.chat_template == CHATML_GENERATION
    (a,) = Encoder(same_vocab, data_cfg).encode([Example(messages=CONVO)])
    (b,) = Encoder(chatml, data_cfg).encode([Example(messages=CONVO)])
    assert a.ids.tolist() == b.ids.tolist() and a.mask.tolist() == b.mask.tolist()


def test_chat_template_setting(tok_dirs, tmp_path):
    from jaxtune.data.chat import resolve_chat_template
    from jaxtune.data.templates import CHATML as SHIPPED

    plain = fresh(tok_dirs, "plain")
    assert plain.chat_template is None
    with pytest.raises(DataError, match="data.format=messages needs a chat template"):
        resolve_chat_template(messages_cfg(), plain)
    resolve_chat_template(messages_cfg(format="prompt_completion"), plain)  # raw text needs none
    resolve_chat_template(messages_cfg(chat_template="chatml"), plain)
    assert plain.chat_template == SHIPPED
    (tmp_path / "t.jinja").write_text(LLAMA3)
    resolve_chat_template(messages_cfg(chat_template=str(tmp_path / "t.jinja")), plain)
    assert plain.chat_template == LLAMA3
    with pytest.raises(DataError, match="no such file"):
        resolve_chat_template(messages_cfg(chat_template=str(tmp_path / "missing.jinja")), plain)
    with pytest.raises(DataError, match="not a shipped template"):
        resolve_chat_template(messages_cfg(chat_template="vicuna"), plain)
    # The shipped chatml template renders what the hand-written one does.
    chatml = fresh(tok_dirs, "chatml")
    expected = chatml.apply_chat_template(list(CONVO), add_generation_prompt=True)
    chatml.chat_template = SHIPPED
    assert chatml.apply_chat_template(list(CONVO), add_generation_prompt=True) == expected


# --- 2. templates that are not prefix-stable, and templates the mask cannot be derived from ---

LAST_DIFFERENT = (  # marks the final message: a conversation's beginning is not the beginning of its text
    "{% for m in messages %}{% if loop.last %}[final] {% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + "
    "m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
EARLIER_REWRITTEN = (  # like Qwen3 stripping reasoning: earlier assistant turns render differently
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\\n' + "
    "m['content'].split('.')[0] + '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
    " + '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
NO_CONTENT = (  # does not render what the assistant said
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] != 'assistant' %}"
    "{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REPLIES_ECHOED = (  # repeats every reply after the conversation: the text after a reply depends on it
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '(' + m['content'] + ')' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TWO_EXCHANGES = ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "One. Two."},
                 {"role": "user", "content": "More?"}, {"role": "assistant", "content": "Three. Four."})


@pytest.mark.parametrize("template,replies", [
    (LAST_DIFFERENT, ["One. Two.<|im_end|>", "Three. Four.<|im_end|>"]),
    (EARLIER_REWRITTEN, ["One<|im_end|>", "Three. Four.<|im_end|>"]),  # as the template renders the earlier one
])
def test_template_that_is_not_prefix_stable_is_located(tok_dirs, template, replies):
    """The replies are found in the rendering without prefix stability (tests/data/test_chat_templates.py has the
    real ones: Qwen 3, Mistral with a system message)."""
    tok = fresh(tok_dirs, "chatml")
    tok.chat_template = template
    ex = Example(messages=TWO_EXCHANGES)
    msgs = [dict(m) for m in TWO_EXCHANGES]
    assert Encoder(tok, messages_cfg()).prefix_spans(msgs, tok.apply_chat_template(msgs), [1, 3]) is None
    (enc,) = Encoder(tok, messages_cfg()).encode([ex])
    assert tok.decode(enc.ids.tolist()) == tok.apply_chat_template(msgs)
    assert mask_runs(enc.mask) == 2 and masked_text(tok, enc) == "".join(replies)
    (last,) = Encoder(tok, messages_cfg(loss_on="last_assistant")).encode([ex])
    assert masked_text(tok, last) == replies[-1] and mask_runs(last.mask) == 1


@pytest.mark.parametrize("template", [NO_CONTENT, REPLIES_ECHOED])
def test_template_whose_replies_cannot_be_located_is_an_error(tok_dirs, template):
    tok = fresh(tok_dirs, "chatml")
    tok.chat_template = template
    ex = Example(messages=TWO_EXCHANGES)
    with pytest.raises(DataError, match="does not render an assistant turn's content where it can be found") as err:
        Encoder(tok, messages_cfg()).encode([ex])
    assert "set data.chat_template" in str(err.value) and "data.loss_on=all" in str(err.value)
    # Training on every token needs no reply boundaries.
    (enc,) = Encoder(tok, messages_cfg(loss_on="all")).encode([ex])
    assert enc.mask.all() and tok.decode(enc.ids.tolist()) == tok.apply_chat_template(list(ex.messages))


# --- 3. row formats ---


def test_sharegpt_rows():
    data_cfg = messages_cfg(format="sharegpt")
    row = {"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"},
                             {"from": "gpt", "value": "Hello"}, {"from": "user", "value": "Bye"},
                             {"from": "assistant", "value": "Ciao"}]}
    assert parsed(row, data_cfg).messages == (
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"})
    custom = {"conversations": [{"from": "customer", "value": "Where is my order?"},
                                {"from": "agent", "value": "On its way."}]}
    with pytest.raises(Exception) as err:
        parsed(custom, data_cfg)
    assert err.value.reason == "unknown_role" and "data.roles" in err.value.detail
    mapped = messages_cfg(format="sharegpt", roles={"customer": "user", "agent": "assistant"})
    assert parsed(custom, mapped).messages == ({"role": "user", "content": "Where is my order?"},
                                               {"role": "assistant", "content": "On its way."})
    assert parsed(row, mapped).messages[1] == {"role": "user", "content": "Hi"}  # defaults still apply


def test_alpaca_rows(chatml):
    data_cfg = messages_cfg(format="alpaca")
    assert parsed({"instruction": "Translate.", "input": "chat", "output": "cat"}, data_cfg).messages == (
        {"role": "user", "content": "Translate.\n\nchat"}, {"role": "assistant", "content": "cat"})
    assert parsed({"instruction": "Say hi.", "output": "hi"}, data_cfg).messages == (
        {"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"})
    assert parsed({"instruction": "Say hi.", "input": "  ", "output": "hi", "system": "Be brief."},
                  data_cfg).messages == ({"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hi."},
                                         {"role": "assistant", "content": "hi"})
    (enc,) = Encoder(chatml, data_cfg).encode([parsed({"instruction": "Add.", "input": "2+2", "output": "4"},
                                                      data_cfg)])
    assert masked_text(chatml, enc) == "4<|im_end|>"
    assert chatml.decode(enc.ids.tolist()) == ("<|im_start|>user\nAdd.\n\n2+2<|im_end|>\n"
                                               "<|im_start|>assistant\n4<|im_end|>\n")
    for bad, reason in (({"instruction": "x"}, "missing_field"), ({"instruction": "x", "output": " "},
                                                                  "empty_content"),
                        ({"instruction": "x", "output": 3}, "bad_type")):
        with pytest.raises(Exception) as err:
            parsed(bad, data_cfg)
        assert err.value.reason == reason


def test_prompt_completion_masks_completion_and_eos(tok_dirs, tmp_path):
    plain = fresh(tok_dirs, "plain")  # no chat template: raw text needs none
    data_cfg = messages_cfg(format="prompt_completion", val_fraction=0.0, seq_len=128)
    ex = parsed({"prompt": "Q: 2+2? <|endoftext|>\nA:", "completion": " 4, naïve 🙂"}, data_cfg)
    assert ex == Example(prompt="Q: 2+2? <|endoftext|>\nA:", completion=" 4, naïve 🙂")
    (enc,) = Encoder(plain, data_cfg).encode([ex])
    prompt_ids, completion_ids = plain.encode(ex.prompt), plain.encode(ex.completion)
    assert enc.ids.tolist() == prompt_ids + completion_ids + [plain.eos_id]
    assert enc.mask.tolist() == [False] * len(prompt_ids) + [True] * (len(completion_ids) + 1)
    assert masked_text(plain, enc) == " 4, naïve 🙂<|endoftext|>"
    assert enc.ids.tolist().count(plain.eos_id) == 1  # the literal in the prompt stays text
    (everything,) = Encoder(plain, messages_cfg(format="prompt_completion", loss_on="all")).encode([ex])
    assert everything.mask.all()

    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "", "completion": "c"}])
    sft = prepare_sft(data_cfg.model_copy(update={"sources": [str(path)]}), plain)
    assert (sft.stats.rows, sft.stats.train_examples, sft.val) == (2, 2, None)


def test_renamed_fields(chatml, tmp_path):
    data_cfg = messages_cfg(fields={"messages": "dialogue", "role": "speaker", "content": "text"})
    row = {"dialogue": [{"speaker": "user", "text": "Hi"}, {"speaker": "assistant", "text": "Yo"}]}
    assert parsed(row, data_cfg).messages == ({"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Yo"})
    with pytest.raises(Exception) as err:
        parsed({"messages": row["dialogue"]}, data_cfg)
    assert err.value.reason == "missing_field" and "'dialogue'" in err.value.detail

    alpaca = messages_cfg(format="alpaca", fields={"instruction": "question", "output": "answer"})
    assert parsed({"question": "Why?", "answer": "Because."}, alpaca).messages == (
        {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."})
    with pytest.raises(Exception) as err:
        parsed({"instruction": "Why?", "answer": "Because."}, alpaca)
    assert err.value.reason == "missing_field" and "'question'" in err.value.detail

    pc = messages_cfg(format="prompt_completion", fields={"prompt": "input", "completion": "target"})
    assert parsed({"input": "a", "target": "b"}, pc) == Example(prompt="a", completion="b")

    path = write_jsonl(tmp_path / "rows.jsonl", [row])
    wrong = messages_cfg(fields={"messages": "dialogue", "instructions": "x"}, sources=[str(path)])
    with pytest.raises(DataError, match=r"data.fields.instructions does not apply to data.format=messages"):
        load_examples(wrong.sources, wrong, chatml, SFTStats())
    wrong_fmt = messages_cfg(format="alpaca", fields={"messages": "dialogue"}, sources=[str(path)])
    with pytest.raises(DataError, match=r"data.fields.messages does not apply to data.format=alpaca"):
        load_examples(wrong_fmt.sources, wrong_fmt, chatml, SFTStats())


# --- 4. bad rows ---

GOOD = [conv("Hi", "Hello!"), conv("2+2?", "4", "Sure?", "Yes.", system="Be exact."), conv("Ciao", "Salut 🙂")]
U, A, S = "user", "assistant", "system"


def msgs(*pairs) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in pairs]}).encode()


# (reason, raw line, what the error says)
BAD = [
    ("non_utf8", b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}',
     "not valid UTF-8 (byte 46)"),
    ("invalid_json", b'{"messages": [{"role": "user", "content": "hi"},', "not valid JSON"),
    ("missing_field", json.dumps({"conversation": [{"role": U, "content": "x"}]}).encode(),
     "no 'messages' field (found ['conversation'])"),
    ("missing_field", json.dumps({"messages": [{"role": U}, {"role": A, "content": "y"}]}).encode(),
     "no 'content' field"),
    ("bad_type", json.dumps({"messages": "hello"}).encode(), "'messages' must be a non-empty list of turns"),
    ("bad_type", json.dumps({"messages": []}).encode(), "'messages' must be a non-empty list of turns"),
    ("bad_type", json.dumps({"messages": [{"role": U, "content": 5}, {"role": A, "content": "y"}]}).encode(),
     "field 'content' is int, not a string"),
    ("bad_type", json.dumps({"messages": ["hi", "there"]}).encode(), "turn 0 is str, not an object"),
    ("bad_type", b"[1, 2]", "a row must be a JSON object, not list"),
    ("unknown_role", msgs((U, "x"), ("bot", "y")), "turn 1 has role 'bot'"),
    ("role_order", msgs((U, "x"), (U, "y"), (A, "z")), "turn 1 is 'user' where 'assistant' was expected"),
    ("role_order", msgs((U, "x"), (A, "y"), (U, "z")), "does not end with an assistant turn"),
    ("role_order", msgs((A, "x"), (U, "y"), (A, "z")), "turn 0 is 'assistant' where 'user' was expected"),
    ("role_order", msgs((S, "s"), (A, "y")), "turn 1 is 'assistant' where 'user' was expected"),
    ("role_order", msgs((S, "s"), (S, "t"), (U, "x"), (A, "y")), "turn 1 is 'system' where 'user' was expected"),
    ("role_order", msgs((S, "s")), "does not end with an assistant turn"),
    ("empty_content", msgs((U, "x"), (A, " \n\t")), "turn 1 (assistant) has empty content"),
    ("empty_content", msgs((S, ""), (U, "x"), (A, "y")), "turn 0 (system) has empty content"),
    # Tool-calling rows (tests/data/test_tool_rows.py has the rest): a call whose arguments are not JSON, a tools
    # column that is neither schemas nor names.
    ("bad_tool_call", json.dumps({"messages": [{"role": U, "content": "x"}, {"role": A, "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}, {"role": "tool", "content": "1"},
        {"role": A, "content": "y"}]}).encode(), "(f): its arguments are not valid JSON"),
    ("bad_tools", json.dumps({"tools": 5, "messages": [{"role": U, "content": "x"}, {"role": A, "content": "y"}]}
                             ).encode(), "'tools' is int; give a list of the tools' JSON schemas or names"),
    # Another format's row: what it is, and the format and objective that take it.
    ("wrong_format", json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}).encode(),
     ("this row is a preference pair {prompt, chosen, rejected} (data.format=preference, for objective.name=dpo, "
      "simpo, reward or orpo), but data.format=messages reads a chat conversation, for objective.name=cross_entropy; "
      "give rows of that shape, or train on these with data.format=preference objective.name=dpo")),
]


def test_bad_rows_cover_every_reason():
    """Every reason of the SFT formats (the preference format's own, identical and prompt_mismatch, are covered by
    tests/data/test_preference.py)."""
    sft_reasons = set(READ_REASONS) | {r for f in FORMATS.values() if f.name != "preference" for r in f.reasons}
    assert {reason for reason, _, _ in BAD} == sft_reasons
    assert set(REASONS) - sft_reasons == {"identical", "prompt_mismatch"}
    assert "wrong_format" in sft_reasons
    assert DROP_REASONS == (*REASONS, "overlong", "no_trainable_tokens")


def bad_rows_file(path: Path) -> Path:
    """GOOD[0], a blank line, then the bad rows with the other good rows interleaved."""
    lines = [json.dumps(GOOD[0]).encode(), b"   "]
    for k, (_, raw, _) in enumerate(BAD):
        lines.append(raw)
        if k == 5:
            lines.append(json.dumps(GOOD[1], ensure_ascii=False).encode())
    lines.append(json.dumps(GOOD[2], ensure_ascii=False).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_drop_counts_each_reason(chatml, tmp_path):
    path = bad_rows_file(tmp_path / "mixed.jsonl")
    data_cfg = messages_cfg(bad_rows="drop", sources=[str(path)], seq_len=256)
    stats = SFTStats()
    rows = load_examples(data_cfg.sources, data_cfg, chatml, stats)
    expected = Encoder(chatml, data_cfg).encode([parsed(g, data_cfg) for g in GOOD])
    assert [r.ids.tolist() for r in rows] == [e.ids.tolist() for e in expected]
    assert [r.mask.tolist() for r in rows] == [e.mask.tolist() for e in expected]
    assert [masked_text(chatml, r) for r in rows] == ["Hello!<|im_end|>", "4<|im_end|>Yes.<|im_end|>",
                                                      "Salut 🙂<|im_end|>"]
    assert stats.dropped == Counter({"non_utf8": 1, "invalid_json": 1, "missing_field": 2, "bad_type": 5,
                                     "unknown_role": 1, "role_order": 6, "empty_content": 2,
                                     "bad_tool_call": 1, "bad_tools": 1, "wrong_format": 1})
    assert stats.dropped == Counter(reason for reason, _, _ in BAD)
    assert stats.rows == len(BAD) + len(GOOD)  # the blank line is not a row
    assert stats.truncated == 0
    # iter_turn_texts (what a BPE learns from) skips the bad rows too.
    from jaxtune.data.formats import iter_turn_texts

    assert list(iter_turn_texts(data_cfg)) == ["\n".join(m["content"] for m in g["messages"]) for g in GOOD]

    sft = prepare_sft(data_cfg.model_copy(update={"val_fraction": 0.0}), chatml)
    assert sft.stats.train_examples == 3 and sum(sft.stats.dropped.values()) == len(BAD)
    assert any(line.startswith("dropped rows: non_utf8 1, invalid_json 1, missing_field 2, bad_type 5, "
                               "unknown_role 1, role_order 6, empty_content 2") for line in sft.stats.lines())


def test_bad_rows_raise_names_the_first_bad_line(chatml, tmp_path):
    path = bad_rows_file(tmp_path / "mixed.jsonl")
    data_cfg = messages_cfg(sources=[str(path)])
    assert data_cfg.bad_rows == "raise"  # the default
    with pytest.raises(DataError) as err:
        load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    assert str(err.value).startswith(f"{path}:3: not valid UTF-8 (byte 46)")
    assert "data.bad_rows=drop" in str(err.value)


@pytest.mark.parametrize("k", range(len(BAD)), ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD)])
def test_bad_row_raise_message(chatml, tmp_path, k):
    _, raw, message = BAD[k]
    path = tmp_path / "one.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n\n" + raw + b"\n" + json.dumps(GOOD[2]).encode())
    data_cfg = messages_cfg(sources=[str(path)])
    with pytest.raises(DataError) as err:
        load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def test_unknown_bad_rows_policy_is_a_config_error():
    with pytest.raises(ConfigError, match=r"data\.bad_rows"):
        load_config(None, ["data.format=messages", "data.bad_rows=skip"])
    with pytest.raises(ConfigError, match=r"data\.overlong"):
        load_config(None, ["data.format=messages", "data.overlong=cut"])
    with pytest.raises(ConfigError, match=r"data\.loss_on"):
        load_config(None, ["data.format=messages", "data.loss_on=assistants"])
    with pytest.raises(ConfigError, match=r"data\.format"):
        load_config(None, ["data.format=chat"])
    c = load_config(None, ["data.format=sharegpt", "data.bad_rows=drop", "data.roles={bot: assistant}",
                           "data.fields={messages: turns}", "data.loss_on=last_assistant", "data.packing=false"])
    assert (c.data.format, c.data.bad_rows, c.data.roles, c.data.fields, c.data.loss_on, c.data.packing) == (
        "sharegpt", "drop", {"bot": "assistant"}, {"messages": "turns"}, "last_assistant", False)


def test_json_array_file(chatml, tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([GOOD[0], {"messages": "x"}, GOOD[2]]))
    data_cfg = messages_cfg(sources=[str(path)])
    with pytest.raises(DataError, match=rf"{path}\[1\]: 'messages' must be a non-empty list"):
        load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    stats = SFTStats()
    rows = load_examples(data_cfg.sources, data_cfg.model_copy(update={"bad_rows": "drop"}), chatml, stats)
    assert len(rows) == 2 and stats.dropped == Counter({"bad_type": 1})


# --- 5. overlong rows ---


@pytest.fixture
def overlong_rows(chatml, tmp_path):
    """(path, seq_len, [short, long answer, long prompt] encoded in full)."""
    short = conv("Hi", "Hello there.")
    long_answer = conv("Tell me a story.", " ".join(f"word{i}" for i in range(60)))
    long_prompt = conv(" ".join(f"question{i}" for i in range(60)), "ok")
    data_cfg = messages_cfg()
    full = Encoder(chatml, data_cfg).encode([parsed(r, data_cfg) for r in (short, long_answer, long_prompt)])
    first_trained = int(np.argmax(full[1].mask))
    seq_len = max(len(full[0].ids), first_trained + 4)
    assert len(full[1].ids) > seq_len + 1 and len(full[2].ids) > seq_len + 1
    assert int(np.argmax(full[2].mask)) > seq_len  # its reply lies wholly beyond the limit
    path = write_jsonl(tmp_path / "rows.jsonl", [short, long_answer, long_prompt])
    return path, seq_len, full


def test_overlong_truncate(chatml, overlong_rows):
    path, seq_len, full = overlong_rows
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:2]))  # short, long answer
    data_cfg = messages_cfg(sources=[str(path)], seq_len=seq_len)
    assert data_cfg.overlong == "truncate"  # the default
    stats = SFTStats()
    rows = load_examples(data_cfg.sources, data_cfg, chatml, stats)
    assert (stats.truncated, stats.dropped) == (1, Counter())
    assert rows[0].ids.tolist() == full[0].ids.tolist()
    assert len(rows[1].ids) == seq_len + 1
    assert rows[1].ids.tolist() == full[1].ids[: seq_len + 1].tolist()
    assert rows[1].mask.tolist() == full[1].mask[: seq_len + 1].tolist()
    assert rows[1].mask[1:].any()
    sft = prepare_sft(data_cfg.model_copy(update={"val_fraction": 0.0}), chatml)
    assert "truncated rows (data.overlong=truncate): 1" in sft.stats.lines()
    assert all(len(sft.train[r]["inputs"]) == seq_len for r in range(len(sft.train)))


def test_overlong_drop(chatml, overlong_rows):
    path, seq_len, full = overlong_rows
    data_cfg = messages_cfg(sources=[str(path)], seq_len=seq_len, overlong="drop")
    stats = SFTStats()
    rows = load_examples(data_cfg.sources, data_cfg, chatml, stats)
    assert [r.ids.tolist() for r in rows] == [full[0].ids.tolist()]
    assert (stats.truncated, stats.dropped) == (0, Counter({"overlong": 2}))


def test_overlong_raise(chatml, overlong_rows):
    path, seq_len, full = overlong_rows
    data_cfg = messages_cfg(sources=[str(path)], seq_len=seq_len, overlong="raise")
    with pytest.raises(DataError) as err:
        load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    assert str(err.value).startswith(f"{path}:2: {len(full[1].ids)} tokens, more than data.seq_len + 1 = "
                                     f"{seq_len + 1}")


def test_row_truncated_to_no_trained_token_is_dropped(chatml, overlong_rows):
    path, seq_len, full = overlong_rows
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[2])  # short, long prompt
    data_cfg = messages_cfg(sources=[str(path)], seq_len=seq_len)
    stats = SFTStats()
    rows = load_examples(data_cfg.sources, data_cfg, chatml, stats)
    assert [r.ids.tolist() for r in rows] == [full[0].ids.tolist()]
    assert stats.dropped == Counter({"no_trainable_tokens": 1})


# --- 6. packing ---


def test_pack_best_fit_decreasing():
    assert pack(np.array([5, 4, 3, 3, 2, 1]), 8) == [[0, 2], [1, 3, 5], [4]]
    # Largest first, each into the fullest bin it fits: [5, 3] [4, 3, 1] [2].
    assert pack(np.array([3, 1, 5, 2, 4, 3]), 8) == [[0, 2], [1, 4, 5], [3]]
    assert pack(np.array([1, 1, 1, 7, 7, 7]), 8) == [[0, 3], [1, 4], [2, 5]]
    assert pack(np.array([8, 8, 1]), 8) == [[0], [1], [2]]
    assert pack(np.array([], np.int64), 8) == []
    rng = np.random.default_rng(0)
    for capacity in (7, 64, 512):
        sizes = rng.integers(1, capacity + 1, size=300)
        bins = pack(sizes, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))  # every row exactly once
        assert all(sum(int(sizes[i]) for i in b) <= capacity for b in bins)
        assert all(b == sorted(b) and b for b in bins)
        assert bins == pack(sizes.copy(), capacity)  # deterministic
        assert len(bins) >= -(-int(sizes.sum()) // capacity)
        # Best fit: no two bins could be merged into one.
        loads = sorted(sum(int(sizes[i]) for i in b) for b in bins)
        assert len(loads) < 2 or loads[0] + loads[1] > capacity


def test_packed_rows_layout():
    rows = [Encoded(np.array([10, 11, 12, 13], np.int32), np.array([0, 0, 1, 1], bool)),
            Encoded(np.array([20, 21, 22], np.int32), np.array([0, 1, 1], bool)),
            Encoded(np.array([30, 31, 32, 33, 34, 35], np.int32), np.array([0, 0, 0, 1, 1, 0], bool))]
    examples = Examples.of(rows)
    assert examples.offsets.tolist() == [0, 4, 7, 13] and len(examples) == 3
    assert examples.positions_used.tolist() == [3, 2, 5]
    packed = PackedRows(examples, [[0, 1], [2]], seq_len=8)
    assert len(packed) == 2
    s = packed[0]
    assert {k: v.dtype for k, v in s.items()} == {"inputs": np.int32, "targets": np.int32, "positions": np.int32,
                                                  "segment_ids": np.int32, "loss_mask": np.float32}
    assert s["inputs"].tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert s["targets"].tolist() == [11, 12, 13, 21, 22, 0, 0, 0]  # row 0 ends with 13, never predicts 20
    assert s["positions"].tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert s["segment_ids"].tolist() == [1, 1, 1, 2, 2, 0, 0, 0]
    assert s["loss_mask"].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
    s = packed[1]
    assert s["inputs"].tolist() == [30, 31, 32, 33, 34, 0, 0, 0]
    assert s["targets"].tolist() == [31, 32, 33, 34, 35, 0, 0, 0]
    assert s["loss_mask"].tolist() == [0, 0, 1, 1, 0, 0, 0, 0]
    assert s["segment_ids"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]


def check_sequences(seqs: PackedRows, rows: list[Encoded], seq_len: int) -> None:
    """Every sequence: segments 1..k then padding; each segment is one row, shifted by one, positions from 0."""
    seen = []
    for r in range(len(seqs)):
        s = seqs[r]
        assert all(v.shape == (seq_len,) for v in s.values())
        seg = s["segment_ids"]
        k = int(seg.max())
        used = int((seg > 0).sum())
        assert seg[:used].tolist() == sorted(seg[:used].tolist()) and set(seg[:used].tolist()) == set(range(1, k + 1))
        assert not seg[used:].any() and not s["loss_mask"][used:].any()
        assert not s["inputs"][used:].any() and not s["targets"][used:].any() and not s["positions"][used:].any()
        for j, i in enumerate(seqs.bins[r], 1):
            where = np.flatnonzero(seg == j)
            ids, mask = rows[i].ids, rows[i].mask
            assert s["positions"][where].tolist() == list(range(len(ids) - 1))
            assert s["inputs"][where].tolist() == ids[:-1].tolist()
            assert s["targets"][where].tolist() == ids[1:].tolist()
            assert s["loss_mask"][where].tolist() == mask[1:].astype(np.float32).tolist()
            seen.append(i)
    assert sorted(seen) == list(range(len(rows)))


def many_rows(n: int, salt: str = "") -> list[dict]:
    rng = np.random.default_rng(len(salt) + n)
    words = ["alpha", "beta", "gamma", "naïve", "café", "🙂", "x ** 2", "def", "return", "こんにちは"]
    out = []
    for i in range(n):
        turns = [f"{salt}q{i} " + " ".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(2)]
        out.append(conv(*turns) if i % 3 else conv(*turns, turns[0] + " again", "fine", system="sys"))
    return out


def test_sequences_packed_and_unpacked(chatml, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", many_rows(40))
    seq_len = 96
    data_cfg = messages_cfg(sources=[str(path)], seq_len=seq_len, val_fraction=0.0)
    rows = load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    assert len(rows) == 40

    packed = sequences(rows, data_cfg)
    check_sequences(packed, rows, seq_len)
    assert len(packed) < len(rows)
    assert len(packed) == len(pack(Examples.of(rows).positions_used, seq_len))

    unpacked = sequences(rows, data_cfg.model_copy(update={"packing": False}))
    check_sequences(unpacked, rows, seq_len)
    assert len(unpacked) == len(rows) and unpacked.bins == [[i] for i in range(len(rows))]
    assert all(unpacked[r]["segment_ids"].max() == 1 for r in range(len(unpacked)))

    sft = prepare_sft(data_cfg, chatml)
    st = sft.stats
    assert (st.rows, st.train_examples, st.val_examples, st.val_sequences, sft.val) == (40, 40, 0, 0, None)
    assert st.train_sequences == len(packed) == len(sft.train)
    assert st.trained_tokens == sum(int(r.mask[1:].sum()) for r in rows)
    assert st.fill == pytest.approx(sum(len(r.ids) - 1 for r in rows) / (len(packed) * seq_len))
    assert 0.5 < st.fill <= 1.0
    assert st.lines()[0] == (f"fine-tuning data: 40 rows -> 40 training and 0 held-out examples; "
                             f"{len(packed)} training sequences ({st.fill:.1%} filled), {st.trained_tokens} "
                             "trained tokens")
    check_sequences(sft.train, rows, seq_len)
    no_pack = prepare_sft(data_cfg.model_copy(update={"packing": False}), chatml)
    assert no_pack.stats.train_sequences == 40


def test_validation_split(chatml, tmp_path):
    distinct = many_rows(60)
    path = write_jsonl(tmp_path / "rows.jsonl", distinct + distinct[:30] + distinct[:10])  # duplicates
    data_cfg = messages_cfg(sources=[str(path)], seq_len=128, val_fraction=0.3)
    sft = prepare_sft(data_cfg, chatml)
    ex = sft.train.examples
    train = [tuple(ex.row(i)[0].tolist()) for i in range(len(ex))]
    val = [tuple(sft.val.examples.row(i)[0].tolist()) for i in range(len(sft.val.examples))]
    assert len(train) + len(val) == 100 and train and val
    assert not set(train) & set(val)  # identical rows always share a split
    assert (sft.stats.train_examples, sft.stats.val_examples) == (len(train), len(val))
    assert sft.stats.val_sequences == len(sft.val)
    assert prepare_sft(data_cfg, chatml).stats.val_examples == len(val)  # deterministic
    # Order within a split follows the file.
    all_rows = load_examples(data_cfg.sources, data_cfg, chatml, SFTStats())
    assert train == [tuple(r.ids.tolist()) for r in all_rows if tuple(r.ids.tolist()) in set(train)]

    held = write_jsonl(tmp_path / "held.jsonl", many_rows(7, salt="held"))
    with_val = prepare_sft(data_cfg.model_copy(update={"val_sources": [str(held)]}), chatml)
    assert with_val.stats.train_examples == 100 and with_val.stats.val_examples == 7
    expected_val = load_examples([str(held)], data_cfg, chatml, SFTStats())
    got = with_val.val.examples
    assert [got.row(i)[0].tolist() for i in range(len(got))] == [r.ids.tolist() for r in expected_val]
    check_sequences(with_val.val, expected_val, 128)


def test_no_usable_rows(chatml, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"not json\n" + msgs((U, "x")) + b"\n")
    data_cfg = messages_cfg(sources=[str(path)], bad_rows="drop")
    with pytest.raises(DataError, match=r"no usable training rows \(2 read; dropped: .*invalid_json"):
        prepare_sft(data_cfg, chatml)


# --- 7. fixed-shape evaluation batches ---


def test_make_sequence_batches_pads_last_batch():
    rows = [Encoded(np.arange(1, 2 + k, dtype=np.int32), np.ones(k + 1, bool)) for k in range(1, 6)]
    seqs = PackedRows(Examples.of(rows), [[i] for i in range(5)], seq_len=8)
    batches = make_sequence_batches(seqs, batch_size=4, num_batches=10)
    assert len(batches) == 2
    for b in batches:
        assert set(b) == {"inputs", "targets", "positions", "segment_ids", "loss_mask"}
        assert all(v.shape == (4, 8) for v in b.values())
    for name in batches[0]:
        assert np.array_equal(batches[0][name], np.stack([seqs[g][name] for g in range(4)]))
        assert np.array_equal(batches[1][name][0], seqs[4][name])
        assert not batches[1][name][1:].any()  # empty sequences: no counted token, segment 0
    assert batches[1]["loss_mask"][1:].sum() == 0 and batches[1]["loss_mask"][0].sum() == 5

    assert len(make_sequence_batches(seqs, batch_size=4, num_batches=1)) == 1
    # Two processes: each takes its half of every global batch, in order; together the single-process batches.
    parts = [make_sequence_batches(seqs, batch_size=4, num_batches=10, process_index=p, process_count=2)
             for p in range(2)]
    for b in range(2):
        for name in batches[b]:
            assert parts[0][b][name].shape == (2, 8)
            assert np.array_equal(parts[0][b][name], batches[b][name][:2])
            assert np.array_equal(parts[1][b][name], batches[b][name][2:])
    with pytest.raises(DataError, match="does not split over 3 processes"):
        make_sequence_batches(seqs, batch_size=4, num_batches=1, process_index=0, process_count=3)


# --- 8. real data ---


def test_chat_en_corpus(tmp_path):
    path = SHARED_DATA / "chat-en.jsonl"
    if not path.is_file():
        pytest.skip(f"real-data fixture {path} is absent (outside this workplace)")
    data_cfg = messages_cfg(sources=[str(path)], chat_template="chatml", seq_len=2048, val_fraction=0.0,
                            overlong="raise", cache_dir=str(tmp_path / "cache"))
    tok = load_tokenizer(TokenizerConfig(kind="bpe", vocab_size=400, train_bytes=60_000,
                                         special_tokens=["<|im_start|>", "<|im_end|>"]), data_cfg)
    assert tok.chat_template is None
    sft = prepare_sft(data_cfg, tok)
    st = sft.stats
    assert (st.rows, st.train_examples, st.val_examples, st.truncated, sum(st.dropped.values())) == (
        2026, 2026, 0, 0, 0)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(records) == 2026
    ex = sft.train.examples
    im_end = tok.encode_chat(["<|im_end|>"])[0]
    assert len(im_end) == 1
    for i, record in enumerate(records):
        ids, mask = ex.row(i)
        expected = "".join(m["content"] + "<|im_end|>" for m in record["messages"] if m["role"] == "assistant")
        assert tok.decode(ids[mask].tolist()) == expected, i
        assert int((ids[mask] == im_end[0]).sum()) == len(record["messages"]) // 2
    check_sequences(sft.train, [Encoded(*ex.row(i)) for i in range(len(ex))], 2048)
    assert end_of_turn_ids(tok) == im_end


# --- 9. format detection, end-of-turn ids ---


@pytest.mark.parametrize("row,fmt", [
    (conv("a", "b"), "messages"),
    ({"conversations": [{"from": "human", "value": "a"}]}, "sharegpt"),
    ({"instruction": "a", "output": "b"}, "alpaca"),
    ({"instruction": "a", "input": "c", "output": "b"}, "alpaca"),
    ({"prompt": "a", "completion": "b"}, "prompt_completion"),
    ({"text": "plain"}, "text"),
])
def test_detect_format(tmp_path, row, fmt):
    assert detect_format(str(write_jsonl(tmp_path / "rows.jsonl", [row, {"text": "second row"}]))) == fmt
    (tmp_path / "rows.json").write_text(json.dumps([row]))
    assert detect_format(str(tmp_path / "rows.json")) == fmt


def test_detect_format_edge_cases(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert detect_format(str(tmp_path / "empty.jsonl")) == "text"
    (tmp_path / "blank_first.jsonl").write_text("\n" + json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    assert detect_format(str(tmp_path / "blank_first.jsonl")) == "prompt_completion"


def test_end_of_turn_ids(tok_dirs, chatml):
    assert end_of_turn_ids(chatml) == [chatml._tok.token_to_id("<|im_end|>")]
    assert end_of_turn_ids(fresh(tok_dirs, "plain")) == []  # no template: only EOS stops generation
    no_marker = fresh(tok_dirs, "chatml")
    no_marker.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    assert end_of_turn_ids(no_marker) == []  # the turn ends with a newline only
    no_marker.chat_template = no_marker.chat_template.replace("'\\n'", "' END OF TURN\\n'")
    assert no_marker.apply_chat_template([{"role": "user", "content": "x"}]) == "user: x END OF TURN\n"
    assert end_of_turn_ids(no_marker) == []  # several plain-text tokens: not one id to stop at


def test_prompts_stops_and_samples_for_generation(chatml):
    text = "What is 2 plus 2?"
    assert encode_prompt(chatml, text) == chatml.encode(text)
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert encode_prompt(chatml, text, chat=True) == chatml.encode_chat([rendered])[0]
    assert stop_ids(chatml) == [chatml.eos_id]
    assert stop_ids(chatml, chat=True) == [chatml.eos_id, chatml._tok.token_to_id("<|im_end|>")]
    assert format_sample("Hi?", "Hello.", chat=True) == "user: Hi?\nassistant: Hello."
    assert format_sample("Once", " upon", chat=False) == "Once upon"


def test_test_sequences_reads_every_row(chatml, tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", many_rows(12))
    data_cfg = messages_cfg(sources=["unused.jsonl"], seq_len=96, val_fraction=0.3, bad_rows="drop")
    source, info = test_sequences(data_cfg, chatml, str(path))
    rows = load_examples([str(path)], data_cfg, chatml, SFTStats())
    assert info == {"rows": 12, "examples": 12, "dropped": {}}
    check_sequences(source, rows, 96)  # nothing held out: every row is a test row
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"not json\n")
    with pytest.raises(DataError, match=r"--data .*bad.jsonl: no usable rows \(1 read, dropped {'invalid_json': 1}\)"):
        test_sequences(data_cfg, chatml, str(bad))


def test_shipped_gemma_template_renders_as_gemma_does():
    """``data.chat_template=gemma`` (for a Gemma base checkpoint, which has no template) renders every conversation
    exactly as Gemma 3's own template (the reference copy above): with and without a system message, padded
    content, multi-turn, and with the generation prompt."""
    jinja2 = pytest.importorskip("jinja2")
    ours, theirs = (jinja2.Environment().from_string(t) for t in (SHIPPED_TEMPLATES["gemma"], GEMMA))
    padded = [dict(m) for m in CONVO]
    padded[2]["content"] = "\n  " + ASSISTANT[0] + "  \n"
    convos = [list(CONVO), list(CONVO[1:]), padded, list(CONVO[:2]), list(CONVO[1:2])]
    for convo in convos:
        for gen in (False, True):
            a, b = (t.render(messages=convo, bos_token="<bos>", add_generation_prompt=gen) for t in (ours, theirs))
            assert a == b
    assert ours.render(messages=list(CONVO[1:2]), bos_token="<bos>", add_generation_prompt=True) == (
        f"<bos><start_of_turn>user\n{CONVO[1]['content']}<end_of_turn>\n<start_of_turn>model\n")


def test_bos_of_the_checkpoint_tokenizer(tmp_path):
    """A tokenizer whose post-processor puts <bos> before a text (Gemma, Llama 3): plain-text prompts and
    prompt/completion rows start with it (untrained), as transformers encodes them; chat rows get it from the
    template only; a tokenizer without one adds nothing."""
    from tokenizers import processors

    raw = _train_bpe(iter(["hello world, a plain text"] * 20), 300, ("<bos>",))
    plain_dir, bos_dir = tmp_path / "plain", tmp_path / "bos"
    for d in (plain_dir, bos_dir):
        d.mkdir()
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<bos>"}))
    raw.save(str(plain_dir / "tokenizer.json"))
    bos = raw.token_to_id("<bos>")
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    raw.save(str(bos_dir / "tokenizer.json"))
    plain_tok, bos_tok = (load_tokenizer(TokenizerConfig(kind="hf", path=str(d)), messages_cfg())
                          for d in (plain_dir, bos_dir))
    assert plain_tok.bos_prefix == () and bos_tok.bos_prefix == (bos,)
    assert encode_prompt(bos_tok, "hello") == [bos, *plain_tok.encode("hello")]
    assert encode_prompt(plain_tok, "hello") == plain_tok.encode("hello")
    row = Example(prompt="hello", completion=" world")
    (with_bos,), (without,) = (Encoder(t, messages_cfg(format="prompt_completion")).encode([row])
                               for t in (bos_tok, plain_tok))
    assert with_bos.ids.tolist() == [bos, *without.ids.tolist()]
    assert with_bos.mask.tolist() == [False, *without.mask.tolist()]
    assert question(bos_tok, row)[0] == [bos, *plain_tok.encode("hello")]
