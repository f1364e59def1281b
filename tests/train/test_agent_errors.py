"""A tools module's mistakes, met through `jaxtune train` as a user meets them: each is one ``error:`` line on
stderr, printed once (the tools' worker process writes to the same stderr, so the file descriptors are read), exit 2,
no traceback.

- Refused at start, before the first step: ``objective.tools`` given as a file's path (the words ``data.tools``
  says too), a module that does not import, an ``environment`` (or ``tools``) that is not what the worker can call.
- At the first rollout: an environment's ``get_reward()`` that returns something other than a number (the line
  says what it returned and what is expected) or raises (the line shows the exception's type and message).

A tiny random Llama, GRPO on the chatml-tools template, 2 prompts x 2 completions of 16 tokens.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from helpers.rows import write_jsonl
from helpers.tiny_config import QUICK
from helpers.tiny_runs import MODEL

from jaxtune.cli import main
from jaxtune.data.synthetic import multiply_prompts

RUN = ["data.format=prompts", "data.chat_template=chatml-tools", "data.seq_len=160", "data.val_fraction=0",
       "tokenizer.kind=bpe", "tokenizer.vocab_size=300", "tokenizer.special_tokens=[<|im_start|>,<|im_end|>]",
       "objective.name=grpo", "objective.num_generations=2", "objective.max_completion_length=16",
       "objective.prompts_per_step=2", "objective.rewards=[]", "train.batch_size=null", "train.steps=1",
       "eval.every=0", "checkpoint.every=1000", "model.max_seq_len=256", *QUICK]

ENVIRONMENT = '''
class Env:
    def reset(self, **row):
        return None

    def noop(self) -> str:
        """Does nothing."""
        return ""

    def get_reward(self) -> float:
        {body}


environment = Env
'''


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("agent-errors") / "prompts.jsonl",
                       itertools.islice(multiply_prompts(), 60))


@pytest.fixture
def train_with(tmp_path, monkeypatch, prompts, data_cache, capfd):
    """train_with(module source, objective.tools value) -> the one error line of the run (after checking that it
    is the only one, printed once, exit 2, no traceback); the module is written as tmp_path/user_tools.py and the
    run started from tmp_path, as a user runs it from the directory holding their module."""
    monkeypatch.chdir(tmp_path)

    def run(source: str | None, tools: str = "user_tools") -> str:
        if source is not None:
            (tmp_path / "user_tools.py").write_text(source)
        code = main(["train", "quickstart", *MODEL, *RUN, f"data.sources=[{prompts}]", f"data.cache_dir={data_cache}",
                     f"run_dir={tmp_path / 'run'}", f"objective.tools={tools}"])
        err = capfd.readouterr().err
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert len(errors) == 1 and errors[0].startswith("error: ") and err.count(errors[0]) == 1, err[-3000:]
        assert err.endswith(errors[0] + "\n")
        return errors[0]

    return run


@pytest.mark.parametrize("given, name", [("user_tools.py", "user_tools"), ("./user_tools.py", "user_tools"),
                                         ("pkg/user_tools.py", "pkg.user_tools")])
def test_a_tools_file_path_names_the_module_to_write(train_with, given, name):
    """Said as data.tools says it (tests/data/test_tool_rows.py), instead of Python's import errors."""
    assert train_with(None, given) == (f"error: objective.tools='{given}': name the module, not its file: "
                                       f"objective.tools={name} (it is imported from the current directory and the "
                                       "installed packages)")


def test_a_module_that_does_not_import_says_why_once(train_with, tmp_path):
    line = train_with("import no_such_package\n")
    assert line == ("error: objective.tools='user_tools': it does not import (ModuleNotFoundError: No module named "
                    f"'no_such_package'); it is imported from the current directory ({tmp_path}) and the installed "
                    "packages")


@pytest.mark.parametrize("source, says", [
    ("environment = 5\n", ("`environment` is int (5), not a class or function: set environment = MyEnvironment, a "
                           "class whose instances have reset(**row) (or a dict of such classes by name)")),
    ("environment = {'guess': 'Guess'}\n", "`environment['guess']` is str ('Guess'), not a class or function"),
    ("environment_factory = 5\n", "`environment_factory` is int (5), not a class or function"),
    ("tools = 3\n", "`tools` is int (3), not a list of functions: set tools = [my_function, ...]"),
], ids=["environment-int", "environment-dict-of-names", "trl-name", "tools-int"])
def test_an_environment_that_cannot_be_called_is_refused_at_start(train_with, source, says):
    """It read "TypeError: 'int' object is not callable"."""
    line = train_with(source)
    assert line.startswith(f"error: objective.tools='user_tools': {says}"), line
    assert "imported from" not in line  # it imported: where it is imported from is not the problem


@pytest.mark.parametrize("body, says", [
    ('return "seven"', ("Env.get_reward() returned a str ('seven'); it must return the rollout's score, a finite "
                        "number")),
    ("return None", "Env.get_reward() returned None; it must return the rollout's score, a finite number"),
    ('return float("nan")', "Env.get_reward() returned a non-finite number (nan); it must return"),
    ('raise ValueError("no score before the answer\\nsecond line")',
     ("Env.get_reward() raised ValueError: no score before the answer; fix get_reward(), or set "
      "objective.reward_errors: zero")),
], ids=["str", "none", "nan", "raises"])
def test_get_reward_says_what_it_returned_or_raised(train_with, prompts, body, says):
    """It read "failed, returned None or did not answer" whatever happened, and a raised message was lost."""
    line = train_with(ENVIRONMENT.format(body=body))
    assert line.startswith(f"error: reward 'Env' cannot score the completion of the row {prompts}:"), line
    assert says in line, line
