"""GRPO with tools end to end (`jaxtune.rollout.agent`): `agent-quickstart`'s chain, shortened.

On the session's ``agent_model`` (conftest: `agent-sft-quickstart` shortened to 60 steps, which writes well-formed
``multiply`` calls in some of its samples, not yet the right arguments):

- a GRPO run with ``objective.tools`` trains, in both row layouts: its rollouts call the tool (``tools/call_frequency``
  > 0, failures 0), the tool results' tokens are in the trajectories and out of the loss (the trained tokens are
  fewer than the trajectories' tokens), the sampler compiled no more programs than its buckets allow, and the tools'
  worker process is gone when the run ends;
- the synthetic SFT rows render exactly as the run renders its prompts and tool results (the skill the fine-tune
  teaches is the one the rollouts ask for).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
from helpers.run_outputs import metric_rows

from jaxtune.cli import main
from jaxtune.config import load_config
from jaxtune.data.synthetic import multiply_hasty
from jaxtune.data.templates import CHATML_TOOLS
from jaxtune.data.tokenizer import render_template
from jaxtune.loop import train
from jaxtune.tool_schema import tool_schema


def _workers() -> list[int]:
    """The pids of this process's children that serve tools."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().split()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[3]) == os.getpid() and b"jaxtune.rollout.tool_worker" in cmd:
                out.append(int(pid))
    return out


@pytest.mark.parametrize("share", ["true", "false"])
def test_grpo_with_tools_trains(tmp_path, agent_model, data_cache, share):
    run = tmp_path / "run"
    cfg = load_config("agent-quickstart", [
        f"run_dir={run}", f"model.from_hf={agent_model}", f"data.cache_dir={data_cache}",
        f"data.share_prompts={share}", "train.steps=2", "objective.prompts_per_step=2", "objective.num_generations=4",
        "eval.every=0", "eval.exact_match=0", "checkpoint.every=2", "logging.every=1", "logging.progress=false",
        "logging.tensorboard=false"])
    result = train(cfg)
    rows = metric_rows(run, "train")
    assert len(rows) == 2
    assert sum(r["tools/call_frequency"] for r in rows) > 0, rows  # the rollouts called the tool
    # the worker answered: most calls succeeded. A sampled call can still fail on its own (one wrote the argument
    # name '' and the tool raised TypeError): it is answered with the error and the rollout goes on, as TRL's loop
    assert all(r["tools/failure_frequency"] < r["tools/call_frequency"] / 2 for r in rows), rows
    # the trained tokens are the model's own (TRL's count): the tool results' tokens in the trajectories are not
    assert [r["count"] for r in rows] == [round(r["completions/mean_length"] * 8) for r in rows]
    # one program for the first turns (one prompt bucket), then one per (rows bucket 1, 2, 4, 8; prompt bucket
    # 256 or 512) for the continuations
    assert result.sampler_compiles <= 1 + 4 * 2, result.sampler_compiles
    assert _workers() == []  # the tools' worker stopped with the run


def test_fine_tune_rows_render_as_the_rollouts_do():
    """A synthetic:multiply-hasty row (TRL's tool-calling form), rendered by chatml-tools with the tools its
    ``tools`` column names, is the rollout's prompt (its question rendered with the tool's schema) followed by the
    model's call as the run parses it, the tool's result as the run renders a tool message, and the answer."""
    from jaxtune import recipe_tools

    schema = [tool_schema(t) for t in recipe_tools.tools]
    row = next(r for r in itertools.islice(multiply_hasty(), 50) if len(r["messages"]) == 4)
    assert row["tools"] == ["multiply"] and [t["function"]["name"] for t in schema] == ["multiply"]
    user, call, result, answer = row["messages"]
    sft = render_template(CHATML_TOOLS, row["messages"], tools=schema)
    prompt = render_template(CHATML_TOOLS, [user], add_generation_prompt=True, tools=schema)
    arguments = call["tool_calls"][0]["function"]["arguments"]
    written = "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": arguments}) + "\n</tool_call>"
    assert sft.startswith(prompt + written + "<|im_end|>\n"), sft
    tool_message = {"role": "tool", "name": "multiply", "content": result["content"]}
    as_run = render_template(CHATML_TOOLS, [user, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": arguments}}]}, tool_message, answer],
        tools=schema)
    assert as_run == sft


def test_a_tools_module_that_does_not_load_is_one_line(tmp_path, agent_model, data_cache, capsys):
    code = main(["train", "agent-quickstart", f"run_dir={tmp_path / 'run'}", f"model.from_hf={agent_model}",
                 f"data.cache_dir={data_cache}", "objective.tools=no_such_tools", "logging.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: objective.tools='no_such_tools': ") and "No module named" in err[-1], err[-1]
    assert _workers() == []
