"""Multi-turn rollouts with tools (``objective.tools``): the model generates, its tool calls run in the worker
(`jaxtune.rollout.tools.ToolWorker`), their results are appended as ``tool`` messages rendered by the chat template,
and generation continues, until a turn without a tool call, ``objective.max_tool_calls`` rounds of calls, or the
trajectory's token budget (``objective.max_completion_length``, tool tokens included, as TRL's).

**What trains.** A rollout's completion is its whole trajectory after the prompt: the model's turns and the tool
results' tokens between them (`Trajectories.ids`). ``tool_mask`` is 1 on the model's own tokens and 0 on the tool
results' (and the template's tokens around them): the loss, the KL and every token count see the model's tokens only,
and the sampler's log-probs are those tokens' (0 elsewhere), so they line up with the trainer's there. This is TRL
1.16's ``tool_mask``, built the same way (tested).

**Prompts.** Each rollout's prompt is rendered with its tools' JSON schemas (the template puts them in the system
turn), after its environment's ``reset(**row)`` text is appended to the last user message. One environment instance
per rollout, made in the worker; a row's ``environment`` field picks one of a dict of environments.

**Generation.** The first turn samples the group together (each prompt prefilled once when the group's prompts are
equal), and keeps its KV cache on device (`jaxtune.models.sampling.Session`); each later turn continues the rows
that called tools from that cache: only the tool results' tokens are computed, then the next turn decoded, all
rows in one program (those not continuing left alone). Samplers without a session (torchax) and models with
sliding-window attention (whose windows count cache slots) prefill each continuing row's whole conversation again
instead, as one batch bucketed to a power of two of rows.
Every process sees every row (the generation is SPMD over the mesh); with several processes each runs the tools of
its own rows and the appended ids are shared before the next turn, so every process takes the same turns.

**Rewards** read the last assistant turn's text (its final answer); an environment's ``get_reward()`` is one more
reward column named after its class, weight 1 (TRL's), NaN ("does not apply") for rollouts of other environments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxtune.data import DataError, PromptRows, Tokenizer
from jaxtune.job.distributed import every_process
from jaxtune.models.sampling import Generation, Session
from jaxtune.rollout.tool_worker import SINGLE
from jaxtune.rollout.tools import ParsedTurn, ToolWorker, call_style, parse_tool_calls, tool_suffix_ids

# (prompts' ids, max new tokens, seed, group) -> the generation of every row (`jaxtune.models.sampling.Generator`)
Generate = Callable[[list[list[int]], int, int, int], Generation]
# (the rollouts to continue, their whole conversations so far with the tool results, the tool results' ids alone,
# seed) -> those rollouts' next turns, in that order
Extend = Callable[[list[int], list[list[int]], list[list[int]], int], Generation]


def on_cache(session: Session, budget: int) -> Extend:
    """Turns continued on the first turn's KV cache (`jaxtune.models.sampling.Session`): only the tool results'
    tokens are computed before each turn."""
    return lambda rows, conversations, appended, seed: session.extend(rows, appended, max_new_tokens=budget,
                                                                      seed=seed)


def prefilled_again(generate: Generate, budget: int, n: int) -> Extend:
    """Turns generated from each rollout's whole conversation prefilled again, as one batch of a power-of-two rows
    bucket (fillers repeat the first row): the way for samplers without a session (torchax, sliding windows)."""

    def extend(rows: list[int], conversations: list[list[int]], appended: list[list[int]], seed: int) -> Generation:
        width = rows_bucket(len(rows), n)
        more = generate(conversations + [conversations[0]] * (width - len(rows)), budget, seed, 1)
        return Generation(more.ids[:len(rows)], more.logps[:len(rows)])

    return extend


@dataclass
class Trajectories:
    """Every rollout of a batch, after its last turn."""

    prompt_ids: list[list[int]]  # per rollout: its prompt as rendered (tools, reset text)
    ids: list[list[int]]  # per rollout: the model's turns and the tool results' tokens between them
    logps: list[list[float]]  # per id: the sampler's log-prob on the model's tokens, 0 on the tools'
    tool_mask: list[list[int]]  # per id: 1 on the model's tokens, 0 on the tools'
    texts: list[str]  # per rollout: its last assistant turn's text (the stop id left out), what rewards read
    calls: int  # tool calls made (well-formed or not), over every process's rollouts
    failures: int  # of those, the ones that failed (raised, timed out, returned no string, crashed)
    malformed: int  # turns whose tool calls could not be read (ended as answers)
    environment_rewards: dict[str, tuple[np.ndarray, dict[int, str]]]  # label -> ((N,) scores, {index: why failed})


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of a rollout batch's ``turn`` ≥ 1 (its first turn samples with ``seed`` itself)."""
    return int.from_bytes(hashlib.sha256(f"jaxtune-turn:{seed}:{turn}".encode()).digest()[:4], "little") % (1 << 31)


def rows_bucket(n: int, most: int) -> int:
    """The rows a continuation turn generates for ``n`` rows: the next power of two, at most ``most``."""
    return min(most, 1 << max(0, n - 1).bit_length())


class Agent:
    """The run's tools: its worker, the template's tool-call style, and the multi-turn loop (`run`)."""

    def __init__(self, objective: Any, tokenizer: Tokenizer, stops: list[int], max_prompt_tokens: int):
        self.reply = tokenizer.response_template
        self.style = call_style(tokenizer.chat_template, self.reply)
        self.worker = ToolWorker(objective.tools, objective.timeout)
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.budget = objective.max_completion_length
        self.max_rounds = objective.max_tool_calls
        self.max_prompt_tokens = max_prompt_tokens
        envs = self.worker.description["environments"]
        self.named = self.worker.description["named"]
        self.schemas = {name: e["tools"] for name, e in envs.items()}
        owners = {name: e["reward"] for name, e in envs.items() if e["reward"]}
        self.reward_labels = sorted(set(owners.values()))
        self._owner = owners

    def close(self) -> None:
        self.worker.close()

    def prompts(self, source: PromptRows, rows: list[int], first_id: int) -> list[list[int]]:
        """Each rollout's prompt ids (rollout k of ``rows`` is rollout ``first_id + k`` in the worker): its
        environment made and reset with the row's fields, its text appended to the last user message, and the
        conversation rendered with the environment's tools."""
        out = []
        for k, r in enumerate(rows):
            messages, fields = source.prompt(r), source.fields(r)
            if not isinstance(messages, list):
                raise DataError(f"{source.where(r)}: objective.tools needs conversational prompts (a prompt of "
                                "messages): a chat template renders the tools and their results")
            environment = self._environment(fields, source.where(r))
            row = {k2: v for k2, v in fields.items() if not (self.named and k2 == "environment")}
            text = self.worker.reset(first_id + k, environment, {"prompt": messages, **row})
            if text:
                messages = messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + text}]
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                          tools=self.schemas[environment] or None)
            ids = self.tokenizer.encode_chat([rendered])[0]
            if len(ids) > self.max_prompt_tokens:
                raise DataError(f"{source.where(r)}: the prompt with its tools' schemas is {len(ids)} tokens, more "
                                f"than the {self.max_prompt_tokens} data.seq_len - objective.max_completion_length "
                                "leaves; raise data.seq_len or shorten the tools' docstrings")
            out.append(ids)
        return out

    def _environment(self, fields: dict[str, Any], where: str) -> str:
        if not self.named:
            return SINGLE
        name = fields.get("environment")
        if name not in self.schemas:
            raise DataError(f"{where}: environment {name!r} is not one of the tools module's environments "
                            f"({', '.join(sorted(self.schemas))}); set the row's 'environment' field to one")
        return name

    def run(self, extend: Extend, prompt_ids: list[list[int]], first: Generation, seed: int,
            mine: slice, first_id: int) -> Trajectories:
        """The trajectories of every rollout from their first turns ``first``, each later turn from ``extend``
        (`on_cache`, `prefilled_again`): this process runs the tools of the rollouts ``mine`` (worker ids from
        ``first_id``); every process takes the same turns."""
        n = len(prompt_ids)
        ids = [list(x) for x in first.ids]
        logps = [list(x) for x in first.logps]
        mask = [[1] * len(x) for x in ids]
        last = [list(x) for x in first.ids]  # each rollout's latest turn
        rounds, calls, failures, malformed = 0, 0, 0, 0
        active = list(range(n))
        while active and (self.max_rounds is None or rounds < self.max_rounds):
            suffixes, made, failed, unread = self._tools(last, active, mine, first_id)
            calls, failures, malformed = calls + made, failures + failed, malformed + unread
            active = [i for i in active if suffixes[i] is not None
                      and len(ids[i]) + len(suffixes[i]) < self.budget]  # room left for a turn (TRL drops overlong)
            if not active:
                break
            rounds += 1
            more = extend(active, [prompt_ids[i] + ids[i] + suffixes[i] for i in active],
                          [suffixes[i] for i in active], turn_seed(seed, rounds))
            for j, i in enumerate(active):
                room = self.budget - len(ids[i]) - len(suffixes[i])
                new, new_logps = more.ids[j][:room], more.logps[j][:room]
                ids[i] += suffixes[i] + new
                logps[i] += [0.0] * len(suffixes[i]) + new_logps
                mask[i] += [0] * len(suffixes[i]) + [1] * len(new)
                last[i] = new
        texts = [self._text(t) for t in last]
        rewards = self._rewards(n, mine, first_id)
        self.worker.drop()
        return Trajectories(prompt_ids, ids, logps, mask, texts, calls, failures, malformed, rewards)

    def _text(self, turn: list[int]) -> str:
        """A turn's text without its stop id and its tool calls (all of it, where a call cannot be read)."""
        parsed = self._parsed(turn)
        return self.tokenizer.decode(turn[:-1] if turn and turn[-1] in self.stops else turn) if parsed.malformed \
            else parsed.content

    def _parsed(self, turn: list[int]) -> ParsedTurn:
        """A turn read for tool calls: its text without its stop id, except for transformers' response templates,
        which read the end of the turn."""
        whole = self.style == "response_template" or not turn or turn[-1] not in self.stops
        return parse_tool_calls(self.tokenizer.decode(turn if whole else turn[:-1]), self.style, self.reply)

    def _tools(self, last: list[list[int]], active: list[int], mine: slice,
               first_id: int) -> tuple[list[list[int] | None], int, int, int]:
        """Runs the tool calls of this process's active rollouts' latest turns: per rollout (every process's), the
        ids its tool results append (None: its turn called no tool), and the calls made and failed, and the turns
        whose calls could not be read, over every process's rollouts. A turn with a call that cannot be read (bad
        JSON, no name) ends its rollout as an answer, scored, as TRL's loop ends it."""
        suffixes: list[list[int] | None] = [None] * len(last)
        made = failed = malformed = 0
        for i in active:
            if not mine.start <= i < mine.stop:
                continue
            turn = last[i]
            if not turn or turn[-1] not in self.stops:
                continue  # a turn cut by the budget: the rollout ends
            parsed = self._parsed(turn)
            if parsed.malformed:  # the model's mistake: the turn is its answer, and is scored (TRL's)
                malformed += 1
                continue
            if not parsed.calls:
                continue  # an answer: the rollout ends
            messages = []
            for call in parsed.calls:
                result, bad = self.worker.call(first_id + i - mine.start, call)
                messages.append({"role": "tool", "name": call.name, "content": result})
                failed += bad
            made += len(parsed.calls)
            suffixes[i] = tool_suffix_ids(self.tokenizer, messages, self.stops)
        if jax.process_count() > 1:
            suffixes = shared_ragged(suffixes, mine)
            made, failed, malformed = (int(x) for x in every_process(
                np.asarray([[made, failed, malformed]], np.int64)).sum(axis=0))
        return suffixes, made, failed, malformed

    def _rewards(self, n: int, mine: slice, first_id: int) -> dict[str, tuple[np.ndarray, dict[int, str]]]:
        """Each reward-owning environment class's ``get_reward()`` of this process's rollouts (NaN for the others':
        "does not apply"), shared, with the rollouts whose ``get_reward`` failed."""
        scores = {label: np.full(n, np.nan, np.float32) for label in self.reward_labels}
        problems: dict[str, dict[int, str]] = {label: {} for label in self.reward_labels}
        for i in range(mine.start, mine.stop):
            label = self._owner.get(self.worker.live_environment(first_id + i - mine.start))
            if label is None:
                continue
            got, why = self.worker.reward(first_id + i - mine.start)
            scores[label][i] = np.nan if got is None else got
            if why is not None:
                problems[label][i] = f"{label}.get_reward() {why}"
        if jax.process_count() > 1:
            scores = {k: np.fmax.reduce(every_process(v[None]), axis=0) for k, v in scores.items()}
        return {label: (scores[label], problems[label]) for label in self.reward_labels}


def shared_ragged(values: list[list[int] | None], mine: slice) -> list[list[int] | None]:
    """Every process's entries of ``values`` (each process filled its slice ``mine``; the slices tile the list)."""
    own = values[mine]
    longest = int(every_process(np.asarray([max((len(v) for v in own if v is not None), default=0)])).max())
    block = np.full((len(own), longest + 1), -1, np.int64)  # column 0: the length, -1 for None
    for k, v in enumerate(own):
        if v is not None:
            block[k, 0] = len(v)
            block[k, 1:1 + len(v)] = v
    every = every_process(block)
    return [None if row[0] < 0 else row[1:1 + row[0]].tolist() for row in every]
