"""CPU generation throughput: jaxtune's sampler (`jaxtune.models.sampling.Generator`) vs transformers' ``generate``
on the same model, prompts and lengths, greedy and sampled; with ``--lora`` also a LoRA model both ways: jaxtune's
adapters merged into the weights once per call (what its sampler does) or left on every token, and PEFT's model.

The model is `grpo_cpu.py`'s: a seeded random fp32 ``LlamaForCausalLM`` (untied head, EOS biased out so that every
row generates exactly ``--max-completion-length`` tokens on both sides) saved with its word-level tokenizer. A call
generates ``--max-completion-length`` tokens for ``--batch`` prompts of ``--min-prompt`` to ``--max-prompt`` random
token ids (left-padded on both sides; one jaxtune program per shape, compiled by the first call, untimed). Sampled:
temperature 1.0, no top-k or top-p. jaxtune: the whole generation is one compiled program (prefill, then a
``lax.while_loop`` sampling on device); transformers: ``model.generate`` with its KV cache (``use_cache``), sdpa
attention, ``torch.no_grad``. The LoRA rows use rank ``--lora`` on q k v o gate up down with random (nonzero) B, so
the adapters change the tokens. Timing: `_harness.interleave` (order rotated per round), medians; tokens/s counts
generated tokens.

    python benchmarks/generate_cpu.py                                         # 4 layers, d 256 (fast)
    python benchmarks/generate_cpu.py --layers 30 --d-model 576 --heads 9 --kv-heads 3 --d-ff 1536 \\
        --vocab 49152 --batch 16 --min-prompt 40 --max-prompt 120 --max-completion-length 32 --lora 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import _harness as h
import jax
import jaxlib
import numpy as np
import torch
import transformers
from grpo_cpu import LORA_MODULES, random_prompts, write_hf_model

from jaxtune import sharding
from jaxtune.backends import make_state_spec
from jaxtune.config import load_config
from jaxtune.models.sampling import Generator


def jaxtune_impls(model_dir: str, a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, dict]:
    """{name: {"call": (temperature) -> ids}}: the full model, and with --lora the adapters merged or not."""
    out = {}
    setups = [("jaxtune", [])] + ([("jaxtune LoRA", [f"model.lora.rank={a.lora}"])] if a.lora else []) \
        + ([("jaxtune scan_layers", ["model.scan_layers=true"])] if a.scan else [])
    for name, extra in setups:
        cfg = load_config(None, [f"model.from_hf={model_dir}", "data.format=prompts", "objective.name=grpo",
                                 "objective.rewards=[{name: length}]", *extra])
        spec = make_state_spec(cfg, None, sharding.make_mesh(1, 1, 1))
        params, frozen = spec.init(0).params, spec.load_frozen(0)
        if a.lora and name.startswith("jaxtune LoRA"):  # B != 0, so the adapters change the tokens
            rng = np.random.default_rng(0)
            params = jax.tree.map(lambda x, r=rng: x + 0.05 * r.standard_normal(x.shape).astype(x.dtype), params)
        weights = spec.weights(params, frozen)
        generators = {name: spec.generator()} if not name.startswith("jaxtune LoRA") else {
            f"{name} merged (its sampler)": spec.generator(),
            f"{name} unmerged": Generator(spec.graphdef, spec.model_cfg.max_seq_len)}
        if a.padded_prefill and name == "jaxtune":  # the same sampler, its prompts prefilled left-padded
            generators[f"{name} padded prefill"] = padded = spec.generator()
            (padded.plain or padded).pack = False
        for label, gen in generators.items():
            out[label] = {"call": lambda t, g=gen, w=weights: g(w, prompts, max_new_tokens=a.max_completion_length,
                                                                 temperature=t, seed=1).ids,
                          "compiles": lambda g=gen: g.compiles}
    return out


def transformers_impls(model_dir: str, a: argparse.Namespace, prompts: list[list[int]]) -> dict[str, dict]:
    """{name: {"call": (temperature) -> ids}}: ``generate`` of the model, and with --lora of PEFT's LoRA model."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    models = {"transformers": model.eval()}
    if a.lora:
        from peft import LoraConfig, get_peft_model

        lora = get_peft_model(transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                              LoraConfig(r=a.lora, lora_alpha=2 * a.lora, target_modules=LORA_MODULES))
        with torch.no_grad():
            for n, p in lora.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        models["transformers + PEFT LoRA"] = lora.eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as TRL's GRPOTrainer gives generate
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    def call(m, temperature):
        kw = {"do_sample": True, "temperature": temperature} if temperature else {"do_sample": False}
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=a.max_completion_length,
                             min_new_tokens=a.max_completion_length, pad_token_id=h.PAD, top_k=None, top_p=None, **kw)
        return out[:, width:].tolist()

    return {name: {"call": lambda t, m=m: call(m, t)} for name, m in models.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    h.add_round_args(ap, rounds=3)
    h.add_common_args(ap, batch=16, max_completion_length=64, min_prompt=16, max_prompt=32, layers=4, d_model=256,
                      heads=4, kv_heads=2, d_ff=688, vocab=2048)
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="also a LoRA model of this rank")
    ap.add_argument("--scan", action="store_true", help="also the model with model.scan_layers=true (its layers one "
                    "scanned block; the KV cache carried through the scan)")
    ap.add_argument("--padded-prefill", action="store_true", help="also jaxtune's sampler with its prompts "
                    "prefilled left-padded to their bucket, as before packed prefill (Generator.pack = False)")
    h.add_malloc_arg(ap)
    args = ap.parse_args(argv)
    h.check_rounds(ap, args)
    threads = h.start_trainers(args)
    prompts = random_prompts(np.random.RandomState(0), args, args.batch)
    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "model")
    n_params = write_hf_model(model_dir, args)

    impls = {}
    for name, im in {**jaxtune_impls(model_dir, args, prompts), **transformers_impls(model_dir, args, prompts)}.items():
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            impls[f"{name}, {mode}"] = {**im, "temperature": temperature,
                                         "fn": lambda _, c=im["call"], t=temperature: [c(t) for _ in range(args.steps)]}
    for im in impls.values():
        im["first"], im["first_s"] = h.first_call(lambda im=im: im["call"](im["temperature"]))
    run = h.interleave(impls, range(args.warmup + args.rounds), timed=lambda r: r >= args.warmup)
    tmp.cleanup()

    tokens = args.batch * args.max_completion_length
    rows = []
    for name, im in impls.items():
        generated = sum(len(r) for r in im["first"])
        if generated != tokens:
            print(f"warning: {name} generated {generated} tokens, not {tokens} (a row stopped early)")
        ms = statistics.median(im["times"]) / args.steps * 1e3
        rows.append({"implementation": name, "ms_per_call": ms, "tokens_per_s": tokens / ms * 1e3,
                     "ms_per_token": ms / args.max_completion_length, "first_call_s": im["first_s"],
                     "compiles": im["compiles"]() if "compiles" in im else None})
    greedy_same = impls["jaxtune, greedy"]["first"] == impls["transformers, greedy"]["first"]
    if args.scan and impls["jaxtune scan_layers, greedy"]["first"] != impls["jaxtune, greedy"]["first"]:
        print("warning: scan_layers' greedy tokens differ from the unrolled layers'")

    print(f"machine: {h.machine()}")
    print(f"versions: jax {jax.__version__}, jaxlib {jaxlib.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print("command: PYTHONPATH=src python " + " ".join(sys.argv if argv is None else [sys.argv[0], *argv]))
    print(f"Llama (random, fp32, EOS biased out): {args.layers} layers, hidden {args.d_model}, {args.heads} heads "
          f"({args.kv_heads} kv), intermediate {args.d_ff}, vocab {args.vocab}, {n_params / 1e6:.1f}M params; "
          f"{args.batch} prompts of {args.min_prompt}-{args.max_prompt} tokens, {args.max_completion_length} new "
          f"tokens each; threads {threads}; {args.rounds} timed rounds of {args.steps} call(s) "
          f"({run['seconds']:.0f} s), load {run['load_after'][0]:.2f}; jaxtune's greedy tokens "
          f"{'equal' if greedy_same else 'differ from'} transformers'")
    h.print_header(["implementation", "tokens/s", "ms per call", "ms per token (batch)", "first call (s)",
                    "jax programs"])
    for r in rows:
        print(f"| {r['implementation']} | {r['tokens_per_s']:,.0f} | {r['ms_per_call']:.0f} | "
              f"{r['ms_per_token']:.1f} | {r['first_call_s']:.1f} | "
              f"{r['compiles'] if r['compiles'] is not None else ''} |")
    by = {r["implementation"]: r for r in rows}
    for mode in ("greedy", "sampled"):
        j, t = by[f"jaxtune, {mode}"], by[f"transformers, {mode}"]
        print(f"{mode}: jaxtune / transformers tokens/s = {j['tokens_per_s'] / t['tokens_per_s']:.2f}x")
        if args.lora:
            m, u = by[f"jaxtune LoRA merged (its sampler), {mode}"], by[f"jaxtune LoRA unmerged, {mode}"]
            p = by[f"transformers + PEFT LoRA, {mode}"]
            print(f"{mode} LoRA: merged / unmerged = {m['tokens_per_s'] / u['tokens_per_s']:.2f}x; merged / PEFT = "
                  f"{m['tokens_per_s'] / p['tokens_per_s']:.2f}x")
        if args.padded_prefill:
            print(f"{mode}: packed / padded prefill tokens/s = "
                  f"{j['tokens_per_s'] / by[f'jaxtune padded prefill, {mode}']['tokens_per_s']:.2f}x")
        if args.scan:
            print(f"{mode}: scan_layers / unrolled tokens/s = "
                  f"{by[f'jaxtune scan_layers, {mode}']['tokens_per_s'] / j['tokens_per_s']:.2f}x")
    result = {"machine": h.machine(), "config": vars(args), "rows": rows, "greedy_equal": greedy_same}
    return h.save_json(args.json, result)


if __name__ == "__main__":
    main()
