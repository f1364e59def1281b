"""Whether an export's tokenizer pads a batch in transformers with the pad id its model reads as padding (the export
tests of every kind: test_finetune.py, test_reward_model.py, torchax_backend/test_train.py)."""

from __future__ import annotations

import json
from pathlib import Path

TEXTS = ["a", "a longer text"]


def base_config_dir(adapter: Path) -> Path:
    """The base model directory a PEFT adapter directory names (adapter_config.json's ``base_model_name_or_path``)."""
    return Path(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])


def assert_pads_as_config(directory: Path, config_dir: Path | None = None) -> int:
    """``AutoTokenizer.from_pretrained(directory)(TEXTS, padding=True)`` pads the shorter text, and with the
    ``pad_token_id`` of ``config_dir``'s config.json (default: ``directory``'s; an adapter's: its base's, or for a
    reward model's adapter the classifier's). Returns the pad id."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(TEXTS, padding=True, return_tensors="np")
    pad = json.loads(((config_dir or directory) / "config.json").read_text())["pad_token_id"]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert pad is not None and tokenizer.pad_token_id == pad, (tokenizer.pad_token, tokenizer.pad_token_id, pad)
    assert (mask == 0).any() and (ids[mask == 0] == pad).all(), (ids, mask)
    return pad
