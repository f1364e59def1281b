"""CPU GRPO (or RLOO, ``--objective rloo``) step throughput: jaxtune's rollout + train step vs TRL's trainer.

TRL's ``GRPOTrainer`` (``RLOOTrainer`` for RLOO; transformers generate), on the same model, prompts, group size and
reward.

One random ``LlamaForCausalLM`` (fp32, seeded, untied head) is written with ``save_pretrained`` into a temp dir with
its tokenizer, and both sides start from it. A step takes ``--prompts`` prompts of random token ids (``--min-prompt``
to ``--max-prompt`` tokens, ids 3..V-1), samples ``--num-generations`` completions of each (``--prompts`` x
``--num-generations`` completions per step) of ``--max-completion-length`` tokens at temperature 1.0 (no top-k, no
top-p), scores them with the same Python reward (`sevens`: the number of "7" characters in the decoded completion, so
rewards vary within a group and the advantages are not zero), and takes one GRPO update: the dapo loss (the mean over
every completion token of the batch), one pass (TRL's num_iterations 1), epsilon 0.2, group-scaled advantages,
``--beta`` (0: no reference model; > 0: the k3 KL to a frozen copy of the initial weights). AdamW on both sides: lr
``--lr``, betas (0.9, 0.999), eps 1e-8, weight decay 0, a constant lr, global-norm clipping at 1.0 (TRL's defaults,
except the schedule, constant here).

The tokenizer is a word-level one over the model's ids (``w3`` ... ``w{V-1}``, and ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 =
EOS), saved with the model, so a prompt's text re-tokenizes to exactly its ids on TRL's side and every sampled id
decodes. So that neither side stops early and both generate the same number of tokens, EOS is biased out in the
weights both load: every token embedding gets +8 on hidden dimension 0, which then dominates the residual stream and
stays positive through the layers, and ``lm_head``'s EOS row is -4 on that dimension and 0 elsewhere, so EOS's logit is
about -64 at every position (the other logits stay near 0: sampling is near-uniform over the rest). Checked every step:
the completions that ended before ``--max-completion-length`` are counted per side and printed.

- jaxtune: a config with ``model.from_hf=<dir>``, ``objective.name=grpo`` and ``data.format=prompts``, built as
  ``train()`` builds it (``loop.py``): the checkpoint's tokenizer (``load_tokenizer``), ``make_state_spec`` →
  ``step_reference`` → ``jit_steps`` → ``load_frozen`` + ``steps.frozen`` → ``init``, and
  ``make_rollout(cfg, spec.generator(), tokenizer)`` (the native KV-cache sampler, the reward imported as
  ``grpo_cpu:sevens``). The prompts are a `PromptRows` made from the token ids directly, and a step's prompt batch is
  its items stacked ({"prompt", "prompt_len", "row"}), as the data pipeline yields them. ``data.seq_len`` is
  ``--max-prompt`` + ``--max-completion-length``, so the train rows are (N, seq_len). Timed, as the loop runs a
  step: ``rollout.batch(steps.weights(params, frozen), prompts, batch, step)`` (sampling, decoding, rewards,
  advantages, row layout), ``steps.train(state, global_batch(mesh, batch), frozen)``, ``block_until_ready`` on the
  new state and the metrics, and reading the metrics to the host.
- TRL: a real ``GRPOTrainer`` over the saved model and tokenizer (``bf16=False``: TRL defaults to True even on CPU;
  ``gradient_checkpointing=False``: TRL defaults to True, jaxtune does not remat; ``use_cpu=True``, ``report_to=[]``;
  ``per_device_train_batch_size`` = the step's completions, as TRL counts them; ``num_generations``,
  ``max_completion_length``, ``steps_per_generation=1``, ``num_iterations=1``, ``beta``, ``loss_type="dapo"``,
  ``lr_scheduler_type="constant"``; no vLLM, so completions come from ``model.generate`` with a KV cache; its default
  optimizer ``adamw_torch_fused`` from ``create_optimizer_and_scheduler``; with beta > 0 TRL loads its own reference
  copy). A step's input is what its dataloader yields: the prompts' rows, each repeated ``num_generations`` times.
  Timed: what ``Trainer._run_epoch`` does per optimizer step without the callbacks and the logging:
  ``trainer.training_step(model, inputs, None)`` (its ``_prepare_inputs``: tokenising, generation, decoding, rewards,
  advantages, the reference forward when beta > 0, TRL's metrics; then ``compute_loss`` and backward),
  ``trainer._clip_grad_norm(model)``, ``optimizer.step()``, ``lr_scheduler.step()``, ``model.zero_grad()`` and
  ``loss.item()``.

Each step is split in three, measured inside it. Generation: jaxtune's ``Rollout`` times its sampler call
(``time/generation``: left-padding, one prefill, a decode step per new token, each token read back to the host to
check for stops); on TRL's side ``_generate_single_turn`` (left-padding, ``model.generate``, the EOS mask, the ids to
lists) is wrapped with a timer. Scoring: the rest of making the batch, jaxtune's ``rollout.batch`` and TRL's
``_prepare_inputs`` less generation (decoding, rewards, advantages, the row layout; TRL also runs the reference
forward here when beta > 0, jaxtune inside its train step). Training: the step less both (the policy forward and
backward, jaxtune's reference forward, clipping, the optimizer, reading the loss). Reward time is also reported on
its own: jaxtune's ``time/rewards`` (decoding the completions' texts and calling the reward), TRL's the reward call.

The two sides sample different completions (different random generators), so their losses are not compared: the GRPO
loss and gradients are checked against TRL's in ``tests/train/test_grpo_objective.py``. Printed as a sanity check: each
side's mean reward (the same distribution: a near-uniform sampler and the same reward) and losses.

Timing as in ``dpo_cpu.py``: after the first step (jaxtune: trace + compile of the prefill, the decode step and the
train step) and ``--warmup`` rounds, the implementations are interleaved round by round in one process (order rotated
every round), each round running ``--steps`` steps of each; the tables report medians per step, and beside the ratio
of medians the ratio of the fastest steps and of the median CPU time (user + system, all threads) per step. XLA's pool
uses the cores in the affinity mask and torch gets as many threads. On a loaded machine set ``OMP_WAIT_POLICY=PASSIVE``
or use ``--threads 1``. Usage:

    [OMP_WAIT_POLICY=PASSIVE] PYTHONPATH=src python benchmarks/grpo_cpu.py [--rounds 4 --steps 2] [--beta 0 0.04]
        [--prompts 4 --num-generations 8 --max-completion-length 64 --min-prompt 16 --max-prompt 32]
        [--layers 4 --d-model 256 --heads 4 --kv-heads 2 --d-ff 688 --vocab 2048] [--attn sdpa|eager]
        [--malloc-arena] [--threads N] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import _harness as h
import datasets
import flax
import jax
import jaxlib
import numpy as np
import optax
import torch
import transformers
import trl

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.data import PromptRows, load_tokenizer
from jaxtune.data.formats import Prompt
from jaxtune.data.prompts import EncodedPrompt
from jaxtune.models.sampling import Generator
from jaxtune.rollout.rollout import make_rollout
from jaxtune.train.objectives import make_objective
from jaxtune.train.reference import step_reference
from jaxtune.train.shapes import BatchShapes
from jaxtune.train.step import jit_steps

EOS_DIM, EOS_SHIFT, EOS_WEIGHT = 0, 8.0, -4.0  # see the module docstring: EOS's logit is about -64 everywhere


def sevens(prompts, completions, **_) -> list[float]:
    """The reward, on both sides: the number of "7" characters in each completion's text. TRL calls it with
    ``completion_ids`` and more keywords, jaxtune with ``rows``; neither is read."""
    return [float(c.count("7")) for c in completions]


# ---------------------------------------------------------------- model, tokenizer and prompts
def write_hf_model(directory: str, a: argparse.Namespace) -> int:
    """A seeded random fp32 LlamaForCausalLM of the benchmark shape with EOS biased out, and the word-level tokenizer,
    saved together; returns the model's parameter count."""
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, intermediate_size=a.d_ff,
                                   max_position_embeddings=max(a.max_prompt + a.max_completion_length, 512),
                                   attention_dropout=0.0, use_cache=True, tie_word_embeddings=False,
                                   pad_token_id=h.PAD, bos_token_id=h.BOS, eos_token_id=h.EOS)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, EOS_DIM] += EOS_SHIFT
        model.lm_head.weight[h.EOS] = 0.0
        model.lm_head.weight[h.EOS, EOS_DIM] = EOS_WEIGHT
    model.save_pretrained(directory, safe_serialization=True)
    h.word_tokenizer(a.vocab).save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def random_prompts(rng: np.random.RandomState, a: argparse.Namespace, n: int) -> list[list[int]]:
    """``n`` prompts of random ids 3..V-1, ``--min-prompt`` to ``--max-prompt`` tokens each."""
    return [rng.randint(3, a.vocab, rng.randint(a.min_prompt, a.max_prompt + 1)).tolist() for _ in range(n)]


def text_of(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# ---------------------------------------------------------------- jaxtune
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def jaxtune_impl(cfg, prompts: list[list[int]], per_step: int, merged: bool = True) -> tuple[dict, dict]:
    """jaxtune's GRPO step as ``train()`` builds and runs it; step ``k`` takes prompts ``k*per_step`` onwards.
    ``merged`` False (LoRA): sample the adapter graph itself instead of the adapters merged into the weights (what
    ``spec.generator()`` does), to measure which is faster."""
    t0 = time.perf_counter()
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
    spec = make_state_spec(cfg, None, mesh)
    reference = step_reference(spec, cfg.objective, cfg.train.loss_chunk)
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
    shapes = BatchShapes.of(cfg)  # each batch cut to its length bucket, as the loop does
    generator = spec.generator() if merged else Generator(spec.graphdef, spec.model_cfg.max_seq_len)
    rollout = make_rollout(cfg, generator, tokenizer)
    frozen = steps.frozen(spec.load_frozen(cfg.train.seed), cfg.train.seed)
    state = spec.init(cfg.train.seed)
    jax.block_until_ready((state, frozen))
    setup_s = time.perf_counter() - t0

    source = PromptRows([EncodedPrompt(f"bench:{i}", Prompt(text=text_of(p)), np.asarray(p, np.int32))
                         for i, p in enumerate(prompts)], cfg.max_prompt_tokens)
    items = [source[i] for i in range(len(source))]
    batches = [{k: np.stack([it[k] for it in items[s:s + per_step]]) for k in items[0]}
               for s in range(0, len(items), per_step)]
    box = {"state": state, "i": 0}

    def step() -> dict:
        i, programs = box["i"], (steps.compiles, rollout.generator.compiles)
        with sharding.use_mesh(mesh):
            t0 = time.perf_counter()
            batch, sampled = rollout.batch(steps.weights(box["state"].params, frozen), source, batches[i], i)
            batch, _ = shapes.fit(batch)
            prepared = time.perf_counter()
            box["state"], metrics = steps.train(box["state"], sharding.global_batch(mesh, batch), frozen)
            jax.block_until_ready((box["state"], metrics))
            m = jax.device_get(metrics)
            dt = time.perf_counter() - t0
        box["i"] += 1
        t = rollout.timings
        # completion tokens per completion (a stop id would be one of them); shared rows hold a group each
        lengths = ((batch["branch_slots"] > 0).sum(-1).reshape(-1) if "branch_slots" in batch
                   else batch["loss_mask"].sum(axis=1))
        return {"loss": float(m["loss"]), "reward": sampled["reward"], "kl": float(m["kl"]),
                "generation_s": t["generation"], "rewards_s": t["rewards"], "tokens": t["generated_tokens"],
                "stopped": int(np.sum(lengths < cfg.objective.max_completion_length)), "prepare_s": prepared - t0,
                "step_s": dt, "compiled": programs != (steps.compiles, rollout.generator.compiles)}

    def held_out(eval_prompts: list[list[int]]) -> dict:
        """The greedy held-out evaluation the training loop runs (`Rollout.held_out`: one completion per prompt,
        decoded and scored), on the current weights."""
        held = PromptRows([EncodedPrompt(f"held:{i}", Prompt(text=text_of(p)), np.asarray(p, np.int32))
                           for i, p in enumerate(eval_prompts)], cfg.max_prompt_tokens)
        with sharding.use_mesh(mesh):
            done, scores = rollout.held_out(steps.weights(box["state"].params, frozen), held, len(held), 0)
        return {"reward": scores["reward"], "tokens": sum(len(c) for c in done.ids)}

    impl = {"step": step, "compiles": lambda: steps.compiles, "sampler_compiles": lambda: rollout.generator.compiles,
            "held_out": held_out}
    return impl, {"setup_s": setup_s, "reference": "frozen copy" if reference is not None else "none",
                  "seq_len": cfg.data.seq_len}


# ---------------------------------------------------------------- TRL
def trl_impl(directory: str, a: argparse.Namespace, beta: float, out_dir: str, prompts: list[list[int]],
             per_step: int, eval_prompts: list[list[int]] | None = None) -> tuple[dict, dict]:
    """A GRPOTrainer over the saved model and tokenizer, its optimizer and scheduler created as ``train()`` would,
    generation and the reward timed from inside."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    n = per_step * a.num_generations
    Config, Trainer = (RLOOConfig, RLOOTrainer) if a.objective == "rloo" else (GRPOConfig, GRPOTrainer)
    loss = {} if a.objective == "rloo" else {"loss_type": "dapo"}
    args = Config(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                  per_device_train_batch_size=n, num_generations=a.num_generations,
                  max_completion_length=a.max_completion_length, steps_per_generation=1, num_iterations=1,
                  temperature=1.0, beta=beta, learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=1.0, save_strategy="no", disable_tqdm=True, logging_steps=10**6,
                  num_generations_eval=1, per_device_eval_batch_size=len(eval_prompts or [None]), **loss)
    clock = {"generation": 0.0, "rewards": 0.0, "tokens": 0, "stopped": 0, "prepare": 0.0}

    def reward(prompts, completions, **kwargs):
        t0 = time.perf_counter()
        out = sevens(prompts, completions, **kwargs)
        clock["rewards"] = time.perf_counter() - t0
        return out

    reward.__name__ = "sevens"
    data = datasets.Dataset.from_dict({"prompt": [text_of(p) for p in prompts[:per_step]]})
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=a.attn)
    peft_config = None
    if a.lora:  # PEFT's LoRA on the same projections as jaxtune's default targets; TRL's reference: adapters off
        from peft import LoraConfig
        peft_config = LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0, target_modules=LORA_MODULES)
    held = None if not eval_prompts else datasets.Dataset.from_dict({"prompt": [text_of(p) for p in eval_prompts]})
    trainer = Trainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tokenizer,
                      peft_config=peft_config, eval_dataset=held)
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer._run_epoch before each step
    if not a.lora and (trainer.ref_model is not None) != (beta > 0):
        raise RuntimeError(f"TRL's reference model with beta={beta}: {trainer.ref_model is not None}")

    generate = trainer._generate_single_turn

    def timed_generate(*args, **kwargs):
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)  # GRPOTrainer's: (ids, logprobs); RLOOTrainer's: the ids
        clock["generation"] = time.perf_counter() - t0
        completion_ids = out[0] if isinstance(out, tuple) else out
        clock["tokens"] = sum(len(c) for c in completion_ids)
        clock["stopped"] = sum(len(c) < a.max_completion_length for c in completion_ids)
        return out

    prepare = trainer._prepare_inputs

    def timed_prepare(*args, **kwargs):
        t0 = time.perf_counter()
        out = prepare(*args, **kwargs)
        clock["prepare"] = time.perf_counter() - t0
        return out

    trainer._generate_single_turn = timed_generate
    trainer._prepare_inputs = timed_prepare  # Trainer.training_step calls it first (GRPO: generation and scoring)
    # What TRL's dataloader yields per step (RepeatSampler, identity collator): each prompt's row num_generations times.
    inputs = [[{"prompt": text_of(p)} for p in prompts[s:s + per_step] for _ in range(a.num_generations)]
              for s in range(0, len(prompts), per_step)]
    first = trainer.processing_class(text=[x["prompt"] for x in inputs[0]])["input_ids"]
    if first[::a.num_generations] != prompts[:per_step]:
        raise RuntimeError("TRL's tokenizer does not give back the prompts' ids")
    box = {"i": 0}

    def step() -> dict:
        model = trainer.model
        t0 = time.perf_counter()
        loss = trainer.training_step(model, inputs[box["i"]], None)  # generation, scoring, loss, backward
        trainer._clip_grad_norm(model)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()
        trainer.state.global_step += 1
        value = loss.item()
        dt = time.perf_counter() - t0
        box["i"] += 1
        m = trainer._metrics["train"]
        return {"loss": value, "reward": m["reward"][-1], "kl": m["kl"][-1] if m.get("kl") else 0.0,
                "generation_s": clock["generation"], "rewards_s": clock["rewards"], "tokens": clock["tokens"],
                "stopped": clock["stopped"], "prepare_s": clock["prepare"], "step_s": dt}

    def held_out(_: list[list[int]]) -> dict:
        """``trainer.evaluate()``: one sampled completion per held-out prompt (TRL has no greedy evaluation),
        scored, and the loss forward."""
        out = trainer.evaluate()
        return {"reward": out.get("eval_reward", float("nan")), "tokens": clock["tokens"]}

    return {"step": step, "held_out": held_out}, \
        {"reference": "frozen copy (TRL's)" if trainer.ref_model is not None else "none"}


def held_out_times(impls: dict[str, dict], setups: dict[str, dict], eval_prompts: list[list[int]]) -> dict:
    """Each setup's held-out evaluation on both sides, after the training steps: the first call (jaxtune compiles
    the sampler for the batch of held-out prompts) and the median of 3 more, alternating sides."""
    names = [n for s in setups.values() for n in (s["jaxtune"], s["TRL"])]
    out = {}
    for name in names:
        t0 = time.perf_counter()
        first = impls[name]["held_out"](eval_prompts)
        out[name] = {"first_s": time.perf_counter() - t0, "times": [], **first}
    for _ in range(3):
        for name in names:
            t0 = time.perf_counter()
            impls[name]["held_out"](eval_prompts)
            out[name]["times"].append(time.perf_counter() - t0)
    for e in out.values():
        e["median_s"] = statistics.median(e["times"])
    return out


# ---------------------------------------------------------------- main
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_round_args(ap, rounds=4)
    h.add_common_args(ap, prompts=4, num_generations=8, max_completion_length=64, min_prompt=16, max_prompt=32,
                      layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=2048)
    ap.add_argument("--objective", choices=["grpo", "rloo"], default="grpo",
                    help="grpo (dapo loss) against TRL's GRPOTrainer, or rloo against its RLOOTrainer")
    ap.add_argument("--beta", type=float, nargs="+", default=[0.0],
                    help="KL weights, one setup each (0: no reference model)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="LoRA of this rank (alpha 2 x rank) on q k v o gate up down, both sides (PEFT on TRL's); "
                    "adds a jaxtune row that samples with the adapters unmerged")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="transformers' attention (sdpa: its default)")
    ap.add_argument("--share-prompts", action="store_true",
                    help="add a jaxtune row per setup with data.share_prompts=true: each prompt's group one row in "
                    "regions (the prompt once, each completion attending to it and itself)")
    ap.add_argument("--eval", type=int, default=0, metavar="N",
                    help="also time the held-out evaluation of N prompts after the steps: jaxtune's greedy one (what "
                    "the training loop runs at eval.every) against TRL's trainer.evaluate() (sampled, one completion "
                    "each, its loss forward included), each in one batch of N")
    h.add_malloc_arg(ap)
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    if not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("need 1 <= --min-prompt <= --max-prompt")
    threads = h.start_trainers(args)

    n_steps = 1 + (args.warmup + args.rounds) * args.steps  # per implementation, the first step included
    prompts = random_prompts(np.random.RandomState(0), args, n_steps * args.prompts)
    completions = args.prompts * args.num_generations
    seq_len = args.max_prompt + args.max_completion_length
    eval_prompts = random_prompts(np.random.RandomState(1), args, args.eval) if args.eval else None

    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "model")
    n_params = write_hf_model(model_dir, args)
    base = [f"model.from_hf={model_dir}", f"objective.name={args.objective}",
            *(["objective.loss_type=dapo"] if args.objective == "grpo" else []),
            f"objective.num_generations={args.num_generations}",
            f"objective.max_completion_length={args.max_completion_length}", "objective.temperature=1.0",
            "objective.rewards=[{name: 'grpo_cpu:sevens'}]", "data.format=prompts", "data.sources=[prompts.jsonl]",
            f"data.seq_len={seq_len}", f"objective.prompts_per_step={args.prompts}", f"train.steps={n_steps}",
            f"optim.lr={args.lr}", "optim.b1=0.9", "optim.b2=0.999", "optim.eps=1e-8", "optim.weight_decay=0.0",
            "optim.grad_clip=1.0", "optim.schedule=constant", "optim.warmup_steps=0"]
    if args.lora:
        base += [f"model.lora.rank={args.lora}", f"model.lora.alpha={2 * args.lora}"]

    impls: dict[str, dict] = {}
    setups: dict[str, dict] = {}  # setup -> {"jaxtune": impl name, "TRL": impl name, "reference": ...}
    setup_s: dict[str, float] = {}
    torch.manual_seed(0)  # TRL's sampling
    for beta in args.beta:
        setup = f"{args.objective}, beta {beta:g}" + (f", LoRA r{args.lora}" if args.lora else "")
        cfg = load_config(None, base + [f"objective.beta={beta}", "data.share_prompts=false"])
        jname, tname = f"jaxtune {setup} (jax.jit)", f"TRL {setup} (eager)"
        impls[jname], js = jaxtune_impl(cfg, prompts, args.prompts)
        setup_s[jname] = js["setup_s"]
        impls[tname], ts = trl_impl(model_dir, args, beta, os.path.join(tmp.name, f"trl-{len(impls)}"), prompts,
                                    args.prompts, eval_prompts)
        setups[setup] = {"jaxtune": jname, "TRL": tname, "reference": js["reference"], "trl_reference": ts["reference"]}
        if args.share_prompts:  # the same run with each group in one row, the prompt once
            sname = f"jaxtune {setup}, groups in regions (jax.jit)"
            impls[sname], _ = jaxtune_impl(load_config(None, base + [f"objective.beta={beta}",
                                                                     "data.share_prompts=true"]), prompts, args.prompts)
        if args.lora:  # the same run sampling through the adapters (no merge): which is faster, measured
            uname = f"jaxtune {setup}, adapters unmerged in sampling (jax.jit)"
            impls[uname], _ = jaxtune_impl(cfg, prompts, args.prompts, merged=False)

    for im in impls.values():
        im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
        im["first"], im["first_step_s"] = h.first_call(im["step"])  # jaxtune: trace + compile
    compiles_after_first = {name: (im["compiles"](), im["sampler_compiles"]()) for name, im in impls.items()
                            if "compiles" in im}
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    load0, load1 = run["load_before"], run["load_after"]
    compiled = {name: (im["compiles"](), im["sampler_compiles"]()) for name, im in impls.items() if "compiles" in im}
    evals = held_out_times(impls, setups, eval_prompts) if eval_prompts else {}  # compiles a sampler program more
    tmp.cleanup()

    # ---- report (times are per round of --steps steps: per step below)
    rows = {}
    for name, im in impls.items():
        # a timed round in which jaxtune met a new length bucket (a new prompt length) compiled a program: left
        # out of the medians (counted in the report), unless every round did
        rounds = [out for r, out in enumerate(im["outputs"]) if r >= args.warmup]
        warm = ([k for k, out in enumerate(rounds) if not any(x.get("compiled") for x in out)]
                or list(range(len(rounds))))
        im["compiling_rounds"] = len(rounds) - len(warm)
        im["times"] = [im["times"][k] / args.steps for k in warm]
        im["cpu"] = [im["cpu"][k] / args.steps for k in warm]
        seq = [im["first"]] + [x for out in im["outputs"] for x in out]
        timed = [x for k in warm for x in rounds[k]]
        gen = statistics.median(x["generation_s"] for x in timed)
        tokens = statistics.median(x["tokens"] for x in timed)
        timing = h.timing_row(im, completions * args.max_completion_length)
        row = {"implementation": name, **timing, "steps_per_s": 1e3 / timing["ms_per_step"],
               "first_step_s": im["first_step_s"], "generation_ms": gen * 1e3,
               "generated_tokens_per_step": tokens,
               "generation_tokens_per_s": statistics.median(x["tokens"] / x["generation_s"] for x in timed),
               "scoring_ms": statistics.median((x["prepare_s"] - x["generation_s"]) for x in timed) * 1e3,
               "training_ms": statistics.median((x["step_s"] - x["prepare_s"]) for x in timed) * 1e3,
               "rewards_ms": statistics.median(x["rewards_s"] for x in timed) * 1e3,
               "stopped_early": sum(x["stopped"] for x in seq), "completions_run": completions * len(seq),
               "mean_reward": float(np.mean([x["reward"] for x in seq])),
               "losses": [x["loss"] for x in seq], "kl": [x["kl"] for x in seq], "steps_run": len(seq)}
        if "compiles" in im:
            row["jax_compiles"] = {"train_step": compiled[name][0], "sampler": compiled[name][1],
                                   "after_first_step": compiles_after_first[name],
                                   "timed_rounds_left_out": im["compiling_rounds"]}
        rows[name] = row

    omp_wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    command = (("" if omp_wait == "unset" else f"OMP_WAIT_POLICY={omp_wait} ") + "PYTHONPATH=src "
               + " ".join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])]))
    record = h.run_record(jax=jax, jaxlib=jaxlib, torch=torch, transformers=transformers, trl=trl, flax=flax,
                          optax=optax, numpy=np)
    machine = h.machine()
    print(f"machine: {machine}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()))
    print(f"command: {command}")
    print(f"Llama (random, fp32, untied head, EOS biased out): {args.layers} layers, hidden {args.d_model}, "
          f"{args.heads} heads ({args.kv_heads} kv), intermediate {args.d_ff}, vocab {args.vocab}, "
          f"{n_params / 1e6:.2f}M params; transformers attention {args.attn}")
    print(f"{args.objective.upper()}: {args.prompts} prompts of {args.min_prompt}-{args.max_prompt} tokens x "
          f"{args.num_generations} "
          f"generations = {completions} completions of {args.max_completion_length} tokens per step, temperature 1.0; "
          f"{'dapo, ' if args.objective == 'grpo' else 'per-sequence ratio, '}epsilon 0.2, one pass; "
          f"jaxtune rows (N, {seq_len}); AdamW lr {args.lr:g} betas (0.9, 0.999) eps 1e-8 "
          f"wd 0, constant lr, clip 1.0; reward: count of '7' in the text")
    print(f"threads: XLA {threads} / torch {torch.get_num_threads()} (OMP_WAIT_POLICY {omp_wait}); malloc tuning "
          f"{'on' if args.malloc_arena else 'off'}; first step + {args.warmup} warm-up round(s) + {args.rounds} timed "
          f"rounds of {args.steps} step(s) per implementation, interleaved ({run['seconds']:.0f} s); load average "
          f"{load0[0]:.2f} -> {load1[0]:.2f} (1 min), {load0[1]:.2f} -> {load1[1]:.2f} (5 min)")
    print("jaxtune setup (tokenizer, spec, weights from the checkpoint, reference, state): "
          + ", ".join(f"{n} {s:.1f} s" for n, s in setup_s.items()))
    for r in rows.values():
        print(f"  {r['implementation']}: mean reward {r['mean_reward']:.3f}; completions that stopped before "
              f"{args.max_completion_length} tokens {r['stopped_early']}/{r['completions_run']}; loss step 1 "
              f"{r['losses'][0]:.3g}, last {r['losses'][-1]:.3g}; kl last {r['kl'][-1]:.3g}"
              + (f"; jax compiles (train step, sampler) {r['jax_compiles']['train_step']}, "
                 f"{r['jax_compiles']['sampler']}" if "jax_compiles" in r else ""))

    head = ["setup", "reference", "jaxtune ms/step", "TRL ms/step", "ratio (jaxtune / TRL steps/s)", "(best step)",
            "(CPU time)", "jaxtune steps/s", "TRL steps/s"]
    h.print_header(head, 2)
    summary = []
    for setup, names in setups.items():
        j, t = rows[names["jaxtune"]], rows[names["TRL"]]
        ratio = t["ms_per_step"] / j["ms_per_step"]
        best, cpu = t["ms_per_step_min"] / j["ms_per_step_min"], t["cpu_ms_per_step"] / j["cpu_ms_per_step"]
        summary.append({"setup": setup, "jaxtune_ms": j["ms_per_step"], "trl_ms": t["ms_per_step"], "ratio": ratio,
                        "ratio_best_step": best, "ratio_cpu_time": cpu})
        print(f"| {setup} | {names['reference']} | {j['ms_per_step']:.0f} | {t['ms_per_step']:.0f} | "
              f"**{ratio:.2f}x** | {best:.2f}x | {cpu:.2f}x | {j['steps_per_s']:.2f} | {t['steps_per_s']:.2f} |")

    head = ["implementation", "steps/s", "ms/step (median / min)", "CPU ms/step", "generation ms",
            "generated tokens/step", "generation tokens/s", "scoring ms", "training ms", "rewards ms",
            "first step (s)"]
    h.print_header(head)
    for r in rows.values():
        print(f"| {r['implementation']} | {r['steps_per_s']:.2f} | {r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f} "
              f"| {r['cpu_ms_per_step']:.0f} | {r['generation_ms']:.0f} | {r['generated_tokens_per_step']:,.0f} | "
              f"{r['generation_tokens_per_s']:,.0f} | {r['scoring_ms']:.0f} | {r['training_ms']:.0f} | "
              f"{r['rewards_ms']:.2f} | "
              f"{r['first_step_s']:.1f} |")
    h.say_noisy(rows.values(), load1[0])
    recompiled = [name for name, r in rows.items()
                  if "jax_compiles" in r and (r["jax_compiles"]["train_step"], r["jax_compiles"]["sampler"])
                  != r["jax_compiles"]["after_first_step"]]
    if recompiled:
        left = {name: rows[name]["jax_compiles"]["timed_rounds_left_out"] for name in recompiled}
        print(f"warning: jax compiled again after the first step for {recompiled} (a new length bucket); timed rounds "
              f"that compiled, left out of the medians: {left}")
    early = [r["implementation"] for r in rows.values() if r["stopped_early"]]
    if early:
        print(f"warning: some completions stopped early (EOS sampled) for {early}: the sides' token counts differ")

    if evals:
        h.print_header(["held-out evaluation", "first call (s)", "median of 3 (s)", "generated tokens",
                        "tokens/s", "mean reward"])
        for name, e in evals.items():
            print(f"| {name} | {e['first_s']:.1f} | {e['median_s']:.2f} | {e['tokens']:,} | "
                  f"{e['tokens'] / e['median_s']:,.0f} | {e['reward']:.3f} |")
        for setup, names in setups.items():
            j, t = evals[names["jaxtune"]], evals[names["TRL"]]
            print(f"held-out evaluation, {setup}: jaxtune / TRL = {t['median_s'] / j['median_s']:.2f}x (first call "
                  f"{t['first_s'] / j['first_s']:.2f}x)")

    result = record | {
        "held_out": evals,
        "machine_lscpu": machine, "command": command, "summary": summary, "rows": list(rows.values()),
        "config": vars(args) | {"threads": threads, "completions_per_step": completions, "seq_len": seq_len,
                                "params": n_params, "loadavg_before_after": [load0, load1],
                                "timed_s": run["seconds"], "omp_wait_policy": omp_wait},
        "jaxtune_setup_s": setup_s}
    return h.save_json(args.json, result)


if __name__ == "__main__":
    main()
