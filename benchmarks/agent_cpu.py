"""CPU multi-turn rollout with a tool: jaxtune's (``objective.tools``) vs TRL 1.16's tool loop, same model, tool and
prompts.

The model is the agent recipe's fine-tuned one (``--model``: the export of ``agent-sft-quickstart``, a Llama that
calls the ``multiply`` tool in some of its samples and answers with the result), read by both sides from the same
directory with the same tokenizer and ``chatml-tools`` template. A round samples ``--prompts`` prompts of
``synthetic:multiply-prompts`` (the next ones each round, the same on both sides) ``--num-generations`` times at
temperature 1.0, with at most ``--max-tool-calls`` rounds of calls and ``--max-completion-length`` tokens per
trajectory (the tool's tokens count), and scores the final answers with the ``exact_number`` reward.

- jaxtune: the ``agent-quickstart`` config on the model, its rollout built as ``train()`` builds it
  (``load_rollout``: the tools' worker process, the native KV-cache sampler). Timed: ``rollout.batch`` (prompts
  rendered with the tool, the first turns, each later turn's calls run in the worker and the rows that called
  continued, decoding, rewards, advantages, the training rows).
- TRL: a real ``GRPOTrainer(tools=[multiply])`` (``bf16=False``, ``use_cpu=True``, transformers generate with a KV
  cache, no vLLM), the tokenizer's ``response_template`` Qwen 3's (the Hermes format ``chatml-tools`` writes). Timed:
  ``_generate_and_score_completions`` on the round's rows, each repeated ``num_generations`` times as its sampler
  yields them (tokenising, generation, the tool loop, decoding, rewards, advantages, padding).

The two sides sample different completions (different random generators), so each side's tool calls per rollout,
generated tokens and reward are printed beside its time. Usage (after the recipe's first two commands):

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/agent_cpu.py --model runs/agent-sft/model
        [--rounds 4 --prompts 8 --num-generations 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import tempfile
import time

import _harness as h
import datasets
import jax
import numpy as np
import torch
import transformers
import trl

from jaxtune import sharding
from jaxtune.companions import load_rollout
from jaxtune.config import load_config
from jaxtune.data.pipeline import make_training_data
from jaxtune.data.synthetic import multiply_prompts
from jaxtune.recipe_tools import multiply
from jaxtune.run import load_run


def last_number_is_answer(completions, answer, **_) -> list[float]:
    """TRL's side of ``exact_number``: 1 when the last number of the final assistant turn is the answer."""
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
        out.append(float(bool(numbers) and float(numbers[-1]) == float(a)))
    return out


def rounds_of(a: argparse.Namespace) -> int:
    """Rollout batches a side samples: the first, then ``steps`` per warm-up and timed round."""
    return 1 + (a.warmup + a.rounds) * a.steps


def jaxtune_impl(a: argparse.Namespace) -> dict:
    cfg = load_config("agent-quickstart", [f"model.from_hf={a.model}", f"objective.prompts_per_step={a.prompts}",
                                           f"objective.num_generations={a.num_generations}",
                                           f"objective.max_tool_calls={a.max_tool_calls}",
                                           f"objective.max_completion_length={a.max_completion_length}",
                                           f"data.seq_len={a.seq_len}", "data.val_fraction=0"])
    run = load_run(a.model)
    source = make_training_data(cfg.data, run.tokenizer, batch_size=a.prompts, seed=0, eval_batches=1,
                                max_prompt_tokens=cfg.max_prompt_tokens).prompts.train
    rollout = load_rollout(cfg, run.spec.mesh, run.spec.generator(), run.tokenizer)
    box = {"round": 0}

    def step() -> dict:
        r = box["round"]
        rows = np.arange(r * a.prompts, (r + 1) * a.prompts)
        with sharding.use_mesh(run.spec.mesh):
            _, m = rollout.batch(run.weights, source, {"row": rows}, r)
        box["round"] += 1
        return {"calls": m["tools/call_frequency"], "reward": m["reward"],
                "tokens": rollout.timings["generated_tokens"]}

    return {"step": step, "close": rollout.close, "compiles": lambda: rollout.generator.compiles}


def trl_impl(a: argparse.Namespace, out_dir: str) -> dict:
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    tokenizer.response_template = qwen3_template
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    n = a.prompts * a.num_generations
    rows = list(itertools.islice(multiply_prompts(), a.prompts * rounds_of(a)))
    data = datasets.Dataset.from_list(rows)
    args = GRPOConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                      per_device_train_batch_size=n, num_generations=a.num_generations,
                      max_completion_length=a.max_completion_length, max_tool_calling_iterations=a.max_tool_calls,
                      temperature=1.0, beta=0.0, loss_type="dapo", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=last_number_is_answer, args=args, train_dataset=data,
                          processing_class=tokenizer, tools=[multiply])
    trainer.model.train()
    box = {"round": 0}

    def step() -> dict:
        r = box["round"]
        inputs = [row for row in rows[r * a.prompts:(r + 1) * a.prompts] for _ in range(a.num_generations)]
        out = trainer._generate_and_score_completions(inputs)
        box["round"] += 1
        metrics = trainer._metrics["train"]
        return {"calls": metrics["tools/call_frequency"][-1], "reward": metrics["reward"][-1],
                "tokens": float(out["completion_mask"].sum())}

    return {"step": step, "close": lambda: None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_round_args(ap, rounds=4)
    h.add_common_args(ap)
    h.add_malloc_arg(ap)
    ap.add_argument("--model", required=True, help="the export of agent-sft-quickstart (runs/agent-sft/model) or of "
                    "smollm2-agent-sft (runs/smollm2-agent-sft/model)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-tool-calls", type=int, default=2)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=320, help="data.seq_len: the prompt, with the tool's schema, gets "
                    "what max-completion-length leaves (a real model's tokenizer spends more tokens on it)")
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    threads = h.start_trainers(args)
    tmp = tempfile.TemporaryDirectory()
    impls = {"jaxtune": jaxtune_impl(args), "TRL": trl_impl(args, os.path.join(tmp.name, "trl"))}
    for im in impls.values():
        im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
        t0 = time.perf_counter()
        im["first"] = im["step"]()  # jaxtune compiles its sampler's programs here
        im["first_s"] = time.perf_counter() - t0
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    for im in impls.values():
        im["close"]()
    tmp.cleanup()
    said = h.say_run(argv, jax=jax, torch=torch, transformers=transformers, trl=trl, numpy=np)
    rows = {}
    for name, im in impls.items():
        outs = [o for round_ in im["outputs"][args.warmup:] for o in round_]
        tokens = statistics.mean(o["tokens"] for o in outs)
        rows[name] = {"implementation": name, **h.timing_row(
            {"times": [t / args.steps for t in im["times"]], "cpu": [c / args.steps for c in im["cpu"]]}, tokens),
            "calls_per_rollout": statistics.mean(o["calls"] for o in outs),
            "reward": statistics.mean(o["reward"] for o in outs), "trajectory_tokens_per_round": tokens,
            "first_round_s": im["first_s"]}
    print(f"agent model {args.model}; {args.prompts} prompts x {args.num_generations} rollouts a round, at most "
          f"{args.max_tool_calls} rounds of calls and {args.max_completion_length} tokens a trajectory; threads "
          f"{threads}; {args.rounds} timed rounds ({run['seconds']:.0f} s; load {run['load_before'][0]:.2f} -> "
          f"{run['load_after'][0]:.2f}); jaxtune's sampler compiled {impls['jaxtune']['compiles']()} programs")
    print("| implementation | ms/round (median) | min | CPU ms/round | tool calls/rollout | trajectory tokens/round | "
          "reward | first round (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows.values():
        print(f"| {r['implementation']} | {r['ms_per_step']:,.0f} | {r['ms_per_step_min']:,.0f} | "
              f"{r['cpu_ms_per_step']:,.0f} | {r['calls_per_rollout']:.2f} | "
              f"{r['trajectory_tokens_per_round']:,.0f} | "
              f"{r['reward']:.3f} | {r['first_round_s']:.1f} |")
    ratio = rows["TRL"]["ms_per_step"] / rows["jaxtune"]["ms_per_step"]
    print(f"jaxtune's rollout: {ratio:.2f}x TRL's")
    return h.save_json(args.json, {"rows": rows, "ratio": ratio, **said[1]})


if __name__ == "__main__":
    main()
