"""Unpaired preference rows (`jaxtune.data.unpaired`, ``data.format: unpaired``, TRL's KTO data): both of TRL's forms
(text and messages) read and encoded as a preference pair's sequences are, the loss on the completion only; the bad
rows named; each item its row and its KL row (its prompt, then the previous row's completion in its chunk of a batch),
as TRL's ``add_kl_completion_ids`` pairs them; prompts cut to data.max_prompt_length; the labels as 1.0 / 0.0."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from helpers.rows import A, U, chatml_cfg, m, write_jsonl

from jaxtune.data import DataError
from jaxtune.data.formats import detect_format
from jaxtune.data.row_policy import completion_settings
from jaxtune.data.synthetic import arithmetic_unpaired
from jaxtune.data.unpaired import UnpairedRows, UnpairedStats, load_unpaired, prepare_unpaired

IM_END = "<|im_end|>"
ROWS = [
    {"prompt": [m(U, "What is 2 plus 2?")], "completion": [m(A, "4")], "label": True},
    {"prompt": [m(U, "Say hi.")], "completion": [m(A, "Goodbye, then.")], "label": False},
    {"prompt": "Text prompt:", "completion": " text reply", "label": True},
    {"prompt": [m(U, "Name a colour.")], "completion": [m(A, "Blue")], "label": False},
]


def load(tok, data_cfg, stats=None):
    completion_settings(data_cfg, tok)
    return load_unpaired(data_cfg.sources, data_cfg, tok, stats if stats is not None else UnpairedStats())


def test_rows_of_both_forms_encode_with_the_loss_on_the_completion(tok, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert detect_format(str(path)) == "unpaired"
    rows = load(tok, chatml_cfg("unpaired", sources=[str(path)]))
    assert [r.label for r in rows] == [True, False, True, False]
    trained = [tok.decode(r.sequence.ids[r.sequence.mask].tolist()) for r in rows]
    assert trained == [f"4{IM_END}", f"Goodbye, then.{IM_END}", " text reply" + tok.decode([tok.eos_id]),
                       f"Blue{IM_END}"]
    for r in rows:  # the prompt ends where the loss starts
        assert r.prompt == int(np.argmax(r.sequence.mask)) and not r.sequence.mask[:r.prompt].any()


def test_each_item_holds_its_row_and_its_kl_row_from_the_previous_rows_completion(tok, tmp_path):
    """Chunks of 2 rows (a batch of 2): row 0's KL sequence is its prompt with row 1's completion, row 1's its prompt
    with row 0's; rows 2 and 3 likewise between them (TRL's rotation by one within a batch)."""
    rows = load(tok, chatml_cfg("unpaired", sources=[str(write_jsonl(tmp_path / "rows.jsonl", ROWS))]))
    items = UnpairedRows.of(rows, 64, chunk=2)
    assert len(items) == 4
    for i, other in enumerate([1, 0, 3, 2]):
        item, own, prev = items[i], rows[i], rows[other]
        assert item["inputs"].shape == (2, 64) and item["labels"].tolist() == [float(own.label)] * 2
        n = len(own.sequence.ids) - 1
        assert item["inputs"][0, :n].tolist() == own.sequence.ids[:-1].tolist()
        kl = np.concatenate([own.sequence.ids[:own.prompt], prev.sequence.ids[prev.prompt:]])
        k = len(kl) - 1
        assert item["inputs"][1, :k].tolist() == kl[:-1].tolist() and item["targets"][1, :k].tolist() == kl[1:].tolist()
        mask = np.concatenate([np.zeros(own.prompt, bool), prev.sequence.mask[prev.prompt:]])
        assert item["loss_mask"][1, :k].tolist() == mask[1:].astype(np.float32).tolist()
        assert not item["loss_mask"][:, max(n, k):].any()


@pytest.mark.parametrize("row, reason, says", [
    ({"prompt": "p", "completion": "c", "label": "yes"}, "bad_type", "'label' is 'yes'; it must be true"),
    ({"prompt": "p", "completion": " ", "label": True}, "empty_content", "the completion is empty"),
    ({"prompt": [m(A, "x")], "completion": [m(A, "y")], "label": True}, "role_order",
     "the prompt's last turn is 'assistant', not 'user'"),
    ({"prompt": "p", "label": True}, "missing_field", "no 'completion' field"),
])
def test_bad_rows_are_named(tok, tmp_path, row, reason, says):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], row])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{says}"):
        load(tok, chatml_cfg("unpaired", sources=[str(path)]))
    stats = UnpairedStats()
    assert len(load(tok, chatml_cfg("unpaired", sources=[str(path)], bad_rows="drop"), stats)) == 1
    assert stats.dropped == Counter({reason: 1})


def test_max_prompt_length_and_the_synthetic_rows(tok, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    whole = load(tok, chatml_cfg("unpaired", sources=[str(path)]))
    stats = UnpairedStats()
    cut = load(tok, chatml_cfg("unpaired", sources=[str(path)], max_prompt_length=4), stats)
    assert stats.prompts_cut == sum(r.prompt > 4 for r in whole) > 0
    for a, b in zip(whole, cut):
        assert b.prompt == min(a.prompt, 4)
        assert b.sequence.ids.tolist() == a.sequence.ids[a.prompt - b.prompt:].tolist()
    data = prepare_unpaired(chatml_cfg("unpaired", sources=["synthetic:arithmetic-unpaired"], val_fraction=0.05),
                            tok, batch_size=8)
    assert data.stats.train_rows + data.stats.val_rows == 10_000
    assert abs(data.stats.desirable - data.stats.train_rows / 2) < 0.05 * data.stats.train_rows
    first = next(arithmetic_unpaired())
    assert first["label"] is True and first["completion"][0]["role"] == "assistant"


def test_pairs_unpaired_with_data_unpair_are_trls_unpair_preference_dataset(tok, tmp_path, monkeypatch):
    """data.unpair reads preference pairs (text and conversational, extra fields kept) as TRL 1.16's
    unpair_preference_dataset makes them: per batch of rows the chosen halves labelled true, then the rejected ones
    labelled false: the same rows in the same order (batches of 2 here, as TRL's map with batch_size=2), each
    encoded as an unpaired row is; a row already unpaired passes as it is. Without the flag a pair is refused,
    naming the flag; the flag with another format is refused."""
    import datasets
    from trl.data_utils import unpair_preference_dataset

    from jaxtune.config import ConfigError, load_config
    from jaxtune.data import row_policy

    pairs = [{"prompt": [m(U, "What is 2 plus 2?")], "chosen": [m(A, "4")], "rejected": [m(A, "5")], "id": 1},
             {"prompt": [m(U, "Say hi.")], "chosen": [m(A, "Hi!")], "rejected": [m(A, "No.")], "id": 2},
             {"prompt": [m(U, "Name a colour.")], "chosen": [m(A, "Blue")], "rejected": [m(A, "Seven")], "id": 3}]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    monkeypatch.setattr(row_policy, "UNPAIR_BATCH", 2)
    cfg = chatml_cfg("unpaired", sources=[str(path)]).model_copy(update={"unpair": True})
    stats = UnpairedStats()
    rows = load(tok, cfg, stats)
    theirs = unpair_preference_dataset(datasets.Dataset.from_list(pairs), batch_size=2).to_list()
    assert [t["label"] for t in theirs] == [True, True, False, False, True, False]
    expected = load(tok, chatml_cfg("unpaired", sources=[str(write_jsonl(tmp_path / "theirs.jsonl", theirs))]))
    assert [(r.sequence.ids.tolist(), r.label, r.prompt) for r in rows] == \
        [(r.sequence.ids.tolist(), r.label, r.prompt) for r in expected]
    assert stats.rows == 6
    with pytest.raises(DataError, match=r"this row is a preference pair .* or set data.unpair=true"):
        load(tok, chatml_cfg("unpaired", sources=[str(path)]))
    with pytest.raises(ConfigError, match="data.unpair reads preference pairs as unpaired rows"):
        load_config(None, ["data.format=preference", "objective.name=dpo", "data.unpair=true"])


def test_held_out_items_mix_the_labels_and_keep_their_kl_rows(tok, tmp_path):
    """data.unpair gives each batch of pairs' chosen halves first, then the rejected ones; the held-out items are put
    in an order that spreads each label evenly (each label's own order kept), so every held-out batch holds both;
    each item keeps the KL row it was made with."""
    from jaxtune.data.pipeline import make_training_data
    from jaxtune.data.synthetic import arithmetic_preferences
    from jaxtune.data.unpaired import mixed_labels

    assert mixed_labels([True, True, True, False]) == [0, 1, 3, 2]
    assert mixed_labels([True, True, False, False]) == [0, 2, 1, 3]
    assert mixed_labels([False, False]) == [0, 1]
    rows = load(tok, chatml_cfg("unpaired", sources=[str(write_jsonl(tmp_path / "rows.jsonl", ROWS))]))
    rows = [rows[0], rows[2], rows[1], rows[3]]  # desirable, desirable, undesirable, undesirable
    plain, mixed = UnpairedRows.of(rows, 64, chunk=4), UnpairedRows.of(rows, 64, chunk=4, mixed=True)
    for k, i in enumerate([0, 2, 1, 3]):
        assert all(np.array_equal(mixed[k][key], plain[i][key]) for key in plain[i])

    path = write_jsonl(tmp_path / "pairs.jsonl", itertools.islice(arithmetic_preferences(), 100))
    cfg = chatml_cfg("unpaired", sources=[str(path)], unpair=True, val_fraction=0.2)
    data = make_training_data(cfg, tok, batch_size=4, seed=0, eval_batches=4)
    assert len(data.eval_batches) == 4
    for batch in data.eval_batches:
        labels = batch["labels"][:, 0]
        assert 0 < labels.sum() < len(labels), labels


def test_rows_of_one_label_are_warned_about_and_pairs_read_as_rows(tmp_path):
    """A split whose rows all share a label gets one warning line naming its sources and what to do. The shipped
    preference pairs read with data.unpair (and the refusal without it names the flag)."""
    from jaxtune.data.sources import Synthetic, resolve_sources
    from jaxtune.data.unpaired import label_warnings

    cfg = chatml_cfg("unpaired", sources=["a.jsonl", "b.jsonl"], val_sources=["held.jsonl"])
    both = UnpairedStats(train_rows=10, val_rows=4, desirable=3, val_desirable=1)
    assert label_warnings(cfg, both) == []
    (line,) = label_warnings(cfg, UnpairedStats(train_rows=10, val_rows=4, desirable=0, val_desirable=2))
    assert line == ("warning: a.jsonl, b.jsonl: all 10 training rows are undesirable (label false): rewards/chosen and "
                    "rewards/margins have no rows to be measured on and are not reported; add rows of the other "
                    "label, or read preference pairs with data.unpair=true")
    (line,) = label_warnings(cfg, UnpairedStats(train_rows=10, val_rows=4, desirable=5, val_desirable=4))
    assert line.startswith("warning: held.jsonl: all 4 held-out rows are desirable (label true): rewards/rejected")

    shipped = chatml_cfg("unpaired", sources=["synthetic:arithmetic-preferences"])
    with pytest.raises(DataError, match=r"holds preference rows; set data.format=preference, or data.unpair=true"):
        resolve_sources(shipped)
    assert resolve_sources(shipped.model_copy(update={"unpair": True})) == [Synthetic("arithmetic-preferences")]
