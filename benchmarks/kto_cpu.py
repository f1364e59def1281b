"""CPU KTO training-step throughput: jaxtune's KTO step vs TRL's ``KTOTrainer``, on the same model and rows.

The random Llama and the AdamW setup of ``dpo_cpu.py`` (fp32, seeded, untied head, constant lr, clipping 1.0), full
fine-tuning with a frozen copy as the reference on both sides. A step takes ``--batch`` unpaired rows: a prompt of
``--prompt`` ± 8 random token ids and a completion of ``--min-completion`` to ``--seq`` - prompt tokens, labelled
desirable and undesirable alternately; each row's KL sequence is its prompt with the previous row's completion (TRL's
rotation within the batch), on both sides.

- jaxtune: ``objective.name=kto``, built as ``train()`` builds it (``dpo_cpu.jaxtune_dpo``: spec, reference, jitted
  step, frozen copy, state); the batch laid out as the data pipeline lays it out (`UnpairedRows`: (B, 2, T), the row
  and its KL row). Timed: the jitted step (its ``prepare``: the KL rows' forward without gradient for the baseline;
  the rows' forward and backward; the reference's forwards) and reading the metrics.
- TRL: a real ``KTOTrainer`` (``bf16=False``, ``gradient_checkpointing=False``, ``max_length=T`` and
  ``pad_to_multiple_of=T``: every batch padded to T as jaxtune's), the batches collated beforehand by its collator.
  Timed: ``training_step`` (the KL rows' forward, the policy's forward and backward, the reference's forwards, the
  metrics), gradient clipping, ``optimizer.step()``, ``zero_grad`` and ``loss.item()``.

Step 1 must give the same loss (1/2: the policy is its reference) and step 2 the same loss to 1e-4 relative (one
AdamW update: gradients, clipping and optimizer), or the script exits non-zero.

    PYTHONPATH=src python benchmarks/kto_cpu.py [--rounds 4 --steps 2] [--batch 8 --seq 128 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import _harness as h
import datasets
import jax
import numpy as np
import torch
import transformers
import trl
from dpo_cpu import add_preference_args, check_fixed_lengths, jaxtune_dpo, write_hf_model

from jaxtune import sharding
from jaxtune.config import load_config
from jaxtune.data.encoded import Encoded
from jaxtune.data.unpaired import EncodedRow, UnpairedRows

STEP2_RTOL = 1e-4


def random_rows(rng: np.random.RandomState, a: argparse.Namespace) -> list[tuple[list[int], list[int], bool]]:
    out = []
    for k in range(a.batch):
        prompt = rng.randint(1, a.vocab, rng.randint(a.prompt - 8, a.prompt + 9)).tolist()
        completion = rng.randint(1, a.vocab, rng.randint(a.min_completion, a.seq - len(prompt) + 1)).tolist()
        out.append((prompt, completion, k % 2 == 0))
    return out


def jaxtune_batch(rows, seq: int) -> dict[str, np.ndarray]:
    encoded = [EncodedRow(Encoded(np.array(p + c, np.int32), np.array([0] * len(p) + [1] * len(c), bool)), len(p),
                          label) for p, c, label in rows]
    items = UnpairedRows.of(encoded, seq, chunk=len(rows))
    return {k: np.stack([items[i][k] for i in range(len(items))]) for k in items[0]}


def jaxtune_impl(cfg, host_batches) -> dict:
    js = jaxtune_dpo(cfg)
    mesh, steps = js["mesh"], js["steps"]
    batches = [sharding.global_batch(mesh, b) for b in host_batches]
    box = {"state": js["state"], "i": 0}

    def step():
        with sharding.use_mesh(mesh):
            box["state"], metrics = steps.train(box["state"], batches[box["i"]], js["frozen"])
        jax.block_until_ready((box["state"], metrics))
        box["i"] += 1
        return float(jax.device_get(metrics)["loss"])

    return {"step": step, "compiles": lambda: steps.compiles}


def trl_impl(directory: str, a: argparse.Namespace, out_dir: str, row_sets) -> dict:
    from trl import KTOConfig, KTOTrainer

    def load():
        return transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation=a.attn)

    args = KTOConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=a.batch, beta=a.beta, learning_rate=a.lr,
                     lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, max_length=a.seq + 1,
                     pad_to_multiple_of=a.seq + 1, train_sampling_strategy="sequential", save_strategy="no",
                     disable_tqdm=True)
    data = datasets.Dataset.from_dict({"prompt": ["w3 w4", "w5"], "completion": [" w5", " w6"],
                                       "label": [True, False]})
    trainer = KTOTrainer(model=load(), ref_model=load(), args=args, train_dataset=data,
                         processing_class=h.word_tokenizer(a.vocab))
    trainer.create_optimizer_and_scheduler(num_training_steps=10**6)
    trainer.current_gradient_accumulation_steps = 1
    batches = []
    for rows in row_sets:
        completions = [c for _, c, _ in rows]
        kl = [completions[-1], *completions[:-1]]
        batches.append(trainer.data_collator([{"prompt_ids": p, "completion_ids": c, "label": label,
                                               "KL_completion_ids": k} for (p, c, label), k in zip(rows, kl)]))
    return {"step": h.trainer_step(trainer, batches)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_preference_args(ap, rounds=4)
    h.add_malloc_arg(ap)
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    check_fixed_lengths(ap, args)
    threads = h.start_trainers(args)
    n_steps = 2 + (args.warmup + args.rounds) * args.steps  # steps 1 and 2 (checked), then the rounds
    rng = np.random.RandomState(0)
    row_sets = [random_rows(rng, args) for _ in range(n_steps)]

    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "model")
    n_params = write_hf_model(model_dir, args)
    cfg = load_config(None, [f"model.from_hf={model_dir}", "objective.name=kto", f"objective.beta={args.beta}",
                             "data.format=unpaired", "data.sources=[rows.jsonl]", f"data.seq_len={args.seq}",
                             "data.length_buckets=0", f"train.batch_size={args.batch}", f"train.steps={n_steps}",
                             f"optim.lr={args.lr}", "optim.b1=0.9", "optim.b2=0.999", "optim.eps=1e-8",
                             "optim.weight_decay=0.0", "optim.grad_clip=1.0", "optim.schedule=constant",
                             "optim.warmup_steps=0"])
    impls = {"jaxtune (jax.jit)": jaxtune_impl(cfg, [jaxtune_batch(r, args.seq) for r in row_sets]),
             "TRL (eager)": trl_impl(model_dir, args, os.path.join(tmp.name, "trl"), row_sets)}
    for im in impls.values():
        im["fn"] = lambda _, st=im["step"]: [st() for _ in range(args.steps)]
        first = [im["step"]()]  # step 1 (jaxtune: trace and compile)
        first.append(im["step"]())  # step 2: after one update
        im["first_losses"] = first
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    tmp.cleanup()
    (j1, j2), (t1, t2) = (impls[k]["first_losses"] for k in ("jaxtune (jax.jit)", "TRL (eager)"))
    ok = abs(j1 - t1) <= 1e-6 and abs(j2 - t2) <= STEP2_RTOL * abs(t2)
    rows = {}
    for name, im in impls.items():
        im["times"] = [t / args.steps for t in im["times"]]
        im["cpu"] = [c / args.steps for c in im["cpu"]]
        rows[name] = {"implementation": name, **h.timing_row(im, args.batch * 2 * args.seq)}
    said = h.say_run(argv, jax=jax, torch=torch, transformers=transformers, trl=trl, numpy=np)
    print(f"Llama (random, fp32, untied head): {args.layers} layers, hidden {args.d_model}, {n_params / 1e6:.2f}M "
          f"params; KTO beta {args.beta}, {args.batch} rows x T {args.seq} (+ their KL rows), full fine-tuning, a "
          f"frozen copy as the reference; threads {threads}; {args.rounds} timed rounds of {args.steps} step(s) "
          f"({run['seconds']:.0f} s; load average {run['load_before'][0]:.2f} -> {run['load_after'][0]:.2f})")
    h.print_losses_and_steps((j1, j2), (t1, t2), ok, rows)
    return h.finish_two_sided(args, rows, "jaxtune (jax.jit)", run, said, n_params,
                              {"jaxtune": [j1, j2], "trl": [t1, t2]}, ok)


if __name__ == "__main__":
    main()
