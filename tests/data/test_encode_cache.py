"""Encoded rows kept in ``data.cache_dir`` (`jaxtune.data.encode_cache`, issue 49: a re-run's setup): a second
encoding of the same rows reads them back equal without rendering or tokenizing; what the encoding reads (the rows,
their prompt turns, ``data.loss_on``, the chat template) keys the entry; a damaged entry is encoded again; and the
preference data of a re-run equals the first run's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers.chat_templates import CONVO, build_tokenizer, messages_cfg
from helpers.rows import write_jsonl

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import load_tokenizer
from jaxtune.data.formats import Example
from jaxtune.data.preference import prepare_preference
from jaxtune.data.sft import Encoder
from jaxtune.data.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok") / "chatml"
    build_tokenizer(root, CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")
    return root


def _tok(tok_dir) -> Tokenizer:
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(tok_dir)), DataConfig())


def _rows(n: int) -> list[Example]:
    return [Example(messages=(*CONVO[:2], {"role": "assistant", "content": f"answer {i}: {i * i}"}))
            for i in range(n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x.ids, y.ids) and np.array_equal(x.mask, y.mask)
                                    and x.example == y.example for x, y in zip(a, b))


def test_a_second_encoding_reads_the_first_back_without_encoding(tmp_path, tok_dir, monkeypatch):
    cfg = messages_cfg(cache_dir=str(tmp_path))
    rows = _rows(5)
    first = Encoder(_tok(tok_dir), cfg, cached=True).encode(rows)
    assert len(list((tmp_path / "encoded").glob("*.npz"))) == 1
    assert _same(first, Encoder(_tok(tok_dir), cfg).encode(rows))  # what the cache holds is the encoding itself

    def refuse(*_):
        raise AssertionError("encoded again")

    monkeypatch.setattr(Encoder, "_encode", refuse)
    again = Encoder(_tok(tok_dir), cfg, cached=True).encode(rows)
    assert _same(first, again) and all(r.example is ex for r, ex in zip(again, rows))


def test_what_the_encoding_reads_keys_the_entry(tmp_path, tok_dir):
    cfg = messages_cfg(cache_dir=str(tmp_path))
    rows = _rows(3)
    Encoder(_tok(tok_dir), cfg, cached=True).encode(rows)
    other_template = _tok(tok_dir)
    other_template.chat_template = CHATML.replace("\n{{ m['content'] }}", ": {{ m['content'] }}")
    changed = [
        (_tok(tok_dir), cfg, [*rows[:2], dataclasses.replace(rows[2], messages=rows[1].messages)], None),  # a row
        (_tok(tok_dir), cfg, rows, [2, 0, 0]),  # its prompt turns
        (_tok(tok_dir), messages_cfg(cache_dir=str(tmp_path), loss_on="all"), rows, None),  # what is trained
        (other_template, cfg, rows, None),  # the chat template
    ]
    for n, (tok, c, r, turns) in enumerate(changed, start=2):
        out = Encoder(tok, c, cached=True).encode(r, turns)
        assert _same(out, Encoder(tok, c).encode(r, turns))
        assert len(list((tmp_path / "encoded").glob("*.npz"))) == n


def test_a_damaged_entry_is_encoded_again(tmp_path, tok_dir):
    cfg = messages_cfg(cache_dir=str(tmp_path))
    rows = _rows(4)
    first = Encoder(_tok(tok_dir), cfg, cached=True).encode(rows)
    (entry,) = (tmp_path / "encoded").glob("*.npz")
    whole = entry.read_bytes()
    with np.load(entry) as f:  # a whole file that does not fit the rows: one row fewer, or ids past the last row's
        ids, mask, offsets = f["ids"], f["mask"], f["offsets"]
    misfits = []
    for kept in ((ids, mask, offsets[:-1]), (ids, mask[:-1], offsets)):
        np.savez(tmp_path / "misfit.npz", **dict(zip(("ids", "mask", "offsets"), kept)))
        misfits.append((tmp_path / "misfit.npz").read_bytes())
    for damaged in (whole[: len(whole) // 2], b"", whole.replace(b"offsets", b"offsetz"), *misfits):
        entry.write_bytes(damaged)
        assert _same(first, Encoder(_tok(tok_dir), cfg, cached=True).encode(rows))
        assert entry.read_bytes() == whole  # written again, whole
    assert not list((tmp_path / "encoded").glob(".partial-*"))


def test_a_rerun_reads_the_same_preference_data(tmp_path, tok_dir, monkeypatch):
    pairs = [{"prompt": [{"role": "user", "content": f"{i} + {i} = ?"}],
              "chosen": [{"role": "assistant", "content": f"{2 * i}"}],
              "rejected": [{"role": "assistant", "content": f"{2 * i + 1}"}]} for i in range(40)]
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    cfg = DataConfig(format="preference", sources=[str(source)], seq_len=64, val_fraction=0.1,
                     cache_dir=str(tmp_path / "cache"))
    first = prepare_preference(cfg, _tok(tok_dir))
    monkeypatch.setattr(Encoder, "_encode", lambda *_: pytest.fail("encoded again"))
    again = prepare_preference(cfg, _tok(tok_dir))
    assert again.stats == first.stats and again.held_out == first.held_out
    for a, b in ((first.train, again.train), (first.val, again.val)):
        assert len(a) == len(b) and all(
            all(np.array_equal(x, y) for x, y in zip(a[i].values(), b[i].values())) for i in range(len(a)))
