"""CPU DPO training-step throughput: jaxtune's DPO train step vs TRL's ``DPOTrainer``, on the same model and pairs.

One random ``LlamaForCausalLM`` (fp32, seeded, untied head) is written with ``save_pretrained`` into a temp dir, and
both sides start from it. The pairs are random token ids (ids 1..V-1): a prompt of ``--prompt`` ± 8 tokens, then a
chosen and a rejected completion of at least ``--min-completion`` tokens each, prompt + completion <= ``--seq`` tokens.
A step takes ``--batch`` pairs. DPO sigmoid loss, ``--beta``. AdamW on both sides: lr ``--lr``, betas (0.9, 0.999),
eps 1e-8, weight decay 0, a constant lr, global-norm clipping at 1.0 (TRL's and Trainer's defaults, except the lr
schedule, which is constant here on both sides).

- jaxtune: a config with ``model.from_hf=<dir>`` and ``objective.name=dpo``, built as ``train()`` builds it
  (``loop.py``): ``make_state_spec`` → ``step_reference`` (full fine-tuning: a frozen copy of the initial weights;
  LoRA: the base with the adapters off) → ``jit_steps`` (``jax.jit`` with explicit shardings, the state donated)
  → ``load_frozen`` + ``steps.frozen`` → ``init``. The batch is laid out as the data pipeline lays out pairs
  (`PairRows`: (B, 2, T), each sequence from position 0, right-padded, segment 0 on the padding). Timed: one call of
  the jitted step plus ``block_until_ready`` on the new state and the metrics, and reading the metrics to the host.
- TRL: a real ``DPOTrainer`` (``bf16=False``: TRL defaults to True even on CPU; ``gradient_checkpointing=False``:
  TRL defaults to True, jaxtune does not remat; ``max_length=T`` and ``pad_to_multiple_of=T`` so its collator pads
  every batch to the same T positions; ``lr_scheduler_type="constant"``; its default optimizer, ``adamw_torch_fused``,
  from ``create_optimizer_and_scheduler``). Full fine-tuning: ``ref_model`` is a second copy loaded from the same dir.
  LoRA: ``peft_config=LoraConfig(...)`` and no ref model, so TRL's reference is the policy with the adapters off;
  PEFT's ``lora_A`` is set to jaxtune's initial ``lora_a`` (jaxtune's own PEFT export), ``lora_B`` is zero on both
  sides. The batches are collated beforehand by ``trainer.data_collator`` (TRL's ``DataCollatorForPreference``).
  Timed: what ``Trainer._run_epoch`` does per optimizer step without the callbacks and the logging:
  ``trainer.training_step(model, inputs)`` (policy forward + backward, the reference forward under no_grad, TRL's
  metrics with their ``.item()`` calls), ``trainer._clip_grad_norm(model)``, ``optimizer.step()``,
  ``lr_scheduler.step()``, ``model.zero_grad()``, and ``loss.item()``. With ``torch.compile``, the policy's and the
  reference's modules are compiled in place (``nn.Module.compile()``, inductor, default mode) and TRL is unchanged.

The step-1 loss is log 2 on every side (the policy is its reference), so the check that both compute the same thing
is on what is not trivial: step 1's policy log-probs (``logps/chosen``, ``logps/rejected``, forward) and step 2's
loss and ``rewards/margins`` (after one AdamW update: gradients, clipping and optimizer). Step-1 values must agree to
1e-5 relative, or the script exits non-zero.

Tokens/s counts the padded positions, ``B * 2 * T`` per step on both sides; "real tokens/s" counts the non-padding
ones (the sum of TRL's attention mask: prompt + completion, chosen and rejected).

**``--lengths real``** (the default, ``--lengths fixed``, is all of the above: every batch padded to T on both sides,
so it cannot show what padding costs). The pairs' lengths are drawn as in chat preference data, prompts longer than
completions: a seeded lognormal prompt length with median ``--prompt-median`` x T and log-sd ``--length-sigma``, and a
chosen and a rejected completion drawn independently, median ``--completion-median`` x T (defaults 0.3, 0.13, 0.5),
the prompt clipped to [1, T - 1] and each completion to [1, T - prompt] (nothing is ever truncated by the sides). The
lengths are synthetic, not read from a corpus: ``../shared/data`` holds chat turns of a few words (ChatterBot) and 175
instruction rows, no preference pairs. The defaults keep the ratio of the issue's example (prompt 0.45, completions
0.2 x T) but scale it so T sits in the data's tail, as when seq_len is chosen to hold the data: ~2% of completions
are clipped (at 0.45 / 0.2, ~15% are, and nearly every batch of 8 pairs reaches T: no bucket below T is met). Every
step takes a new batch (``1 + (--warmup + --rounds) * --steps`` batches), the same ones on every side in the same order.

- jaxtune: each batch laid out at T as above and cut by ``BatchShapes.of(cfg).fit(batch)``, as ``loop.py`` does
  before every step (``data.length_buckets=--length-buckets``, default 4 per doubling), ahead of the timing as TRL's
  collation is (the script reports what ``fit`` costs per batch). Before the first step, the jitted step runs once
  per bucket length the batches will meet, on a throwaway copy of the state: compile time and the number of programs
  (``steps.compiles``) are reported apart and no timed step compiles. With ``--length-buckets`` > 0 a second
  jaxtune row per setup, built with ``data.length_buckets=0`` (every batch at T), shows what the buckets alone gain.
  These rows are a row per completion (``data.share_prompts=false``); the row "shared prompts" is the default layout:
  each pair one row of up to 2T positions, its prompt once then both completions (`PairRows` with ``shared``), cut
  to its bucket the same way, and its step-1 values are checked against the row-per-completion row (1e-5).
- TRL: ``pad_to_multiple_of=None``, ``max_length=T``: its collator pads each batch to its longest sequence, which is
  what a ``DPOTrainer`` run does. No torch.compile row: each new length would recompile inside the timed rounds.
- Reported per implementation: median ms/step, real tokens/s (the real tokens of the timed steps, prompt +
  completion of chosen and rejected as TRL's attention mask counts them, the same figure on every side, over the
  timed steps' wall time), positions stepped per step (2B x the batch's length) and the pad share of them,
  ``pad_fraction`` (jaxtune: as metrics.jsonl logs it; its rows are the inputs ``ids[:-1]``, one position per
  sequence fewer than TRL's, which computes logits for the last token too). The
  step-1 check is on the first batch (jaxtune cut to its bucket, TRL padded to its longest row), and the bucketed
  jaxtune row is also checked against the one at T: cutting changes no log-prob beyond float rounding.

Timing as in ``lora_sft_cpu.py``: after the first step (jaxtune: trace + compile; torch.compile: its compile) and
``--warmup`` rounds, the implementations are interleaved round by round in one process (order rotated every round),
each round running ``--steps`` steps of each; the tables report medians per step, and beside the ratio of medians
the ratio of the fastest steps and of the median CPU time (user + system, all threads) per step, which other work on
the machine disturbs less than wall time. XLA's pool uses the cores in the affinity mask and torch gets as many
threads. On a loaded machine set ``OMP_WAIT_POLICY=PASSIVE`` (see ``torchax_cpu.py``) or use ``--threads 1``. Usage:

    [OMP_WAIT_POLICY=PASSIVE] PYTHONPATH=src python benchmarks/dpo_cpu.py [--rounds 6 --steps 2 --batch 8 --seq 128]
        [--layers 4 --d-model 256 --heads 4 --kv-heads 2 --d-ff 688 --vocab 2048] [--rank 16 --alpha 32]
        [--no-lora | --no-full] [--no-compile] [--attn sdpa|eager] [--malloc-arena] [--threads N] [--json out.json]
        [--lengths fixed|real] [--length-buckets 4] [--prompt-median 0.3 --completion-median 0.13 --length-sigma 0.5]

e.g. real lengths at the default shape and at SmolLM2-135M's (30 layers, hidden 576, 9 heads / 3 kv, 1536, vocab
49152; minutes per round on a few cores):

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/dpo_cpu.py --lengths real --seq 512 --rounds 6 --steps 4
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/dpo_cpu.py --lengths real --seq 512 --rounds 3 --steps 4 \
        --layers 30 --d-model 576 --heads 9 --kv-heads 3 --d-ff 1536 --vocab 49152 --batch 4 --no-compile
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
import peft
import torch
import transformers
import trl

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.data.encoded import Encoded
from jaxtune.data.preference import PairRows
from jaxtune.models.lora import peft_tensors
from jaxtune.models.registry import FAMILIES
from jaxtune.train.objectives import make_objective
from jaxtune.train.reference import FrozenCopy, step_reference
from jaxtune.train.shapes import BatchShapes
from jaxtune.train.step import jit_steps

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEP1_RTOL = 1e-5  # same weights and pairs: step-1 log-probs agree to float32 reduction-order noise
METRICS = ("logps/chosen", "logps/rejected", "rewards/margins")  # read from both sides after every step
STEP1_KEYS = ("loss_step1", "logps/chosen_step1", "logps/rejected_step1")


# ---------------------------------------------------------------- model and data
def write_hf_model(directory: str, a: argparse.Namespace) -> int:
    """A seeded random fp32 LlamaForCausalLM of the benchmark shape, saved as safetensors; returns its params."""
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, intermediate_size=a.d_ff,
                                   max_position_embeddings=max(a.seq, 512), attention_dropout=0.0, use_cache=False,
                                   tie_word_embeddings=False, pad_token_id=h.PAD, bos_token_id=h.BOS,
                                   eos_token_id=h.EOS)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def random_pairs(rng: np.random.RandomState, a: argparse.Namespace) -> list[tuple[list[int], list[int], list[int]]]:
    """``--batch`` (prompt, chosen, rejected) token-id lists, each sequence at most ``--seq`` tokens."""
    out = []
    for _ in range(a.batch):
        prompt = rng.randint(1, a.vocab, rng.randint(a.prompt - 8, a.prompt + 9)).tolist()
        longest = a.seq - len(prompt)
        chosen, rejected = (rng.randint(1, a.vocab, rng.randint(a.min_completion, longest + 1)).tolist()
                            for _ in range(2))
        out.append((prompt, chosen, rejected))
    return out


def real_pairs(rng: np.random.RandomState, a: argparse.Namespace) -> list[tuple[list[int], list[int], list[int]]]:
    """``--batch`` (prompt, chosen, rejected) token-id lists of chat-like lengths (``--lengths real``): lognormal
    prompt and completion lengths, medians ``--prompt-median`` and ``--completion-median`` x T, log-sd
    ``--length-sigma``; the prompt clipped to [1, T - 1], each completion to [1, T - prompt]."""

    def length(median: float, most: int) -> int:
        return int(np.clip(round(rng.lognormal(math.log(median * a.seq), a.length_sigma)), 1, most))

    out = []
    for _ in range(a.batch):
        prompt = rng.randint(1, a.vocab, length(a.prompt_median, a.seq - 1)).tolist()
        chosen, rejected = (rng.randint(1, a.vocab, length(a.completion_median, a.seq - len(prompt))).tolist()
                            for _ in range(2))
        out.append((prompt, chosen, rejected))
    return out


def jaxtune_batch(pairs, seq: int, shared: bool = False) -> dict[str, np.ndarray]:
    """The pairs as jaxtune's data pipeline lays them out: (B, 2, T) arrays of `PairRows`, or with ``shared``
    prompts (B, 2T) rows, each pair's prompt once then both completions."""
    encoded = [tuple(Encoded(np.array(p + c, np.int32), np.array([0] * len(p) + [1] * len(c), bool)) for c in (ch, rj))
               for p, ch, rj in pairs]
    rows = PairRows.of(encoded, seq, shared)
    return {k: np.stack([rows[i][k] for i in range(len(rows))]) for k in rows[0]}


# ---------------------------------------------------------------- jaxtune
def jaxtune_dpo(cfg) -> dict:
    """jaxtune's DPO step as ``train()`` builds it (``loop.py``); {"mesh", "state", "frozen", "train", "reference",
    "setup_s"}."""
    t0 = time.perf_counter()
    mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    spec = make_state_spec(cfg, None, mesh)
    reference = step_reference(spec, cfg.objective, cfg.train.loss_chunk)
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, reference)
    frozen = steps.frozen(spec.load_frozen(cfg.train.seed), cfg.train.seed)
    state = spec.init(cfg.train.seed)
    jax.block_until_ready((state, frozen))
    return {"mesh": mesh, "state": state, "frozen": frozen, "steps": steps, "reference": reference,
            "setup_s": time.perf_counter() - t0}


def jaxtune_impl(cfg, host_batches, fit: bool) -> tuple[dict, dict]:
    """The timed step over ``host_batches`` (at T). ``fit``: each batch cut by ``BatchShapes.of(cfg).fit`` as the
    loop cuts it, and the step compiled for every length met, on a throwaway copy of the state, before any timing."""
    js = jaxtune_dpo(cfg)
    mesh, steps = js["mesh"], js["steps"]
    im = {"compiles": lambda: steps.compiles}
    if fit:
        shapes = BatchShapes.of(cfg)
        t0 = time.perf_counter()
        fitted = [shapes.fit(b) for b in host_batches]
        im["fit_us"] = (time.perf_counter() - t0) / len(host_batches) * 1e6
        host_batches = [b for b, _ in fitted]
        im["tokens"] = [shape.tokens for _, shape in fitted]
        im["positions"] = [shape.positions for _, shape in fitted]
        im["lengths"] = [shape.length for _, shape in fitted]
    batches = [sharding.global_batch(mesh, b) for b in host_batches]
    box = {"state": js["state"], "i": 0}
    if fit:  # one program per length, compiled as the loop's first batch of that length would compile it
        first_of = {length: i for i, length in reversed(list(enumerate(im["lengths"])))}
        t0 = time.perf_counter()
        scratch = jax.tree.map(lambda x: x.copy(), js["state"])
        with sharding.use_mesh(mesh):
            for length in sorted(first_of):
                scratch, metrics = steps.train(scratch, batches[first_of[length]], js["frozen"])
                jax.block_until_ready((scratch, metrics))
        del scratch
        im["compile_s"] = time.perf_counter() - t0
        im["programs"] = steps.compiles

    def step():
        with sharding.use_mesh(mesh):
            box["state"], metrics = steps.train(box["state"], batches[box["i"]], js["frozen"])
        jax.block_until_ready((box["state"], metrics))
        box["i"] += 1
        m = jax.device_get(metrics)
        return float(m["loss"]), {k: float(m[k]) for k in METRICS}

    return im | {"step": step}, js


# ---------------------------------------------------------------- TRL
def trl_trainer(directory: str, a: argparse.Namespace, tokenizer, out_dir: str, lora: bool, adapters=None):
    """A DPOTrainer over the saved model, full fine-tuning (a copy as ref_model) or LoRA (adapters off as the ref),
    with its optimizer and scheduler created as ``train()`` would create them."""
    from trl import DPOConfig, DPOTrainer

    def load():
        return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation=a.attn)

    args = DPOConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=a.batch, beta=a.beta, loss_type=["sigmoid"], learning_rate=a.lr,
                     lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, max_length=a.seq,
                     pad_to_multiple_of=a.seq if a.lengths == "fixed" else None,  # real: pad to the longest row
                     save_strategy="no", disable_tqdm=True)
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4"], "chosen": [" w5"], "rejected": [" w6"]})
    if lora:
        lcfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=HF_TARGETS, lora_dropout=0.0,
                               bias="none", task_type="CAUSAL_LM")
        trainer = DPOTrainer(model=load(), ref_model=None, args=args, train_dataset=data, processing_class=tokenizer,
                             peft_config=lcfg)
        tensors = {k: torch.from_numpy(v) for k, v in
                   peft_tensors(FAMILIES["llama"], jax.tree.map(jax.numpy.asarray, adapters)).items()}
        res = peft.set_peft_model_state_dict(trainer.model, tensors)
        if res.unexpected_keys:
            raise RuntimeError(f"PEFT did not take jaxtune's adapter tensors {res.unexpected_keys[:4]}")
        if trainer.ref_model is not None:
            raise RuntimeError("TRL with LoRA should use the adapters-off policy as its reference")
    else:
        trainer = DPOTrainer(model=load(), ref_model=load(), args=args, train_dataset=data,
                             processing_class=tokenizer)
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer._run_epoch before each step
    return trainer


def compile_in_place(trainer) -> None:
    """``nn.Module.compile()`` on the policy and the reference (the modules TRL calls); TRL's code is unchanged."""
    trainer.model.compile()
    if trainer.ref_model is not None:
        trainer.ref_model.compile()


def trl_impl(trainer, batches) -> dict:
    box = {"i": 0}

    def step():
        model = trainer.model
        loss = trainer.training_step(model, batches[box["i"]])  # forward + backward, the reference forward, metrics
        trainer._clip_grad_norm(model)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()
        box["i"] += 1
        m = trainer._metrics["train"]
        return loss.item(), {k: m[k][-1] for k in METRICS}

    return {"step": step}


# ---------------------------------------------------------------- report
def compare(j: dict, t: dict, beta: float) -> dict[str, tuple[float, float, float]]:
    """{value: (jaxtune, TRL, error)} of the checked values of two rows: relative differences, except step 2's
    rewards/margins, a difference of sums of ~T log-probs that nearly cancel, whose float32 error is measured against
    the size of those sums, beta * |logps| (as ``tests/train/test_preference_objectives.py`` measures it)."""
    out = {k: (j[k], t[k], abs(j[k] - t[k]) / abs(t[k])) for k in (*STEP1_KEYS, "loss_step2", "loss_last")}
    k = "rewards/margins_step2"
    scale = beta * max(abs(t["logps/chosen_step2"]), abs(t["logps/rejected_step2"]))
    return out | {k: (j[k], t[k], abs(j[k] - t[k]) / scale)}


# ---------------------------------------------------------------- machine
# ---------------------------------------------------------------- main
def add_preference_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    """The flags of the preference benchmarks (this one and ``kto_cpu.py``): rounds, the model and batch shape,
    beta, the learning rate and transformers' attention."""
    h.add_round_args(ap, rounds=rounds)
    h.add_common_args(ap, batch=8, seq=128, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=2048,
                      prompt=32, min_completion=32)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="transformers' attention (sdpa: its default)")


def check_fixed_lengths(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Fixed-length rows (`random_pairs`, ``kto_cpu.random_rows``): a prompt of --prompt ± 8 tokens leaves room for a
    completion of --min-completion in --seq."""
    if not (8 < a.prompt and a.prompt + 8 + a.min_completion <= a.seq):
        ap.error("need --prompt > 8 and --prompt + 8 + --min-completion <= --seq")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_preference_args(ap, rounds=6)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA rows")
    ap.add_argument("--no-full", action="store_true", help="skip the full fine-tuning rows (a large model's run "
                    "holds every row's state at once: one setup per run halves the memory)")
    ap.add_argument("--no-compile", action="store_true", help="skip the TRL torch.compile row")
    ap.add_argument("--lengths", choices=["fixed", "real"], default="fixed",
                    help="fixed: every batch padded to --seq on both sides; real: chat-like lengths, jaxtune cuts "
                         "each batch to its length bucket, TRL pads to the longest row")
    ap.add_argument("--length-buckets", type=int, default=4,
                    help="real: jaxtune's data.length_buckets (per doubling; 0: every batch at --seq)")
    ap.add_argument("--prompt-median", type=float, default=0.3, help="real: median prompt length, x --seq")
    ap.add_argument("--completion-median", type=float, default=0.13, help="real: median completion length, x --seq")
    ap.add_argument("--length-sigma", type=float, default=0.5, help="real: log-sd of the lognormal lengths")
    h.add_malloc_arg(ap)
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    real = args.lengths == "real"
    if real and not (args.prompt_median > 0 and args.completion_median > 0 and args.length_sigma >= 0
                     and args.length_buckets >= 0 and args.seq >= 2):
        ap.error("need positive --prompt-median and --completion-median, --length-sigma >= 0, --length-buckets >= 0")
    if not real:
        check_fixed_lengths(ap, args)
    threads = h.start_trainers(args)

    n_steps = 1 + (args.warmup + args.rounds) * args.steps  # per implementation, the first step included
    rng = np.random.RandomState(0)
    pair_sets = [(real_pairs if real else random_pairs)(rng, args) for _ in range(n_steps)]
    host_batches = [jaxtune_batch(p, args.seq) for p in pair_sets]
    shared_batches = [jaxtune_batch(p, args.seq, shared=True) for p in pair_sets] if real else None
    # the batches of the timed rounds (every implementation steps through the batches in order, one per step)
    timed = [1 + r * args.steps + k for r in range(args.warmup, args.warmup + args.rounds) for k in range(args.steps)]

    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "model")
    n_params = write_hf_model(model_dir, args)
    tokenizer = h.word_tokenizer(args.vocab)
    base = [f"model.from_hf={model_dir}", "objective.name=dpo", f"objective.beta={args.beta}",
            "objective.loss_type=sigmoid", "data.format=preference", "data.sources=[pairs.jsonl]",
            "data.share_prompts=false",
            f"data.length_buckets={args.length_buckets}",
            f"data.seq_len={args.seq}", f"train.batch_size={args.batch}", f"train.steps={n_steps}",
            f"optim.lr={args.lr}", "optim.b1=0.9", "optim.b2=0.999", "optim.eps=1e-8", "optim.weight_decay=0.0",
            "optim.grad_clip=1.0", "optim.schedule=constant", "optim.warmup_steps=0"]
    lora_keys = [f"model.lora.rank={args.rank}", f"model.lora.alpha={args.alpha}",
                 "model.lora.targets=[" + ",".join(HF_TARGETS) + "]"]

    setups = ([] if args.no_full else [("full FT", False)]) + ([] if args.no_lora else [(f"LoRA r{args.rank}", True)])
    if not setups:
        ap.error("--no-full and --no-lora leave nothing to run")
    impls: dict[str, dict] = {}
    rows_of: dict[str, dict[str, str]] = {}  # setup -> {"jaxtune": impl name, "TRL eager": ..., ...}
    notes: list[str] = []
    setup_s: dict[str, float] = {}
    trl_batches = None
    for setup, lora in setups:
        cfg = load_config(None, base + (lora_keys if lora else []))
        jname = f"jaxtune {setup} (jax.jit" + (f", buckets {args.length_buckets})" if real else ")")
        impls[jname], js = jaxtune_impl(cfg, host_batches, fit=real)
        setup_s[jname] = js["setup_s"]
        ref_kind = "frozen copy" if isinstance(js["reference"], FrozenCopy) else "adapters off"
        adapters = jax.device_get(js["state"].params) if lora else None  # before the first step donates the state
        rows_of[setup] = {"jaxtune": jname, "reference": ref_kind}
        if real:  # the default layout, prompts shared, against a row per completion (above)
            sname = f"jaxtune {setup} (jax.jit, buckets {args.length_buckets}, shared prompts)"
            impls[sname], _ = jaxtune_impl(load_config(None, [k for k in base if "share_prompts" not in k]
                                                       + (lora_keys if lora else [])), shared_batches, fit=True)
            rows_of[setup]["jaxtune shared"] = sname
        if real and args.length_buckets:  # the same step with every batch at T: what the buckets alone gain
            cfg0 = load_config(None, [k for k in base if not k.startswith("data.length_buckets=")]
                               + ["data.length_buckets=0"] + (lora_keys if lora else []))
            zname = f"jaxtune {setup} (jax.jit, no buckets: T)"
            impls[zname], js0 = jaxtune_impl(cfg0, host_batches, fit=True)
            setup_s[zname] = js0["setup_s"]
            rows_of[setup]["jaxtune T"] = zname
            del js0

        trainer = trl_trainer(model_dir, args, tokenizer, os.path.join(tmp.name, f"trl-{len(impls)}"), lora, adapters)
        if trl_batches is None:
            examples = [[{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in ps] for ps in pair_sets]
            trl_batches = [trainer.data_collator(ex) for ex in examples]
            shape = tuple(trl_batches[0]["input_ids"].shape)
            longest = [max(len(p) + max(len(c), len(r)) for p, c, r in ps) for ps in pair_sets]
            if any(tuple(b["input_ids"].shape) != (2 * args.batch, n if real else args.seq)
                   for b, n in zip(trl_batches, longest, strict=True)):
                raise RuntimeError(f"TRL's collator padded to {shape}, not (2B, " + ("the longest row)" if real else
                                                                                     f"T) = (2B, {args.seq})"))
            trl_tokens = [int(b["attention_mask"].sum()) for b in trl_batches]
            # jaxtune's rows are inputs = ids[:-1] (targets ids[1:]): one real position fewer per sequence
            if real and [n - 2 * args.batch for n in trl_tokens] != impls[jname]["tokens"]:
                raise RuntimeError("TRL's attention mask and jaxtune's segment ids count different real tokens")
        tname = f"TRL {setup} (eager)"
        impls[tname] = trl_impl(trainer, trl_batches)
        if real:
            impls[tname] |= {"tokens": trl_tokens, "positions": [b["input_ids"].numel() for b in trl_batches]}
        rows_of[setup]["TRL eager"] = tname
        if real and not args.no_compile:
            if not lora:
                notes.append("--lengths real runs no torch.compile row: every new batch length would recompile it "
                             "inside the timed rounds")
        elif not lora and not args.no_compile:
            ctrainer = trl_trainer(model_dir, args, tokenizer, os.path.join(tmp.name, "trl-compiled"), lora)
            compile_in_place(ctrainer)
            cname = f"TRL {setup} (torch.compile)"
            impls[cname] = trl_impl(ctrainer, trl_batches)
            rows_of[setup]["TRL compile"] = cname
        elif lora and not args.no_compile:
            notes.append("torch.compile was run for full fine-tuning only (one compiled row keeps the run short)")

    real_tokens = float(np.mean([float(b["attention_mask"].sum()) for b in trl_batches]))
    completion_tokens = float(np.mean([float(b["completion_mask"].sum()) for b in trl_batches]))

    failed = []
    for name, im in list(impls.items()):
        im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
        try:
            im["first"], im["first_step_s"] = h.first_call(im["step"])  # jaxtune: trace + compile; torch.compile too
        except Exception as e:  # torch.compile is allowed to fail; it is reported, the rest still runs
            if "torch.compile" not in name:
                raise
            failed.append(f"{name} failed on its first step: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            del impls[name]
            for names in rows_of.values():
                if names.get("TRL compile") == name:
                    del names["TRL compile"]
    notes += failed
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    load0, load1 = run["load_before"], run["load_after"]
    tmp.cleanup()

    # ---- report (times are per round of --steps steps: per step below)
    tokens = 2 * args.batch * args.seq
    rows = {}
    for name, im in impls.items():
        im["times"] = [t / args.steps for t in im["times"]]
        im["cpu"] = [c / args.steps for c in im["cpu"]]
        seq = [im["first"]] + [x for out in im["outputs"] for x in out]
        im["losses"] = [loss for loss, _ in seq]
        timing = h.timing_row(im, tokens)
        row = {"implementation": name, **timing, "first_step_s": im["first_step_s"],
               "real_tokens_per_s": real_tokens / (timing["ms_per_step"] / 1e3),
               "loss_step1": seq[0][0], "loss_step2": seq[1][0], "loss_last": seq[-1][0], "steps_run": len(seq)}
        row |= {f"{k}_step1": seq[0][1][k] for k in METRICS} | {f"{k}_step2": seq[1][1][k] for k in METRICS}
        if "compiles" in im:
            row["jax_compiles"] = im["compiles"]()
        if real:  # each step its own batch: throughput over the timed steps, their positions and padding
            real_s, pos = sum(im["times"]) * args.steps, sum(im["positions"][i] for i in timed)
            tok = sum(trl_tokens[i] for i in timed)  # prompt + completion, chosen and rejected: the same on all sides
            row |= {"tokens_per_s": pos / real_s, "real_tokens_per_s": tok / real_s,
                    "positions_per_step": pos / len(timed), "real_tokens_per_step": tok / len(timed),
                    "pad_fraction": 1 - sum(im["tokens"][i] for i in timed) / pos}  # of its own positions
            row |= {k: im[k] for k in ("programs", "compile_s", "fit_us") if k in im}
            if "lengths" in im:
                row |= {"lengths_compiled": sorted(set(im["lengths"])),
                        "lengths_timed": sorted({im["lengths"][i] for i in timed})}
        rows[name] = row

    checks, bad = [], []
    for setup, names in rows_of.items():
        for key in ("TRL eager", "TRL compile", "jaxtune T", "jaxtune shared"):
            if key in names:
                checks.append({"setup": setup, "vs": names[key], **compare(rows[names["jaxtune"]], rows[names[key]],
                                                                           args.beta)})
                if max(checks[-1][k][2] for k in STEP1_KEYS) > STEP1_RTOL:
                    bad.append(f"{setup}: {names[key]}")

    omp_wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    command = (("" if omp_wait == "unset" else f"OMP_WAIT_POLICY={omp_wait} ") + "PYTHONPATH=src "
               + " ".join(["python", *(sys.argv if argv is None else [sys.argv[0], *argv])]))
    record = h.run_record(jax=jax, jaxlib=jaxlib, torch=torch, transformers=transformers, trl=trl, peft=peft, flax=flax,
                          optax=optax, numpy=np)
    versions = record["versions"]
    machine = h.machine()
    print(f"machine: {machine}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"command: {command}")
    print(f"Llama (random, fp32, untied head): {args.layers} layers, hidden {args.d_model}, {args.heads} heads "
          f"({args.kv_heads} kv), intermediate {args.d_ff}, vocab {args.vocab}, {n_params / 1e6:.2f}M params; "
          f"transformers attention {args.attn}")
    if not real:
        print(f"pairs: batch {args.batch} pairs x 2 x T {args.seq} = {tokens} padded positions/step; prompt "
              f"{args.prompt}±8 tokens, completions >= {args.min_completion}; real (non-pad) tokens "
              f"{real_tokens:.0f}/step ({real_tokens / tokens:.0%}), completion tokens {completion_tokens:.0f}/step")
    else:
        jrow = rows[rows_of[setups[0][0]]["jaxtune"]]
        lengths = impls[rows_of[setups[0][0]]["jaxtune"]]["lengths"]
        met = {n: lengths.count(n) for n in sorted(set(lengths))}
        shared_lengths = impls[rows_of[setups[0][0]]["jaxtune shared"]]["lengths"]
        met_shared = {n: shared_lengths.count(n) for n in sorted(set(shared_lengths))}
        trl_len = [int(b["input_ids"].shape[1]) for b in trl_batches]
        print(f"pairs (--lengths real): {len(pair_sets)} batches of {args.batch} pairs, T {args.seq}; lognormal "
              f"lengths (log-sd {args.length_sigma:g}), prompt median {args.prompt_median:g} x T = "
              f"{args.prompt_median * args.seq:.0f}, completions {args.completion_median:g} x T = "
              f"{args.completion_median * args.seq:.0f}; real tokens {jrow['real_tokens_per_step']:.0f}/step "
              f"(timed mean), completion tokens {completion_tokens:.0f}/step (all batches)")
        print(f"lengths: jaxtune buckets ({args.length_buckets} per doubling) met {met} (length: batches), with shared "
              f"prompts (rows of up to 2T) {met_shared}; TRL's "
              f"longest row min / median / max {min(trl_len)} / {int(np.median(trl_len))} / {max(trl_len)}; "
              f"BatchShapes.fit {jrow['fit_us']:.0f} us/batch (outside the timing, as TRL's collation)")
    print(f"DPO sigmoid beta {args.beta:g}; AdamW lr {args.lr:g} betas (0.9, 0.999) eps 1e-8 wd 0, constant lr, clip "
          f"1.0; LoRA r {args.rank} alpha {args.alpha:g} on {' '.join(HF_TARGETS)}")
    print(f"threads: XLA {threads} / torch {torch.get_num_threads()} (OMP_WAIT_POLICY {omp_wait}); malloc tuning "
          f"{'on' if args.malloc_arena else 'off'}; first step + {args.warmup} warm-up round(s) + {args.rounds} timed "
          f"rounds of {args.steps} step(s) per implementation, interleaved ({run['seconds']:.0f} s); load average "
          f"{load0[0]:.2f} -> {load1[0]:.2f} (1 min), {load0[1]:.2f} -> {load1[1]:.2f} (5 min)")
    print("jaxtune setup (spec, weights from the checkpoint, reference, state): "
          + ", ".join(f"{n} {s:.1f} s" for n, s in setup_s.items()))
    for n in notes:
        print(f"note: {n}")
    print("correctness (same checkpoint, same pairs; jaxtune vs TRL" + (", and cut to buckets vs at T" if real else "")
          + ", relative difference):")
    for c in checks:
        print(f"  {c['setup']} vs {c['vs']}: " + "; ".join(
            f"{k} {c[k][0]:.7g} / {c[k][1]:.7g} ({c[k][2]:.1e})" for k in
            ("loss_step1", "logps/chosen_step1", "logps/rejected_step1", "loss_step2", "rewards/margins_step2")))
        print(f"    last step ({rows[rows_of[c['setup']]['jaxtune']]['steps_run']}) loss {c['loss_last'][0]:.7g} / "
              f"{c['loss_last'][1]:.7g} ({c['loss_last'][2]:.1e}); ln 2 = {math.log(2):.7f}")

    if real:
        summary = real_tables(rows, rows_of)
    else:
        summary = fixed_tables(rows, rows_of)
    h.say_noisy(rows.values(), load1[0])
    recompiled = [r["implementation"] for r in rows.values() if r.get("jax_compiles", 1) != r.get("programs", 1)]
    if recompiled:
        print(f"warning: the jitted step was traced more times than the lengths it met for {recompiled}")

    result = record | {
        "machine_lscpu": machine, "command": command, "summary": summary, "checks": checks,
        "rows": list(rows.values()), "notes": notes,
        "config": vars(args) | {"threads": threads, "padded_tokens_per_step": tokens,
                                "real_tokens_per_step": real_tokens, "completion_tokens_per_step": completion_tokens,
                                "params": n_params, "loadavg_before_after": [load0, load1],
                                "timed_s": run["seconds"], "omp_wait_policy": omp_wait},
        "jaxtune_setup_s": setup_s, "losses": {name: im["losses"] for name, im in impls.items()}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if bad:  # the timings would compare different computations: fail loudly
        sys.exit(f"step-1 loss or log-probs differ by more than {STEP1_RTOL:g} (relative) for {bad}")
    return result


def fixed_tables(rows: dict[str, dict], rows_of: dict[str, dict[str, str]]) -> list[dict]:
    """``--lengths fixed``: jaxtune vs each TRL row per setup, then every implementation; the summary rows."""
    head = ["setup", "reference", "jaxtune ms/step", "TRL ms/step", "ratio (TRL / jaxtune time)", "(best step)",
            "(CPU time)", "jaxtune tokens/s", "TRL tokens/s"]
    h.print_header(head, 2)
    summary = []
    for setup, names in rows_of.items():
        j = rows[names["jaxtune"]]
        for key in ("TRL eager", "TRL compile"):
            if key not in names:
                continue
            t = rows[names[key]]
            ratio = t["ms_per_step"] / j["ms_per_step"]
            label = f"{setup}, TRL {'eager' if key == 'TRL eager' else 'torch.compile'}"
            best, cpu = t["ms_per_step_min"] / j["ms_per_step_min"], t["cpu_ms_per_step"] / j["cpu_ms_per_step"]
            summary.append({"setup": label, "jaxtune_ms": j["ms_per_step"], "trl_ms": t["ms_per_step"],
                            "ratio": ratio, "ratio_best_step": best, "ratio_cpu_time": cpu})
            print(f"| {label} | {names['reference']} | {j['ms_per_step']:.0f} | {t['ms_per_step']:.0f} | "
                  f"**{ratio:.2f}x** | {best:.2f}x | {cpu:.2f}x | {j['tokens_per_s']:,.0f} | "
                  f"{t['tokens_per_s']:,.0f} |")

    head = ["implementation", "tokens/s (median)", "real tokens/s", "ms/step (median / min)", "CPU ms/step",
            "first step (s)"]
    h.print_header(head)
    for r in rows.values():
        print(f"| {r['implementation']} | {r['tokens_per_s']:,.0f} | {r['real_tokens_per_s']:,.0f} | "
              f"{r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f} | {r['cpu_ms_per_step']:.0f} | "
              f"{r['first_step_s']:.1f} |")
    return summary


def real_tables(rows: dict[str, dict], rows_of: dict[str, dict[str, str]]) -> list[dict]:
    """``--lengths real``: per setup jaxtune (buckets) vs TRL (longest row) and jaxtune at T, then every
    implementation with its positions, pad share and compiles; the summary rows."""
    head = ["setup", "reference", "jaxtune shared ms/step", "TRL ms/step", "ratio (TRL / jaxtune shared)",
            "(best step)", "(CPU time)", "jaxtune rows ms/step", "sharing gain (rows / shared)",
            "jaxtune at T ms/step", "buckets gain (T / rows)", "pad share rows / TRL / at T"]
    h.print_header(head, 2)
    summary = []
    for setup, names in rows_of.items():
        j, t, sh = rows[names["jaxtune"]], rows[names["TRL eager"]], rows[names["jaxtune shared"]]
        z = rows.get(names.get("jaxtune T", ""))
        ratio = t["ms_per_step"] / sh["ms_per_step"]
        best, cpu = t["ms_per_step_min"] / sh["ms_per_step_min"], t["cpu_ms_per_step"] / sh["cpu_ms_per_step"]
        sharing = j["ms_per_step"] / sh["ms_per_step"]
        gain = z["ms_per_step"] / j["ms_per_step"] if z else None
        summary.append({"setup": f"{setup}, TRL eager", "jaxtune_shared_ms": sh["ms_per_step"],
                        "jaxtune_ms": j["ms_per_step"], "trl_ms": t["ms_per_step"], "ratio": ratio,
                        "ratio_best_step": best, "ratio_cpu_time": cpu, "sharing_gain": sharing,
                        "ratio_rows": t["ms_per_step"] / j["ms_per_step"],
                        "jaxtune_at_T_ms": z["ms_per_step"] if z else None, "buckets_gain": gain,
                        "pad_fraction": {"jaxtune": j["pad_fraction"], "trl": t["pad_fraction"],
                                         "jaxtune_shared": sh["pad_fraction"],
                                         "jaxtune_at_T": z["pad_fraction"] if z else None}})
        print(f"| {setup}, TRL eager | {names['reference']} | {sh['ms_per_step']:.0f} | {t['ms_per_step']:.0f} | "
              f"**{ratio:.2f}x** | {best:.2f}x | {cpu:.2f}x | {j['ms_per_step']:.0f} | {sharing:.2f}x | "
              + (f"{z['ms_per_step']:.0f} | {gain:.2f}x | " if z else "- | - | ")
              + f"{j['pad_fraction']:.0%} / {t['pad_fraction']:.0%} / " + (f"{z['pad_fraction']:.0%} |" if z
                                                                            else "- |"))

    head = ["implementation", "ms/step (median / min)", "CPU ms/step", "real tokens/s", "positions/step",
            "pad share", "programs compiled", "compile (s)", "first step (s)"]
    h.print_header(head)
    for r in rows.values():
        programs = f"{r['programs']} ({', '.join(map(str, r['lengths_compiled']))})" if "programs" in r else "-"
        print(f"| {r['implementation']} | {r['ms_per_step']:.0f} / {r['ms_per_step_min']:.0f} | "
              f"{r['cpu_ms_per_step']:.0f} | {r['real_tokens_per_s']:,.0f} | {r['positions_per_step']:,.0f} | "
              f"{r['pad_fraction']:.0%} | {programs} | " + (f"{r['compile_s']:.1f}" if "compile_s" in r else "-")
              + f" | {r['first_step_s']:.1f} |")
    return summary


if __name__ == "__main__":
    main()
