"""Rows of data files as the data tests write and parse them: a JSONL file of rows, a row parsed under a data config,
and what the tests of the formats trained on completions share (test_preference.py, test_prompts.py): their
tokenizers (`chat_templates.build_tokenizer`'s tiny BPE, with ChatML's special tokens and without) and data config,
messages, raw JSONL lines, generated phrases, and a file of bad rows among good ones with the checks of what reading
it raises (data.bad_rows=raise)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import pytest

from helpers.chat_templates import build_tokenizer
from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import DataError, load_tokenizer
from jaxtune.data.formats import Example, Pair, Prompt, field_names, parse_row

U, A, S = "user", "assistant", "system"


def write_jsonl(path: Path, rows: Iterable) -> Path:
    """``rows`` as JSON lines (non-ASCII kept, UTF-8) in ``path``; ``path``."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def build_chat_tokenizers(root: Path) -> Path:
    """``root``/chatml (ChatML's special tokens, no template of its own) and ``root``/plain; ``root``."""
    build_tokenizer(root / "chatml", None, ["<|im_start|>", "<|im_end|>"], "<|endoftext|>")
    build_tokenizer(root / "plain", None, [], "<|endoftext|>")
    return root


def fresh(tok_dirs, name: str = "chatml"):
    """A new Tokenizer (data.chat_template sets its template, so tests do not share one)."""
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(tok_dirs / name)), DataConfig())


def chatml_cfg(default_format: str, **kw) -> DataConfig:
    """A DataConfig of ``kw``, by default of ``default_format`` with ChatML's template and no held-out split."""
    kw.setdefault("format", default_format)
    kw.setdefault("chat_template", "chatml")
    kw.setdefault("val_fraction", 0.0)
    return DataConfig(**kw)


def parsed(row: dict, data_cfg: DataConfig) -> Example | Pair | Prompt:
    return parse_row(row, data_cfg, field_names(data_cfg))


def m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def raw(line) -> bytes:
    """A JSONL line: ``line`` as it is when bytes, else JSON (non-ASCII kept)."""
    return line if isinstance(line, bytes) else json.dumps(line, ensure_ascii=False).encode()


def phrases(n: int, salt: str = "") -> Callable[[], str]:
    """A maker of phrases of 1 to 7 words, some non-ASCII, seeded by ``n`` (the rows to make) and ``salt``."""
    rng = np.random.default_rng(n + len(salt))
    words = ["alpha", "beta", "gamma", "naïve", "café", "🙂", "x ** 2", "def", "return"]
    return lambda: " ".join(rng.choice(words, size=int(rng.integers(1, 8))))


# --- bad rows: ``bad`` is [(reason, raw line, what the error says)], ``good`` three good rows ---


def bad_rows_file(path: Path, good: list, bad: list) -> Path:
    """good[0], a blank line, the bad rows with good[1] among them, then good[2]."""
    lines = [raw(good[0]), b""]
    for k, (_, line, _) in enumerate(bad):
        lines.append(raw(line))
        if k == 5:
            lines.append(raw(good[1]))
    lines.append(raw(good[2]))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def assert_first_bad_line_named(read: Callable[[Path], object], path: Path) -> None:
    """``read(path)`` of a `bad_rows_file` (its first bad row non-UTF-8) raises naming line 3 and what to do."""
    with pytest.raises(DataError) as err:
        read(path)
    assert str(err.value).startswith(f"{path}:3: not valid UTF-8")
    assert str(err.value).endswith("fix the row or set data.bad_rows=drop")


def assert_bad_row_message(read: Callable[[Path], object], path: Path, good: list, line, message: str) -> None:
    """``read`` of good[0], a blank line, ``line`` and good[2] written to ``path`` raises naming line 3 and saying
    ``message``."""
    path.write_bytes(raw(good[0]) + b"\n\n" + raw(line) + b"\n" + raw(good[2]) + b"\n")
    with pytest.raises(DataError) as err:
        read(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)


def random_pairs(b: int, t: int, vocab: int, prompt: tuple[int, int], completion: tuple[int, int],
                 seed: int = 0) -> dict[str, np.ndarray]:
    """``b`` random preference pairs laid out as the pipeline does, (b, 2, t): random tokens, the loss mask on each
    side's completion after a shared prompt of ``prompt`` = [lo, hi) tokens, each completion [lo, hi) long."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab, (b, 2, t)).astype(np.int32)
    mask = np.zeros((b, 2, t), np.float32)
    for row in range(b):
        start = rng.integers(*prompt)
        for side, n in enumerate(rng.integers(*completion, 2)):
            mask[row, side, start:start + n] = 1.0
    return {"inputs": inputs, "targets": np.roll(inputs, -1, -1), "loss_mask": mask,
            "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, 2, t)).copy(),
            "segment_ids": np.ones((b, 2, t), np.int32)}
