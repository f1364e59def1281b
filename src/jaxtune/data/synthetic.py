"""Fine-tuning data that comes with the package, so a fine-tuning run needs nothing downloaded: ``synthetic:NAME``.

``synthetic:arithmetic`` (generated): 10,000 chat rows (OpenAI ``messages``), one for every sum of two whole numbers
from 0 to 99, in a seeded order and a few phrasings. The assistant works the sum digit by digit before answering::

    user: What is 47 plus 85?
    assistant: 7+5=12, 4+8+1=13, so 132.

Every sum appears exactly once, so a held-out row (``data.val_fraction``) asks a sum the model never saw: answering it
is the skill (single-digit sums and the carry), not recall. Written digit by digit (and with a tokenizer that keeps
digits apart: the quickstart's 300-token BPE), each answer token is a small step a tiny model learns in a few hundred
steps; the same sums answered at once ("47 plus 85 is 132.") stay near 0% held-out exact match at that budget, the
model guessing the digits of the total.

``synthetic:arithmetic-preferences`` (generated): the same 10,000 sums in the same order and phrasings, as preference
pairs (``data.format: preference``, TRL's conversational form; or two KTO rows each with ``data.format: unpaired`` and
``data.unpair: true``): the worked answer chosen, and rejected the mistake a half-trained model makes. A sum with a
carry has the carry forgotten::

    prompt: What is 47 plus 85?
    chosen: 7+5=12, 4+8+1=13, so 132.
    rejected: 7+5=12, 4+8=12, so 122.

and a sum without one has one digit wrong by one, in the ones or the tens (which, and which way, seeded), its working
agreeing with it ("3+5=8, 2+4=7, so 78." for 23 plus 45): never the right answer.

``synthetic:arithmetic-unpaired`` (generated): the same pairs unpaired (``data.format: unpaired``, TRL's KTO form):
each sum asked once, its worked answer labelled true on even rows and its slip labelled false on odd ones.

``synthetic:arithmetic-prompts`` (generated): the same 10,000 sums in the same order and phrasings, as prompts with
their answer (``data.format: prompts``, TRL's conversational form), for RL with a verifiable reward (``grpo`` with
the ``exact_number`` reward on ``answer``)::

    prompt: What is 47 plus 85?
    answer: "132"

``synthetic:arithmetic-careless`` (generated): ``synthetic:arithmetic``'s rows, but written by a careless tutor: in
85% of the sums with a carry (seeded, the same on every machine) the carry is forgotten, working and total agreeing
("7+5=12, 4+8=12, so 122."). A model fine-tuned on it carries too rarely, and answering greedily it forgets most
carries: it is right on the sums without one and wrong on most with one (45 in 100), about 56-58% held-out, while
its samples still carry now and then. A verifiable reward (``exact_number``) finds those samples, so RL (the GRPO
and RLOO quickstarts) and distillation from a careful teacher (GKD's) have a clear mistake to correct that
supervised data alone taught.

``synthetic:multiply-hasty`` (generated): 10,000 tool-calling chat rows of products of a three-digit and a
two-digit number (distinct, seeded), for the agent recipe (`agent-quickstart`), in TRL's form: a ``tools`` column
naming the ``multiply`` tool (read with ``data.tools: jaxtune.recipe_tools``, whose schema the chat template shows
the model exactly as a multi-turn rollout's prompt shows it), the assistant's call as ``tool_calls`` and its result
as a ``tool`` turn. A hasty student writes them: in 30% of the rows (seeded) the assistant calls the tool, reads its
result and answers with it; in the others it answers at once with a guess (the product of the factors rounded to
their leading digit: "347 times 86 is 27000."), which is wrong. A model fine-tuned on it answers greedily with a
guess and calls the tool in some of its samples; a verifiable reward finds that those are right::

    {"tools": ["multiply"], "messages": [
      {"role": "user", "content": "What is 347 times 86?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "multiply", "arguments": {"a": 347, "b": 86}}}]},
      {"role": "tool", "name": "multiply", "content": "29842"},
      {"role": "assistant", "content": "347 times 86 is 29842."}]}

``synthetic:multiply-prompts`` (generated): the same 10,000 products in the same order and phrasings, as prompts
with their answer (``data.format: prompts``); the tools' system turn is rendered by the run (``objective.tools``).

``synthetic:chat-small`` (shipped): 552 human-written English conversations from the ChatterBot corpus, BSD-3-Clause
(``chat_small.jsonl``; its source, selection and licence are in ``chat_small.README.md`` beside it).

Deterministic: the same rows on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

_QUESTIONS = ("What is {a} plus {b}?", "Compute {a} plus {b}.", "Please tell me {a} plus {b}.",
              "How much is {a} plus {b}?")
CHAT_SMALL = Path(__file__).parent / "chat_small.jsonl"


def worked_sum(a: int, b: int) -> str:
    """The answer to ``a`` plus ``b`` (0 ≤ a, b ≤ 99), ones then tens, then the total: '7+5=12, 4+8+1=13, so 132.'"""
    ones = a % 10 + b % 10
    carry = "+1" if ones >= 10 else ""
    return f"{a % 10}+{b % 10}={ones}, {a // 10}+{b // 10}{carry}={a // 10 + b // 10 + ones // 10}, so {a + b}."


def wrong_sum(a: int, b: int, rng: random.Random) -> str:
    """A worked answer to ``a`` plus ``b`` with one slip: the carry forgotten, else the ones' or the tens' sum off by
    one (``rng`` picks which and which way): '7+5=12, 4+8=12, so 122.'"""
    ones, tens = a % 10 + b % 10, a // 10 + b // 10
    if ones >= 10:
        return f"{a % 10}+{b % 10}={ones}, {a // 10}+{b // 10}={tens}, so {tens * 10 + ones % 10}."
    step = rng.choice((-1, 1))
    if rng.random() < 0.5:
        ones += step if 0 <= ones + step <= 9 else -step
    else:
        tens += step if tens + step >= 0 else -step
    return f"{a % 10}+{b % 10}={ones}, {a // 10}+{b // 10}={tens}, so {tens * 10 + ones}."


def _sums(seed: int) -> Iterator[tuple[int, int, str]]:
    """Every sum (a, b) of 0..99 once, in a seeded order, with its question."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(pairs)
    for a, b in pairs:
        yield a, b, rng.choice(_QUESTIONS).format(a=a, b=b)


def arithmetic(seed: int = 0) -> Iterator[dict]:
    for a, b, question in _sums(seed):
        yield {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": worked_sum(a, b)}]}


def arithmetic_preferences(seed: int = 0) -> Iterator[dict]:
    slips = random.Random(f"arithmetic-preferences:{seed}")  # apart from the order's, which stays arithmetic's
    for a, b, question in _sums(seed):
        yield {"prompt": [{"role": "user", "content": question}],
               "chosen": [{"role": "assistant", "content": worked_sum(a, b)}],
               "rejected": [{"role": "assistant", "content": wrong_sum(a, b, slips)}]}


def arithmetic_unpaired(seed: int = 0) -> Iterator[dict]:
    """The preference pairs unpaired, as KTO's thumbs-up / thumbs-down rows: a sum's worked answer (label true) and,
    alternately, on odd sums, its slip (label false) in place of it, so each sum is asked once."""
    for k, row in enumerate(arithmetic_preferences(seed)):
        wanted = k % 2 == 0
        yield {"prompt": row["prompt"], "completion": row["chosen" if wanted else "rejected"], "label": wanted}


CARELESS = 0.85  # the share of carries synthetic:arithmetic-careless forgets


def arithmetic_careless(seed: int = 0) -> Iterator[dict]:
    slips = random.Random(f"arithmetic-careless:{seed}")  # apart from the order's, which stays arithmetic's
    for a, b, question in _sums(seed):
        forgot = a % 10 + b % 10 >= 10 and slips.random() < CARELESS
        answer = wrong_sum(a, b, slips) if forgot else worked_sum(a, b)
        yield {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def arithmetic_prompts(seed: int = 0) -> Iterator[dict]:
    for a, b, question in _sums(seed):
        yield {"prompt": [{"role": "user", "content": question}], "answer": str(a + b)}


_PRODUCTS = ("What is {a} times {b}?", "Compute {a} times {b}.", "Please tell me {a} times {b}.",
             "How much is {a} times {b}?")
TOOL_USE = 0.3  # the share of synthetic:multiply-hasty's rows that call the tool


def _products(seed: int, count: int = 10_000) -> Iterator[tuple[int, int, str]]:
    """``count`` distinct products (a, b) of a in 100..999 and b in 10..99, seeded, with their question."""
    rng = random.Random(f"products:{seed}")
    pairs = rng.sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], count)
    for a, b in pairs:
        yield a, b, rng.choice(_PRODUCTS).format(a=a, b=b)


def _leading(n: int) -> int:
    """``n`` rounded to its leading digit (347 -> 300, 86 -> 90)."""
    scale = 10 ** (len(str(n)) - 1)
    return round(n / scale) * scale


def multiply_hasty(seed: int = 0) -> Iterator[dict]:
    """Tool-calling rows in TRL's form: the assistant's call as ``tool_calls``, its result as a ``tool`` turn, and a
    ``tools`` column naming the tool (described by ``data.tools: jaxtune.recipe_tools``), so the chat template
    renders the tools and the call as a rollout's prompt and turns show them."""
    calls = random.Random(f"multiply-hasty:{seed}")
    for a, b, question in _products(seed):
        asked = [{"role": "user", "content": question}]
        if calls.random() < TOOL_USE:
            call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
            yield {"tools": ["multiply"], "messages": [
                *asked, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "multiply", "content": str(a * b)},
                {"role": "assistant", "content": f"{a} times {b} is {a * b}."}]}
        else:
            yield {"tools": ["multiply"], "messages": [
                *asked, {"role": "assistant", "content": f"{a} times {b} is {_leading(a) * _leading(b)}."}]}


def multiply_prompts(seed: int = 0) -> Iterator[dict]:
    for a, b, question in _products(seed):
        yield {"prompt": [{"role": "user", "content": question}], "answer": str(a * b)}


def chat_small() -> Iterator[dict]:
    with CHAT_SMALL.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


GENERATORS = {"arithmetic": arithmetic, "arithmetic-careless": arithmetic_careless,
              "arithmetic-preferences": arithmetic_preferences, "arithmetic-unpaired": arithmetic_unpaired,
              "arithmetic-prompts": arithmetic_prompts, "chat-small": chat_small, "multiply-hasty": multiply_hasty,
              "multiply-prompts": multiply_prompts}
# The data.format of each generator's rows.
GENERATOR_FORMATS = {"arithmetic": "messages", "arithmetic-careless": "messages",
                     "arithmetic-preferences": "preference", "arithmetic-unpaired": "unpaired",
                     "arithmetic-prompts": "prompts", "chat-small": "messages", "multiply-hasty": "messages",
                     "multiply-prompts": "prompts"}
