"""A checkpoint jaxtune has no native implementation of: `UnsupportedModelError`, the hint its messages end with
(`TORCHAX_HINT`), and `require`, which refuses a config.json value a native family does not implement."""

from __future__ import annotations

from typing import Any

TORCHAX_HINT = "set model.backend: torchax to train it through its PyTorch implementation"


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or config field jaxtune has no native implementation of."""


def require(c: dict[str, Any], key: str, allowed: tuple[Any, ...], family: str) -> None:
    """Refuse a config.json value jaxtune does not implement natively, naming the field. A missing key takes
    the first allowed value (transformers' default)."""
    value = c.get(key, allowed[0])
    if value not in allowed:
        raise UnsupportedModelError(f"config.json: {key}={value!r} is not supported by the native {family} model "
                                    f"(supported: {', '.join(map(repr, allowed))}); {TORCHAX_HINT}")
