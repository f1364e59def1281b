"""Fine-tuning data the package generates, so a fine-tuning quickstart runs offline with nothing to download.

``synthetic:arithmetic``: 4,000 chat rows (OpenAI ``messages``) asking for sums, differences and products of
small numbers in a few phrasings, answered in one sentence. A tiny model learns the answer format in a few
hundred steps and then the arithmetic itself slowly, so held-out loss and the before/after samples show it learning.
Deterministic: the same rows on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_QUESTIONS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Please tell me {a} {op} {b}.",
              "How much is {a} {op} {b}?")
_OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
_SYSTEM = "You are a calculator. Answer in one sentence."


def arithmetic(rows: int = 4000, seed: int = 0) -> Iterator[dict]:
    rng = random.Random(seed)
    for _ in range(rows):
        op = rng.choice(list(_OPS))
        a, b = rng.randint(0, 99), rng.randint(0, 99 if op != "times" else 12)
        question = rng.choice(_QUESTIONS).format(a=a, op=op, b=b)
        answer = f"{a} {op} {b} is {_OPS[op](a, b)}."
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.5:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        yield {"messages": messages}


GENERATORS = {"arithmetic": arithmetic}
