"""The tools the shipped agent recipe calls (``objective.tools: jaxtune.recipe_tools``, `agent-quickstart`), in TRL's
form: plain typed functions with Google-style docstrings, listed in ``tools``. Standard library only: the tools
worker imports this module, not the trainer."""

from __future__ import annotations


def multiply(a: int, b: int) -> str:
    """Multiplies two whole numbers.

    Args:
        a: a factor
        b: the other factor
    """
    return str(int(a) * int(b))


tools = [multiply]
