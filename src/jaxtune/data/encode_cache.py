"""Encoded rows kept in ``data.cache_dir``: a run that reads the same rows again (a re-run with another lr, a resumed
run) takes their token ids and trained masks from there instead of rendering every chat template and tokenizing again
(6.6 s for 10,000 preference pairs at SmolLM2's vocabulary, the largest part of a re-run's setup: issue 49).

An entry holds one batch of rows (`jaxtune.data.sft.Encoder.encode`'s), under a key that hashes everything the
encoding reads: the rows themselves (their messages, or prompt and completion) and the prompt turns each one keeps
untrained, what is trained (``data.loss_on``), the tokenizer (its fingerprint, chat template, special-token
spellings, BOS and EOS), the source of the modules that render and encode, and the versions of ``tokenizers`` and
``jinja2``. An entry is a NumPy ``.npz`` of plain arrays (read with ``allow_pickle=False``), written to a temporary
file and renamed into place; one that does not read back whole, or does not fit its rows, is encoded again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from jaxtune.data.encoded import Encoded
from jaxtune.data.formats import Example

_FORMAT = 1  # what an entry holds; a change to it takes a new number
_MODULES = ("sft.py", "tokenizer.py", "chat.py", "encode_worker.py", "encoded.py", "formats.py")


def _code() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in _MODULES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


class EncodeCache:
    """Batches of `Encoded` rows in ``directory``, keyed by `key`; `read` gives None when an entry is missing or
    damaged."""

    def __init__(self, directory: str | Path, tokenizer: Any, loss_on: str):
        import jinja2  # imported where it is used, as the chat templates' renderer does

        self.directory = Path(directory).expanduser() / "encoded"
        self.salt = json.dumps([_FORMAT, _code(), tokenizers.__version__, jinja2.__version__, tokenizer.fingerprint,
                                tokenizer.chat_template, tokenizer.special_strings(), list(tokenizer.bos_prefix),
                                tokenizer.eos_id, loss_on], sort_keys=True, default=str)

    def key(self, examples: list[Example], prompt_turns: list[int] | None) -> str:
        # a row's tools only where it has some: the keys of rows without tools stay what they were
        rows = [[ex.messages, ex.prompt, ex.completion, *([ex.tools] if ex.tools else [])] for ex in examples]
        text = json.dumps([self.salt, rows, prompt_turns], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.npz"

    def read(self, key: str, examples: list[Example]) -> list[Encoded] | None:
        """The entry's rows (each with its ``example``), or None when there is no whole entry for ``examples``."""
        try:
            with np.load(self.path(key), allow_pickle=False) as f:
                ids, mask, offsets = f["ids"], f["mask"], f["offsets"]
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            return None
        if (len(offsets) != len(examples) + 1 or offsets[0] != 0 or offsets[-1] != len(ids)
                or len(mask) != len(ids) or np.any(np.diff(offsets) < 0)):
            return None
        return [Encoded(ids[a:b], mask[a:b], ex) for a, b, ex in zip(offsets[:-1], offsets[1:], examples)]

    def write(self, key: str, rows: list[Encoded]) -> None:
        """Keeps ``rows`` under ``key``; a cache that cannot be written is skipped (the rows were encoded)."""
        lengths = np.array([len(r.ids) for r in rows], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ids = np.concatenate([r.ids for r in rows]).astype(np.int32) if rows else np.zeros(0, np.int32)
        mask = np.concatenate([r.mask for r in rows]).astype(bool) if rows else np.zeros(0, bool)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".partial-", suffix=".npz")
            with os.fdopen(fd, "wb") as out:
                np.savez(out, ids=ids, mask=mask, offsets=offsets)
            os.replace(tmp, self.path(key))
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
