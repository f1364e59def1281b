"""The project's shared data folder beside the checkout (``../shared/data``): real text the tests read (chat-en.jsonl,
instructions.jsonl), kept out of the repository."""

from __future__ import annotations

from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
