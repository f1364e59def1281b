"""``jaxtune tools``: a tools module tried on scripted model turns, without a model or a fine-tune.

The turns the user writes stand in for the policy; everything else is what a run does (`jaxtune.rollout.agent.Agent`):
the module is served by the tools' worker process, each turn's calls are read in the chat template's own format,
run there with ``objective.tool_timeout``, and answered as ``tool`` messages the template renders, so a tool that
raises, hangs, kills its process, returns no string or is called with bad arguments answers exactly what a rollout's
model would read, and is counted as the run would count it (``tools/call_frequency`` and its neighbours).

The prompt is a row of the config's prompt data (``--row``), or one user message (``--prompt``) with ``--field``
values handed to an environment's ``reset``. The transcript shows each model turn, the tokens the tools appended
(masked out of the loss), the counts, the final answer that reward functions read, and each environment's
``get_reward()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jaxtune.config import ConfigError
from jaxtune.config.objectives import DEFAULT_TOOL_TIMEOUT
from jaxtune.data import DataError, Tokenizer, resolve_chat_template, stop_ids
from jaxtune.data.prompts import PromptRows, PromptStats, load_prompts
from jaxtune.models.sampling import Generation
from jaxtune.rollout.agent import Agent, Trajectories
from jaxtune.run import run_config


@dataclass(frozen=True)
class _Objective:
    """What `Agent` reads of an objective, for a config whose objective runs no rollouts (an SFT config's
    ``data.tools``)."""

    tools: str
    timeout: float
    max_completion_length: int
    max_tool_calls: int | None


@dataclass
class _OnePrompt:
    """A prompt given on the command line, as `Agent.prompts` reads a prompt source."""

    messages: list[dict[str, Any]]
    row: dict[str, Any]

    def prompt(self, i: int) -> list[dict[str, Any]]:
        return [dict(m) for m in self.messages]

    def fields(self, i: int) -> dict[str, Any]:
        return dict(self.row)

    def where(self, i: int) -> str:
        return "--prompt"


@dataclass
class Trial:
    """One scripted rollout: its trajectory and how to read it."""

    trajectory: Trajectories
    tokenizer: Tokenizer
    prompt_tokens: int
    turns_given: int
    turns_taken: int
    budget: int
    restarts: int  # times the tools' worker was killed and started again (a call that hung or crashed it)

    def lines(self) -> list[str]:
        t = self.trajectory
        ids, mask = t.ids[0], t.tool_mask[0]
        out = [f"prompt: {self.prompt_tokens} tokens, rendered with the tools' schemas"]
        start = 0
        for end in [*(k for k in range(1, len(ids)) if mask[k] != mask[k - 1]), len(ids)]:
            text = self.tokenizer.decode(ids[start:end])
            head = "model:" if mask[start] else f"tools ({end - start} tokens, masked out of the loss):"
            out.append(head + (text if text.startswith("\n") else " " + text))
            start = end
        model = sum(mask)
        out.append(f"rollout: {t.calls} tool call(s), {t.failures} failed, {t.malformed} turn(s) unreadable; {model} "
                   f"of its {len(ids)} completion tokens are the model's (budget {self.budget})")
        if self.turns_taken < self.turns_given:
            out.append(f"the rollout ended after turn {self.turns_taken}; the other "
                       f"{self.turns_given - self.turns_taken} scripted turn(s) were not used")
        elif self.turns_taken > self.turns_given:
            out.append(f"the scripted turns ran out: a run would go on with the model's turn {self.turns_given + 1}")
        if self.restarts:
            out.append(f"the tools' worker was stopped and started again {self.restarts} time(s), the rollout's "
                       "environment rebuilt by replaying its reset and calls")
        per = t.failures / t.calls if t.calls else 0.0
        out.append(f"a run logs: tools/call_frequency {t.calls:g}, tools/failure_frequency {per:g}, "
                   f"tools/malformed_frequency {t.malformed:g}")
        out.append(f"final answer (what reward functions read): {json.dumps(t.texts[0])}")
        for label, (scores, problems) in t.environment_rewards.items():
            out.append(f"reward {label}: " + (problems[0] if 0 in problems else f"{float(scores[0]):g}"))
        return out


def _prompt_source(cfg: Any, tokenizer: Tokenizer, prompt: str | None, fields: dict[str, Any], row: int,
                   max_prompt_tokens: int) -> Any:
    if prompt is not None:
        return _OnePrompt([{"role": "user", "content": prompt}], fields)
    if fields:
        raise ConfigError("--field goes with --prompt: a row of the config's data brings its own fields")
    if cfg.data.format != "prompts":
        raise ConfigError(f"data.format={cfg.data.format}: the config has no prompts to take a row from; pass "
                          "--prompt TEXT (a user message)")
    rows = load_prompts(cfg.data.sources, cfg.data, tokenizer, 1 << 30, PromptStats())
    if not 0 <= row < len(rows):
        raise ConfigError(f"--row {row}: the config's prompts have {len(rows)} rows (0 to {len(rows) - 1})")
    return PromptRows([rows[row]], max_prompt_tokens)


def try_tools(target: str, overrides: list[str], turns: list[str], *, prompt: str | None = None, row: int = 0,
              fields: dict[str, Any] | None = None, module: str | None = None,
              timeout: float | None = None) -> Trial:
    """The rollout of ``target``'s tools (``module``, else ``objective.tools``, else ``data.tools``) whose model
    turns are ``turns``: the first one the model's first turn, each next one the turn after the tools' results."""
    if not turns:
        raise ConfigError("give the model's turns: --turn TEXT, once per turn")
    cfg, tokenizer, _ = run_config(target, overrides)
    o = cfg.objective
    module = module or getattr(o, "tools", None) or cfg.data.tools
    if module is None:
        raise ConfigError(f"{target} names no tools module (objective.tools or data.tools); pass --tools MODULE")
    if cfg.data.chat_template is not None:
        resolve_chat_template(cfg.data, tokenizer)
    if tokenizer.chat_template is None:
        raise DataError("tools need a chat template and the tokenizer has none; set data.chat_template=chatml-tools "
                        "or the model's own template")
    # a rollout objective's trajectory budget; otherwise (an SFT config) what data.seq_len leaves after the prompt
    budget = getattr(o, "max_completion_length", None)
    limit = timeout if timeout is not None else getattr(o, "timeout", DEFAULT_TOOL_TIMEOUT)
    objective = _Objective(module, limit, budget or 1, getattr(o, "max_tool_calls", None))
    stops = stop_ids(tokenizer, True)
    agent = Agent(objective, tokenizer, stops, cfg.data.seq_len - (budget or 1))
    try:
        source = _prompt_source(cfg, tokenizer, prompt, fields or {}, row, cfg.data.seq_len - (budget or 1))
        prompt_ids = agent.prompts(source, [0], 0)
        budget = agent.budget = budget or cfg.data.seq_len - len(prompt_ids[0])
        scripted = [tokenizer.encode_chat([text])[0] + [stops[-1]] for text in turns]
        taken = [1]

        def extend(rows: list[int], conversations: list[list[int]], appended: list[list[int]],
                   seed: int) -> Generation:
            taken[0] += 1
            turn = scripted[taken[0] - 1] if taken[0] <= len(scripted) else []
            return Generation([turn], [[0.0] * len(turn)])

        trajectory = agent.run(extend, prompt_ids, Generation([scripted[0]], [[0.0] * len(scripted[0])]), 0,
                               slice(0, 1), 0)
        restarts = agent.worker.restarts
    finally:
        agent.close()
    return Trial(trajectory, tokenizer, len(prompt_ids[0]), len(turns), taken[0], budget, restarts)
