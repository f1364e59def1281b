"""The chat tokenizers the row-format tests read (ChatML, Llama 3, Gemma... from `helpers.rows`), built once per
module; a module that needs others defines its own ``tok_dirs``."""

from __future__ import annotations

import pytest
from helpers.rows import build_chat_tokenizers, fresh


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    return build_chat_tokenizers(tmp_path_factory.mktemp("tokenizers"))


@pytest.fixture
def tok(tok_dirs):
    """A fresh copy of the ChatML tokenizer (tests may set its chat template)."""
    return fresh(tok_dirs)
