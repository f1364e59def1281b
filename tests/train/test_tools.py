"""Multi-turn rollouts with tools (`jaxtune.rollout.tools`, `jaxtune.rollout.agent`).

- Tool schemas equal transformers' ``get_json_schema``; tool calls are read in the Hermes, Llama 3 and Mistral styles;
  a call that cannot be read is reported, not raised.
- The worker process: a tool that raises, returns a non-string, hangs past ``tool_timeout`` or kills its process is
  answered with an error message and counted; the environments of the other rollouts survive a worker restart
  (replayed); a module that cannot load is one line naming ``objective.tools``; docs/agents.md's example module
  runs on the row the doc shows.
- The trajectory against TRL 1.16: the same prompt (rendered with the tools by transformers), the same model turns
  (scripted token ids and log-probs, handed to both loops as the generator's output) and the same tool give the same
  completion ids, ``tool_mask`` and per-token log-probs as ``GRPOTrainer._tool_call_loop``, and the same counts of
  calls and failures.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import numpy as np
import pytest
from helpers.chat_templates import build_tokenizer
from helpers.tool_modules import COUNTER

from jaxtune.config import objective_config
from jaxtune.data.templates import CHATML_TOOLS
from jaxtune.models.sampling import Generation
from jaxtune.rollout.agent import Agent, prefilled_again, rows_bucket
from jaxtune.rollout.tools import ToolCall, ToolError, ToolWorker, call_style, parse_tool_calls
from jaxtune.tool_schema import SchemaError, tool_schema

TOOLS_MODULE = '''
import os, time

def add(a: int, b: int) -> str:
    """Adds two integers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)

def boom(x: int) -> str:
    """Raises.

    Args:
        x: anything
    """
    raise RuntimeError("out of cheese")

def number(x: int) -> int:
    """Returns a number, not text.

    Args:
        x: anything
    """
    return x

def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"

async def later(x: int) -> str:
    """An async tool.

    Args:
        x: anything
    """
    return f"later {x}"

def crash(code: int) -> str:
    """Kills its own process.

    Args:
        code: the exit status
    """
    os._exit(code)

tools = [add, boom, number, sleepy, crash, later]
''' + COUNTER + "\nenvironment = Counter\n"


@pytest.fixture
def module(tmp_path, monkeypatch) -> str:
    (tmp_path / "calc_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # this process imports it too, for TRL's side
    monkeypatch.delitem(sys.modules, "calc_tools", raising=False)
    return "calc_tools"


def test_schemas_equal_transformers():
    transformers = pytest.importorskip("transformers")

    def f(a: int, b: float = 1.0, c: list[str] | None = None, mode: Literal["x", "y"] = "x",
          d: dict[str, int] | None = None) -> str:
        """Does things.

        Over two paragraphs.

        Args:
            a: the first,
                on two lines
            b (float): the second
            c: some words
            mode: which way
            d: a map

        Returns:
            what it did
        """

    class Env:
        def step(self, move: str) -> str:
            """Moves.

            Args:
                move: where to
            """

    for fn in (f, Env().step):
        assert tool_schema(fn) == transformers.utils.get_json_schema(fn)

    def undocumented(x: int) -> str:
        """No Args section."""

    with pytest.raises(SchemaError, match="'x' is not described"):
        tool_schema(undocumented)


def test_tool_calls_are_read_in_each_style():
    hermes = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
                              '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}\n'
                              '</tool_call>', "hermes")
    assert hermes.content == "Let me add."
    assert hermes.calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert not hermes.malformed
    bad = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>', "hermes")
    assert bad.calls == [] and "not valid JSON" in bad.malformed[0] and bad.wants_tools
    assert not parse_tool_calls("The answer is 5.", "hermes").wants_tools
    llama = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}', "llama3")
    assert llama.calls == [ToolCall("add", {"a": 2, "b": 3})]
    assert parse_tool_calls("It is 5.", "llama3").content == "It is 5."
    mistral = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', "mistral")
    assert mistral.calls == [ToolCall("add", {"a": 2, "b": 3})]
    newer = parse_tool_calls('[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}', "mistral")
    assert newer.calls == [ToolCall("add", {"a": 2, "b": 3})]
    assert call_style(CHATML_TOOLS) == "hermes"
    with pytest.raises(ToolError, match="chatml-tools"):
        call_style("{{ messages }}")


def _with_response_template(directory, template):
    """The tokenizer of ``directory`` (`build_tokenizer`'s) with transformers' ``response_template`` in its config."""
    from jaxtune.config import DataConfig, TokenizerConfig
    from jaxtune.data import load_tokenizer

    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "response_template": template}))
    return load_tokenizer(TokenizerConfig(kind="hf", path=str(directory)), DataConfig())


def test_tool_calls_are_read_by_a_response_template(tmp_path):
    """A tokenizer whose config carries transformers' ``response_template`` has its replies read by transformers'
    parser (the end-of-turn token included, as its templates expect): the calls are those the template's own style
    reads (Qwen 3's Hermes, Llama 3's), a call it cannot read is malformed, not raised, and a reply without calls is
    its content. A data.chat_template that replaces the tokenizer's template drops its response template."""
    pytest.importorskip("trl")
    from trl.chat_template_utils import llama3_template, qwen3_template

    hermes = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    read = parse_tool_calls(hermes + "<|im_end|>", "response_template", qwen3_template)
    assert (read.content, read.calls, read.malformed) == ("Let me add.", parse_tool_calls(hermes, "hermes").calls, [])
    llama = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    assert parse_tool_calls(llama + "<|eot_id|>", "response_template", llama3_template).calls == \
        parse_tool_calls(llama, "llama3").calls == [ToolCall("add", {"a": 2, "b": 3})]
    bad = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 2,,}}\n</tool_call><|im_end|>',
                           "response_template", qwen3_template)
    assert bad.calls == [] and "could not be read" in bad.malformed[0] and bad.wants_tools
    plain = parse_tool_calls("The answer is 5.<|im_end|>", "response_template", qwen3_template)
    assert (plain.content, plain.wants_tools) == ("The answer is 5.", False)

    build_tokenizer(tmp_path / "tok", CHATML_TOOLS, SPECIALS, eos="<|im_end|>")
    tok = _with_response_template(tmp_path / "tok", qwen3_template)
    assert tok.response_template == qwen3_template
    assert call_style(tok.chat_template, tok.response_template) == "response_template"
    tok.chat_template = "{{ messages }}"  # data.chat_template replaced it
    assert tok.response_template is None


def test_worker_survives_failing_tools(module):
    worker = ToolWorker(module, timeout=2.0)
    try:
        names = [t["function"]["name"] for t in worker.description["environments"][""]["tools"]]
        assert names == ["add", "boom", "number", "sleepy", "crash", "later", "bump"]
        assert worker.description["environments"][""]["reward"] == "Counter"
        assert worker.reset(0, "", {"start": 10}) == " (the counter starts at 10)"
        assert worker.reset(1, "", {"start": 100}) is not None
        assert worker.call(0, ToolCall("bump", {"by": 5})) == ("15", False)
        assert worker.call(0, ToolCall("add", {"a": 2, "b": 3})) == ("5", False)
        assert worker.call(0, ToolCall("later", {"x": 4})) == ("later 4", False)  # async tools are awaited
        result, failed = worker.call(0, ToolCall("boom", {"x": 1}))
        assert failed and result == "{'error': 'out of cheese'}"  # as TRL's loop words it
        result, failed = worker.call(0, ToolCall("number", {"x": 1}))
        assert failed and "returned a int, not a string" in result
        result, failed = worker.call(0, ToolCall("nope", {}))
        assert failed and result == "{'error': 'Tool nope not found.'}"
        result, failed = worker.call(0, ToolCall("add", {"a": 1}))
        assert failed and "missing 1 required positional argument: 'b'" in result
        result, failed = worker.call(1, ToolCall("sleepy", {"seconds": 30}))  # killed at 2 s, restarted
        assert failed and "did not answer within 2.0 s" in result and worker.restarts == 1
        result, failed = worker.call(0, ToolCall("crash", {"code": 3}))  # the process dies: restarted
        assert failed and worker.restarts == 2
        # the environments were rebuilt by replaying their resets and calls: rollout 0's counter is still 15
        assert worker.call(0, ToolCall("bump", {"by": 1})) == ("16", False)
        assert worker.call(1, ToolCall("bump", {"by": 1})) == ("101", False)
        assert worker.reward(0) == (16.0, None) and worker.reward(1) == (101.0, None)
        worker.drop()
        assert worker.live_environment(0) is None
    finally:
        worker.close()


def test_unloadable_module_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ToolError, match=r"objective.tools='no_such_tools'.*No module named 'no_such_tools'"):
        ToolWorker("no_such_tools", timeout=2.0)
    (tmp_path / "empty_tools.py").write_text("x = 1\n")
    with pytest.raises(ToolError, match="names neither `tools`"):
        ToolWorker("empty_tools", timeout=2.0)


def test_the_agents_doc_example_runs_on_the_row_it_shows(tmp_path, monkeypatch):
    """docs/agents.md's my_tools.py, served by a worker from the directory holding it, on the example row the doc
    shows: reset appends the text the doc says, bump is the tool it names, get_reward scores 1.0 at 10, and the
    module's own tool is there too."""
    doc = (Path(__file__).parents[2] / "docs" / "agents.md").read_text()
    module = re.search(r"```python\n(# my_tools\.py\n.*?)```", doc, re.DOTALL).group(1)
    row = json.loads(re.search(r"```json\n(.*?)\n```", doc[doc.index("# my_tools.py"):], re.DOTALL).group(1))
    (tmp_path / "my_tools.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    worker = ToolWorker("my_tools", timeout=10.0)
    try:
        tools = {t["function"]["name"] for t in worker.description["environments"][""]["tools"]}
        assert tools == {"multiply", "bump"} and worker.description["environments"][""]["reward"] == "Counter"
        said = worker.reset(0, "", row)
        assert row["prompt"][-1]["content"] + said == "Bump the counter to 10. (the counter starts at 7)"
        assert worker.call(0, ToolCall("bump", {"by": 3})) == ("10", False)
        assert worker.call(0, ToolCall("multiply", {"a": 6, "b": 7})) == ("42", False)
        assert worker.reward(0) == (1.0, None)
    finally:
        worker.close()


def test_tool_keys_need_tools():
    with pytest.raises(ValueError, match="objective.max_tool_calls applies to multi-turn rollouts"):
        objective_config(name="grpo", rewards=[{"name": "length"}], max_tool_calls=2)
    with pytest.raises(ValueError, match="max_tool_calling_iterations is TRL's name"):
        objective_config(name="grpo", rewards=[{"name": "length"}], max_tool_calling_iterations=2)
    assert objective_config(name="grpo", tools="m", rewards=[]).timeout == 10.0  # a get_reward may own the reward


def test_rows_bucket():
    assert [rows_bucket(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert rows_bucket(5, 6) == 6


# ------------------------------------------------------------------------------------------- against TRL's loop


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
BAD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2,\n</tool_call>'
# Per rollout, the model's turns (each ends with <|im_end|>): rollout 0 calls add, then answers; rollout 1 answers at
# once; rollout 2 calls boom (fails), then writes a call that cannot be read (its answer, as TRL's loop takes it);
# rollout 3 calls add three times in a row and is stopped by the call limit (2 rounds).
BOOM_CALL = '<tool_call>\n{"name": "boom", "arguments": {"x": 1}}\n</tool_call>'
SCRIPTS = [[ADD_CALL, "The answer is 5."], ["It is 2."], [BOOM_CALL, BAD_CALL], [ADD_CALL, ADD_CALL, ADD_CALL]]
BUDGET = 200


class Script:
    """The model's turns as token ids with made-up log-probs, in the order each rollout asks for them."""

    def __init__(self, tokenizer, end: int):
        self.turns = [[tokenizer.encode_chat([t])[0] + [end] for t in script] for script in SCRIPTS]
        self.at = [1] * len(SCRIPTS)

    def logps(self, rollout: int, turn: int) -> list[float]:
        return [-0.01 * (rollout + 1) * (turn + 1) * (k + 1) for k in range(len(self.turns[rollout][turn]))]

    def first(self) -> Generation:
        return Generation([t[0] for t in self.turns], [self.logps(i, 0) for i in range(len(self.turns))])

    def next(self, rollout: int) -> tuple[list[int], list[float]]:
        k = self.at[rollout]
        self.at[rollout] += 1
        return self.turns[rollout][k], self.logps(rollout, k)


@pytest.mark.parametrize("reader", ["hermes", "response_template"])
def test_trajectories_match_trl(module, tmp_path, reader):
    """``reader``: jaxtune reads the calls in the template's style, or with transformers' parser where the
    tokenizer's config carries a ``response_template`` (the one TRL's tokenizer is given here)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response, qwen3_template

    ours = build_tokenizer(tmp_path / "tok", CHATML_TOOLS, SPECIALS, eos="<|im_end|>")
    if reader == "response_template":
        ours = _with_response_template(tmp_path / "tok", qwen3_template)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    theirs.response_template = qwen3_template  # the Hermes format of Qwen 3, which chatml-tools writes
    end = ours.eos_id
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    objective = objective_config(name="grpo", tools=module, rewards=[{"name": "length"}], max_tool_calls=2,
                                 max_completion_length=BUDGET, tool_timeout=5.0)
    agent = Agent(objective, ours, [end], 4000)
    assert agent.style == reader
    try:
        # the prompts: rendered with the tools (and the environment's reset text) as transformers renders them
        source = SimpleNamespace(prompt=lambda r: copy.deepcopy(prompt), fields=lambda r: {"start": 0},
                                 where=lambda r: f"p.jsonl:{r + 1}")
        prompt_ids = agent.prompts(source, [0] * len(SCRIPTS), 0)
        import calc_tools
        shown = [{"role": "user", "content": prompt[0]["content"] + " (the counter starts at 0)"}]
        schemas = [tool_schema(f) for f in (*calc_tools.tools, calc_tools.Counter.bump)]
        expected = theirs.apply_chat_template(shown, tools=schemas, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert all(p == list(expected) for p in prompt_ids)

        script = Script(ours, end)
        extend = prefilled_again(_scripted(script, prompt_ids), BUDGET, len(SCRIPTS))
        mine = agent.run(extend, prompt_ids, script.first(), 0, slice(0, len(SCRIPTS)), 0)
    finally:
        agent.close()

    trl = _trl_loop(GRPOTrainer, parse_response, theirs, prompt, prompt_ids, calc_tools, Script(ours, end))
    assert mine.ids == trl["completion_ids"]
    assert mine.tool_mask == trl["tool_mask"]
    flat = lambda rows: list(itertools.chain.from_iterable(rows))
    assert np.allclose(flat(mine.logps), flat(trl["logprobs"]), rtol=0, atol=1e-7)
    assert (mine.calls, mine.failures) == (trl["calls"], trl["failures"]) == (4, 1)
    assert mine.malformed == 1
    assert mine.texts == ["The answer is 5.", "It is 2.", BAD_CALL, ""]
    assert [sum(m) < len(m) for m in mine.tool_mask] == [True, False, True, True]
    assert mine.environment_rewards["Counter"][0].tolist() == [0.0] * len(SCRIPTS)


def _scripted(script: Script, prompt_ids: list[list[int]]):
    """A generator that answers each row with its rollout's next scripted turn (fillers: any rollout's, unused)."""

    def generate(batch, max_new, seed, group):
        ids, logps = [], []
        seen = set()
        for row in batch:
            match = [i for i in range(len(prompt_ids)) if i not in seen and script.at[i] < len(script.turns[i])
                     and _continues(row, prompt_ids[i], script, i)]
            if not match:  # a filler row
                ids.append([0])
                logps.append([0.0])
                continue
            seen.add(match[0])
            turn, lp = script.next(match[0])
            ids.append(turn)
            logps.append(lp)
        return Generation(ids, logps)

    return generate


def _continues(row: list[int], prompt: list[int], script: Script, i: int) -> bool:
    """Whether ``row`` is rollout ``i``'s conversation so far (its prompt, then its turns so far, in order)."""
    if row[:len(prompt)] != prompt:
        return False
    rest, at = row[len(prompt):], 0
    for turn in script.turns[i][:script.at[i]]:
        if rest[at:at + len(turn)] != turn:
            return False
        at += len(turn)
        while at < len(rest) and rest[at:at + len(turn)] != turn:  # the tool results between turns
            at += 1
    return True


def _trl_loop(GRPOTrainer, parse_response, tokenizer, prompt, prompt_ids, calc_tools, script: Script) -> dict:
    """TRL 1.16's ``GRPOTrainer._tool_call_loop`` on the same first turns, its generator the same script."""
    counter = [calc_tools.Counter() for _ in SCRIPTS]
    for c in counter:
        c.reset(start=0)
    tools = {f.__name__: f for f in calc_tools.tools}
    trainer = SimpleNamespace(
        _sync_tool_dicts=[{**tools, "bump": c.bump} for c in counter], _async_tool_dicts=[{} for _ in SCRIPTS],
        max_tool_calling_iterations=2, use_vllm=False, _is_vlm=False, max_completion_length=BUDGET,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)), environment_factories=None,
        tools=list(tools.values()), processing_class=tokenizer, _tokenizer=tokenizer, chat_template=None,
        chat_template_kwargs={})
    trainer._get_tool_suffix_ids = lambda messages: GRPOTrainer._get_tool_suffix_ids(trainer, messages)

    def generate(ids, images, fields, num_generations, has_tool_images=False):
        out, logps = [], []
        for row in ids:
            i = next(i for i in range(len(SCRIPTS)) if script.at[i] < len(script.turns[i])
                     and _continues(row, prompt_ids[i], script, i))
            turn, lp = script.next(i)
            out.append(turn)
            logps.append(lp)
        return out, logps

    trainer._generate_single_turn = generate
    first = script.first()
    completions = [[parse_response(tokenizer, ids, prefix=p)] for ids, p in zip(first.ids, prompt_ids)]
    prompts = [copy.deepcopy(prompt) for _ in SCRIPTS]
    mask, _, completion_ids, logprobs, calls, failures, _ = GRPOTrainer._tool_call_loop(
        trainer, prompts, [list(p) for p in prompt_ids], [list(c) for c in first.ids], completions,
        [list(x) for x in first.logps], None, None)
    return {"completion_ids": completion_ids, "tool_mask": mask, "logprobs": logprobs, "calls": calls,
            "failures": failures}


ENVIRONMENTS_MODULE = '''
class Guess:
    def reset(self, **row):
        self.secret = int(row["secret"])

    def guess(self, n: int) -> str:
        """Guesses the number.

        Args:
            n: the guess
        """
        self.last = n
        return "higher" if n < self.secret else "lower" if n > self.secret else "right"

    def get_reward(self) -> float:
        return float(getattr(self, "last", None) == self.secret)


class Plain:
    def reset(self, **row):
        return None

    def noop(self) -> str:
        """Does nothing."""
        return ""


environment = {"guess": Guess, "plain": Plain}
'''


def test_environments_by_row_and_their_rewards(tmp_path, monkeypatch):
    """A dict of environments: each row's ``environment`` field picks one (its tools only in its prompt), an unknown
    one names the row, and only the environment that owns a reward scores (NaN for the other's rollouts, which the
    reward sums leave out, as TRL's None)."""
    from jaxtune.rollout.rewards import make_rewards

    (tmp_path / "games.py").write_text(ENVIRONMENTS_MODULE)
    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer(tmp_path / "tok", CHATML_TOOLS, SPECIALS, eos="<|im_end|>")
    objective = objective_config(name="grpo", tools="games", rewards=[])
    agent = Agent(objective, tokenizer, [tokenizer.eos_id], 4000)
    try:
        assert agent.named and agent.reward_labels == ["Guess"]
        fields = [{"environment": "guess", "secret": 7}, {"environment": "plain"}, {"environment": "nope"}]
        source = SimpleNamespace(prompt=lambda r: [{"role": "user", "content": "Play."}],
                                 fields=lambda r: dict(fields[r]), where=lambda r: f"games.jsonl:{r + 1}")
        ids = agent.prompts(source, [0, 1], 0)
        texts = [tokenizer.decode(p) for p in ids]
        assert "- guess(n: integer)" in texts[0] and "noop" not in texts[0]
        assert "- noop()" in texts[1] and "guess" not in texts[1]
        with pytest.raises(Exception, match=r"games.jsonl:3: environment 'nope' is not one of .*guess, plain"):
            agent.prompts(source, [2], 5)
        call = '<tool_call>\n{"name": "guess", "arguments": {"n": 7}}\n</tool_call>'
        turns = [tokenizer.encode_chat([t])[0] + [tokenizer.eos_id] for t in (call, "Done.")]
        first = Generation(turns, [[0.0] * len(t) for t in turns])

        def generate(batch, max_new, seed, group):  # every continued row answers at once
            return Generation([tokenizer.encode_chat(["Got it."])[0] + [tokenizer.eos_id]] * len(batch),
                              [[-0.5] * 4] * len(batch))

        done = agent.run(prefilled_again(generate, 64, 2), ids, first, 0, slice(0, 2), 0)
    finally:
        agent.close()
    scores, problems = done.environment_rewards["Guess"]
    assert np.isnan(scores[1]) and scores[0] == 1.0 and not problems
    assert (done.calls, done.failures) == (1, 0) and done.texts == ["Got it.", "Done."]
    rewards = make_rewards(objective, None, agent.reward_labels)
    scored = rewards.score(["p", "p"], done.texts, [{}, {}], [1, 1], ["a", "b"], modelled={0: (scores, {})})
    assert scored.total.tolist() == [1.0, 0.0] and np.isnan(scored.per_function[1, 0])
    assert np.isnan(scored.scored_total[1])  # no function scored it: out of its group's baseline


def test_text_prompts_and_long_prompts_are_refused(tmp_path, module):
    tokenizer = build_tokenizer(tmp_path / "tok", CHATML_TOOLS, SPECIALS, eos="<|im_end|>")
    objective = objective_config(name="grpo", tools=module, rewards=[{"name": "length"}])
    agent = Agent(objective, tokenizer, [tokenizer.eos_id], 50)
    try:
        text = SimpleNamespace(prompt=lambda r: "What is 2 + 3?", fields=lambda r: {}, where=lambda r: "p.jsonl:4")
        with pytest.raises(Exception, match="p.jsonl:4: objective.tools needs conversational prompts"):
            agent.prompts(text, [0], 0)
        chat = SimpleNamespace(prompt=lambda r: [{"role": "user", "content": "What is 2 + 3?"}], fields=lambda r: {},
                               where=lambda r: "p.jsonl:9")
        with pytest.raises(Exception, match=r"p.jsonl:9: the prompt with its tools' schemas is \d+ tokens, more than "
                                            "the 50"):
            agent.prompts(chat, [0], 0)
    finally:
        agent.close()


def test_tools_without_any_reward_are_refused(tmp_path, monkeypatch):
    """A tools module whose environment owns no reward, and no objective.rewards: one line before any work, and the
    worker it started is stopped."""
    from jaxtune.config import load_config
    from jaxtune.rollout.rollout import make_rollout

    (tmp_path / "plain_tools.py").write_text(TOOLS_MODULE.replace("    def get_reward(self) -> float:\n"
                                                                  "        return float(self.n)\n", ""))
    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer(tmp_path / "tok", CHATML_TOOLS, SPECIALS, eos="<|im_end|>")
    cfg = load_config(None, ["objective.name=grpo", "data.format=prompts", "objective.tools=plain_tools",
                             "objective.rewards=[]"])
    with pytest.raises(ToolError, match="objective.tools='plain_tools': no reward"):
        make_rollout(cfg, None, tokenizer)
