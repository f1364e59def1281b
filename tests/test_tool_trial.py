"""``jaxtune tools``: a tools module tried on scripted model turns, with no model and no fine-tune (docs/agents.md,
"Try your tools"). The turns go through the run's own multi-turn loop (`jaxtune.rollout.agent.Agent`) and worker, so
each failure reads as a rollout's model reads it, and the counts are a run's."""

from __future__ import annotations

import pytest
from helpers.tool_modules import COUNTER

from jaxtune.cli import main

TOOLS = '''
import os
import time


def multiply(a: int, b: int) -> str:
    """Multiplies two whole numbers.

    Args:
        a: a factor
        b: the other factor
    """
    return str(a * b)


def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: the key
    """
    raise KeyError(f"no entry for {key}")


def count(key: str) -> int:
    """Counts a key's entries.

    Args:
        key: the key
    """
    return 3


def wait(seconds: float) -> str:
    """Waits.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def crash(code: int) -> str:
    """Ends its process.

    Args:
        code: the exit code
    """
    os._exit(code)


tools = [multiply, lookup, count, wait, crash]
''' + COUNTER


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture()
def tools_dir(tmp_path, monkeypatch):
    (tmp_path / "trial_tools.py").write_text(TOOLS)
    (tmp_path / "trial_env.py").write_text(TOOLS.replace("tools = [multiply, lookup, count, wait, crash]",
                                                         "tools = []") + "\nenvironment = Counter\n")
    monkeypatch.chdir(tmp_path)  # the worker imports the module from the working directory, as a run's does
    return tmp_path


def trial(capsys, data_cache, *args: str) -> tuple[int, list[str], str]:
    rc = main(["tools", "agent-sft-quickstart", f"data.cache_dir={data_cache}", "data.seq_len=2048", *args])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


def test_every_kind_of_failure_answers_the_model_and_the_rollout_goes_on(tools_dir, data_cache, capsys):
    """A missing argument, a raising tool, an unknown tool, a non-string result, a hang past the timeout and a dead
    process each answer in TRL's form ``{'error': ...}`` and count as failed; the next turn's good call is answered
    with its result (the restarted worker serves it) and the final answer is what rewards read."""
    rc, lines, _ = trial(
        capsys, data_cache, "--tools", "trial_tools", "--timeout", "1", "--prompt", "What is 123 times 45?",
        "--turn", call("multiply", a=123) + call("lookup", key="x") + call("divide", a=1),
        "--turn", call("count", key="x") + call("wait", seconds=30) + call("crash", code=3),
        "--turn", call("multiply", a=123, b=45),
        "--turn", "The answer is 5535.")
    assert rc == 0, lines
    text = "\n".join(lines)
    for said in ("{'error': \"multiply() missing 1 required positional argument: 'b'\"}",
                 "{'error': \"'no entry for x'\"}",
                 "{'error': 'Tool divide not found.'}",
                 "{'error': 'tool count returned a int, not a string'}",
                 "{'error': 'tool wait did not answer within 1.0 s, or its process died, and was stopped'}",
                 "{'error': 'tool crash did not answer within 1.0 s, or its process died, and was stopped'}",
                 "<tool_response>\n5535\n</tool_response>"):
        assert text.count(said) == 1, (said, text)
    assert [line for line in lines if line.startswith("model: ")][-1] == "model: The answer is 5535.<|im_end|>"
    assert "rollout: 7 tool call(s), 6 failed, 0 turn(s) unreadable;" in text
    assert "the tools' worker was stopped and started again 2 time(s)" in text
    assert "a run logs: tools/call_frequency 7, tools/failure_frequency 0.857143, tools/malformed_frequency 0" in text
    assert lines[-1] == 'final answer (what reward functions read): "The answer is 5535."'


def test_an_unreadable_call_ends_the_rollout_as_its_answer(tools_dir, data_cache, capsys):
    rc, lines, _ = trial(capsys, data_cache, "--tools", "trial_tools", "--prompt", "What is 2 times 3?",
                         "--turn", '<tool_call>{"name": "multiply", "arguments": {"a": 2,</tool_call>',
                         "--turn", "6")
    assert rc == 0
    assert "rollout: 0 tool call(s), 0 failed, 1 turn(s) unreadable;" in "\n".join(lines)
    assert "the rollout ended after turn 1; the other 1 scripted turn(s) were not used" in lines
    assert lines[-1].startswith('final answer (what reward functions read): "<tool_call>{\\"name\\": \\"multiply')


def test_an_environment_is_reset_with_the_fields_and_scored_after_a_crash_replays_it(tools_dir, data_cache, capsys):
    """--field values reach reset(); the worker restarted by a crashing call rebuilds the environment by replaying
    its calls, so get_reward sees both bumps (5 + 2 + 3)."""
    (tools_dir / "trial_env.py").write_text((tools_dir / "trial_env.py").read_text().replace(
        "tools = []", "tools = [crash]"))
    rc, lines, _ = trial(capsys, data_cache, "--tools", "trial_env", "--timeout", "5", "--prompt", "Bump it.",
                         "--field", "start=5", "--turn", call("bump", by=2),
                         "--turn", call("crash", code=9) + call("bump", by=3), "--turn", "Done.")
    assert rc == 0, lines
    text = "\n".join(lines)
    assert "<tool_response>\n7\n</tool_response>" in text and "<tool_response>\n10\n</tool_response>" in text
    assert "(the counter starts at 5)" not in text  # the prompt is not printed, its token count is
    assert lines[-1] == "reward Counter: 10"


@pytest.mark.parametrize("args, said", [
    ((), "give the model's turns: --turn TEXT, once per turn"),
    (("--turn", "hi"), "data.format=messages: the config has no prompts to take a row from; pass --prompt TEXT"),
    (("--turn", "hi", "--field", "start=1"), "--field goes with --prompt"),
    (("--turn", "hi", "--prompt", "x", "--field", "start"), "--field 'start': expected NAME=VALUE"),
    (("--turn", "hi", "--prompt", "x", "--tools", "trial_tools.py"), "objective.tools='trial_tools.py'"),
])
def test_bad_use_is_one_line(tools_dir, data_cache, capsys, args, said):
    rc, _, err = trial(capsys, data_cache, *args)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and said in errors[0], err


def test_a_config_without_tools_is_refused(tools_dir, data_cache, capsys):
    rc = main(["tools", "finetune-quickstart", f"data.cache_dir={data_cache}", "--turn", "hi", "--prompt", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "names no tools module (objective.tools or data.tools); pass --tools MODULE" in err, err


def test_the_docs_example_prints_what_agents_md_shows(tmp_path, monkeypatch, data_cache, capsys):
    """docs/agents.md's "Try your tools first": its my_tools.py and its command print the lines it shows (the
    text block's "..." stands for lines left out)."""
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    module = re.search(r"```python\n# my_tools.py\n(.*?)```", doc, re.DOTALL).group(1)
    section = doc[doc.index("### Try your tools first"):]
    command = re.search(r"```bash\n(jaxtune tools .*?)```", section, re.DOTALL).group(1).replace("\\\n", " ")
    shown = re.search(r"```text\n(.*?)```", section, re.DOTALL).group(1).splitlines()
    (tmp_path / "my_tools.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command)[1:]
    assert main([*argv[:2], f"data.cache_dir={data_cache}", *argv[2:]]) == 0
    out = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    cut = shown.index("...")
    assert out[:cut] == shown[:cut] and out[len(out) - (len(shown) - cut - 1):] == shown[cut + 1:], "\n".join(out)
