"""CPU reward-model training step: jaxtune's (``objective.name=reward``) vs TRL's ``RewardTrainer`` on the same pairs.

One random ``LlamaForSequenceClassification`` (fp32, seeded, num_labels 1, pad id 0) is written with
``save_pretrained`` into a temp dir, and both sides start from it (its score head included). The pairs are random
token ids (1..V-1, never the pad id) of chat-like lengths, as ``dpo_cpu.py --lengths real`` draws them (lognormal
prompt and completion lengths, medians ``--prompt-median`` and ``--completion-median`` x T, log-sd
``--length-sigma``; prompts longer than completions). A step takes ``--batch`` pairs. Bradley-Terry loss, AdamW on
both sides: lr ``--lr``, betas (0.9, 0.999), eps 1e-8, weight decay 0, a constant lr, global-norm clipping at 1.0.

- jaxtune: a config with ``model.from_hf=<dir>`` and ``objective.name=reward``, its step built as ``train()`` builds
  it (``jit_steps``, the state donated). Each batch laid out as the data pipeline lays out pairs (`PairRows`: the
  default, each pair one row of its prompt once then both completions; the row "a row per sequence", (B, 2, T) with
  ``data.share_prompts=false``) and cut by ``BatchShapes.of(cfg).fit`` as ``loop.py`` does before every step
  (``data.length_buckets`` 4 per doubling); the step compiled for every length met before the timing, its program
  count reported.
- TRL: a real ``RewardTrainer`` (``bf16=False``, ``gradient_checkpointing=False``, ``lr_scheduler_type="constant"``,
  its default ``adamw_torch_fused``); each batch collated beforehand by its own collator (chosen then rejected ids,
  padded to the batch's longest). Timed: ``training_step`` (forward, backward, its metrics), ``_clip_grad_norm``,
  ``optimizer.step()``, ``lr_scheduler.step()``, ``zero_grad()``, ``loss.item()``.

Both score the same token as the reward (the last of each sequence). Checked: step-1 and step-2 losses agree (1e-5,
1e-4 relative), or the script exits non-zero. Timing as the other benchmarks beside TRL: first steps apart, then
``--rounds`` rounds of ``--steps`` steps interleaved, medians per step. Usage:

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python benchmarks/reward_cpu.py [--rounds 4 --steps 2 --batch 8 --seq 512]
        [--layers 4 --d-model 256 --heads 4 --kv-heads 2 --d-ff 688 --vocab 2048] [--json out.json]

e.g. at SmolLM2-135M's shapes: ``--layers 30 --d-model 576 --heads 9 --kv-heads 3 --d-ff 1536 --vocab 49152 --batch 4``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import _harness as h
import datasets
import jax
import numpy as np
import torch
import transformers
import trl
from dpo_cpu import jaxtune_batch, real_pairs

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.train.objectives import make_objective
from jaxtune.train.shapes import BatchShapes
from jaxtune.train.step import jit_steps

STEP1_RTOL, STEP2_RTOL = 1e-5, 1e-4


def write_hf_model(directory: str, a: argparse.Namespace) -> int:
    """A seeded random fp32 LlamaForSequenceClassification (num_labels 1), saved; returns its parameter count."""
    cfg = transformers.LlamaConfig(vocab_size=a.vocab, hidden_size=a.d_model, num_hidden_layers=a.layers,
                                   num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                   head_dim=a.d_model // a.heads, intermediate_size=a.d_ff,
                                   max_position_embeddings=max(a.seq + 1, 512), attention_dropout=0.0,
                                   use_cache=False, tie_word_embeddings=False, pad_token_id=h.PAD,
                                   bos_token_id=h.BOS, eos_token_id=h.EOS, num_labels=1)
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification._from_config(cfg, attn_implementation="eager",
                                                                     dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def jaxtune_impl(cfg, pair_sets, seq: int) -> dict:
    mesh = sharding.make_mesh(1, 1, 1)
    spec = make_state_spec(cfg, None, mesh)
    steps = jit_steps(spec, make_objective(cfg.objective), cfg.train, None)
    shapes = BatchShapes.of(cfg)
    fitted = [shapes.fit(jaxtune_batch(pairs, seq, cfg.data.shares_prompts)) for pairs in pair_sets]
    batches = [sharding.global_batch(mesh, b) for b, _ in fitted]
    box = {"state": spec.init(0), "i": 0}
    frozen = steps.frozen(spec.load_frozen(0), 0)
    lengths = [shape.length for _, shape in fitted]
    first_of = {n: i for i, n in reversed(list(enumerate(lengths)))}
    t0 = time.perf_counter()
    scratch = jax.tree.map(lambda x: x.copy(), box["state"])
    with sharding.use_mesh(mesh):
        for n in sorted(first_of):  # every length's program compiled before any timing
            scratch, metrics = steps.train(scratch, batches[first_of[n]], frozen)
            jax.block_until_ready((scratch, metrics))
    del scratch
    compile_s = time.perf_counter() - t0

    def step():
        with sharding.use_mesh(mesh):
            box["state"], metrics = steps.train(box["state"], batches[box["i"]], frozen)
        jax.block_until_ready((box["state"], metrics))
        box["i"] += 1
        return float(jax.device_get(metrics)["loss"])

    return {"step": step, "compiles": lambda: steps.compiles, "compile_s": compile_s, "lengths": lengths}


def trl_impl(directory: str, a: argparse.Namespace, out_dir: str, pair_sets) -> dict:
    from trl import RewardConfig, RewardTrainer

    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32,
                                                                            attn_implementation=a.attn)
    args = RewardConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                        per_device_train_batch_size=a.batch, learning_rate=a.lr, lr_scheduler_type="constant",
                        weight_decay=0.0, max_grad_norm=1.0, save_strategy="no", disable_tqdm=True)
    data = datasets.Dataset.from_dict({"chosen": ["w3 w4"], "rejected": ["w5"]})
    trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=h.word_tokenizer(a.vocab))
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1
    batches = [trainer.data_collator([{"chosen_ids": p + c, "rejected_ids": p + r} for p, c, r in pairs])
               for pairs in pair_sets]
    return {"step": h.trainer_step(trainer, batches)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_round_args(ap, rounds=4)
    h.add_common_args(ap, batch=8, seq=512, layers=4, d_model=256, heads=4, kv_heads=2, d_ff=688, vocab=2048)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--prompt-median", type=float, default=0.3)
    ap.add_argument("--completion-median", type=float, default=0.13)
    ap.add_argument("--length-sigma", type=float, default=0.5)
    h.add_malloc_arg(ap)
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    threads = h.start_trainers(args)
    n_steps = 2 + (args.warmup + args.rounds) * args.steps
    rng = np.random.RandomState(0)
    pair_sets = [real_pairs(rng, args) for _ in range(n_steps)]

    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "model")
    n_params = write_hf_model(model_dir, args)
    cfg = load_config(None, [f"model.from_hf={model_dir}", "objective.name=reward", "data.format=preference",
                             "data.sources=[pairs.jsonl]", f"data.seq_len={args.seq}", f"train.batch_size={args.batch}",
                             f"train.steps={n_steps}", f"optim.lr={args.lr}", "optim.b1=0.9", "optim.b2=0.999",
                             "optim.eps=1e-8", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
                             "optim.schedule=constant", "optim.warmup_steps=0", "eval.exact_match=0"])
    rows_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"share_prompts": False})})
    impls = {"jaxtune (jax.jit)": jaxtune_impl(cfg, pair_sets, args.seq),
             "jaxtune, a row per sequence (jax.jit)": jaxtune_impl(rows_cfg, pair_sets, args.seq),
             "TRL (eager)": trl_impl(model_dir, args, os.path.join(tmp.name, "trl"), pair_sets)}
    for im in impls.values():
        im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
        im["first_losses"] = [im["step"](), im["step"]()]  # steps 1 and 2 (checked), untimed
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    tmp.cleanup()
    jx, jr, tr = (impls[k] for k in ("jaxtune (jax.jit)", "jaxtune, a row per sequence (jax.jit)", "TRL (eager)"))
    (j1, j2), (t1, t2) = jx["first_losses"], tr["first_losses"]
    ok = all(abs(a1 - t1) <= STEP1_RTOL * abs(t1) and abs(a2 - t2) <= STEP2_RTOL * abs(t2)
             for a1, a2 in (jx["first_losses"], jr["first_losses"]))
    real = [sum(len(p) + len(c) + len(p) + len(r) for p, c, r in pairs) for pairs in pair_sets]
    rows = {}
    for name, im in impls.items():
        im["times"] = [t / args.steps for t in im["times"]]
        im["cpu"] = [c / args.steps for c in im["cpu"]]
        rows[name] = {"implementation": name, **h.timing_row(im, float(np.mean(real)))}
    said = h.say_run(argv, jax=jax, torch=torch, transformers=transformers, trl=trl, numpy=np)
    print(f"Llama classifier (random, fp32, num_labels 1): {args.layers} layers, hidden {args.d_model}, "
          f"{n_params / 1e6:.2f}M params; {args.batch} pairs x T {args.seq}, real lengths (mean "
          f"{np.mean(real) / args.batch / 2:.0f} tokens a sequence); full fine-tuning; threads {threads}; "
          f"{args.rounds} timed rounds of {args.steps} step(s) ({run['seconds']:.0f} s; load average "
          f"{run['load_before'][0]:.2f} -> {run['load_after'][0]:.2f}); jaxtune compiled {jx['compiles']()} "
          f"program(s) for lengths {sorted(set(jx['lengths']))} in {jx['compile_s']:.1f} s (a row per sequence: "
          f"{jr['compiles']()} for {sorted(set(jr['lengths']))} in {jr['compile_s']:.1f} s)")
    h.print_losses_and_steps((j1, j2), (t1, t2), ok, rows)
    per_row = rows["TRL (eager)"]["ms_per_step"] / rows["jaxtune, a row per sequence (jax.jit)"]["ms_per_step"]
    return h.finish_two_sided(args, rows, "jaxtune (jax.jit)", run, said, n_params,
                              {"jaxtune": [j1, j2], "trl": [t1, t2]}, ok, f"; a row per sequence {per_row:.2f}x")


if __name__ == "__main__":
    main()
