"""The training loop's evaluations (`Evaluator`), every ``eval.every`` steps, before the first step and at the end:
held-out loss (with the objective's metrics), held-out exact match (`exact_match`), GRPO's held-out rewards, prompt
samples, written to metrics.jsonl, samples.jsonl and report.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, ConfigError
from jaxtune.data import Example, PromptRows, Tokenizer, format_sample, question, renders_chat, stop_ids
from jaxtune.data.progress import Progress
from jaxtune.generate import sample
from jaxtune.io import write_text_atomically
from jaxtune.train.metrics import EVALS_FILE, StepLog, perplexity, read_rows
from jaxtune.train.rollout import Rollout, prompt_text
from jaxtune.train.step import Steps

GRPO_SAMPLES = 4  # held-out completions shown with their rewards at each evaluation (GRPO)
REWARD_ACCURACY = "rewards/accuracies"  # TRL's name: the share of held-out pairs whose chosen reply is rewarded more
EMPTY_ANSWER = "(empty)"  # how a sample shows an answer that is empty or only whitespace


def exact_match(answers: list[str], references: list[str]) -> float:
    """The fraction of ``answers`` equal to their reference, both stripped of surrounding whitespace."""
    if len(answers) != len(references) or not answers:
        raise ValueError(f"exact_match: {len(answers)} answers for {len(references)} references")
    return sum(a.strip() == r.strip() for a, r in zip(answers, references)) / len(answers)


def shown(completion: str) -> str:
    """A generated answer as samples show it: `EMPTY_ANSWER` when there is nothing to see."""
    return completion if completion.strip() else EMPTY_ANSWER


@dataclass
class Evaluator:
    """The training loop's evaluations, every ``eval.every`` steps, before the first step and at the end: held-out
    loss (with the objective's metrics) on the fixed eval batches, held-out exact match (the first
    ``eval.exact_match`` held-out rows answered greedily, compared with their reference reply), and samples for
    ``eval.prompts``, written to metrics.jsonl, samples.jsonl and report.md."""

    cfg: Config
    steps: Steps
    tokenizer: Tokenizer
    batches: list[Any]
    run_dir: Path
    log: StepLog
    examples: list[Example] = field(default_factory=list)  # held-out rows (`TrainingData.eval_examples`)
    rollout: Rollout | None = None  # GRPO: samples and scores completions
    prompts: PromptRows | None = None  # GRPO: the held-out prompts
    evals: list[dict[str, Any]] = field(default_factory=list)  # {"step", "loss", "exact_match", "samples"} each
    start: int = 0  # the step this session resumed from: earlier evaluations are read back for report.md

    def __post_init__(self) -> None:
        # evaluations of the attempts before this one (up to the resumed step; later rows were dropped when the
        # run's logs were opened), so that report.md keeps one table from step 0
        self.history = read_rows(self.run_dir / EVALS_FILE) if self.start else []
        self.generator = self.steps.spec.generator()
        self.chat = renders_chat(self.cfg.data.format) and self.tokenizer.chat_template is not None
        wanted = self.cfg.eval.exact_match
        # GRPO: the first eval.exact_match held-out prompts, answered greedily and scored by the reward functions.
        self.scored = min(wanted, len(self.prompts)) if self.rollout is not None and self.prompts is not None else 0
        if wanted and self.rollout is not None:
            if not self.scored:
                raise ConfigError(f"eval.exact_match={wanted}: there are no held-out prompts to answer "
                                  "(data.val_fraction=0 without data.val_sources); set eval.exact_match=0 or hold "
                                  "prompts out")
        elif wanted and not self.examples:
            raise ConfigError(f"eval.exact_match={wanted}: there are no held-out rows to answer (pretraining text, or "
                              "data.val_fraction=0 without data.val_sources, or every held-out row was truncated); "
                              "set eval.exact_match=0 or hold rows out")
        # (prompt ids, reference reply) for each scored row; the prompts are fixed, so the sampler compiles once.
        self.questions = [question(self.tokenizer, ex) for ex in self.examples[:wanted]]

    @property
    def active(self) -> bool:
        return bool(self.batches or self.questions or self.scored or self.cfg.eval.prompts)

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and step % every == 0 and step < self.cfg.train.steps

    def parts(self) -> dict[str, str]:
        """What an evaluation does, in order (what its progress bar counts): {part: what it says}."""
        return {part: what for part, what, due in (
            ("loss", f"held-out loss of {len(self.batches)} batches", self.batches),
            ("questions", f"answering {len(self.questions)} held-out rows", self.questions),
            ("scored", f"answering and scoring {self.scored} held-out prompts", self.scored),
            ("samples", f"sampling {len(self.cfg.eval.prompts)} eval.prompts", self.cfg.eval.prompts)) if due}

    def run(self, step: int, params: Any, frozen: tuple, bar: bool = False) -> None:
        """One evaluation at ``step``; ``bar``: its parts advance a progress bar (the first evaluation, which
        compiles each part's programs)."""
        e = self.cfg.eval
        record: dict[str, Any] = {"step": step, "loss": None, "exact_match": None, "samples": []}
        scalars: dict[str, float] = {}
        said = []
        parts = self.parts()
        progress = Progress(f"step {step}: evaluating" + (" the starting model (the baseline report.md compares "
                                                           "against)" if step == 0 else ""), len(parts), "", unit="parts") \
            if bar and parts and jax.process_index() == 0 else None

        def begin(part: str) -> None:
            if progress is not None:
                progress.update(list(parts).index(part), parts[part] + " ...")

        if self.batches:
            begin("loss")
            result = self.steps.evaluate(params, frozen, self.batches)
            record["loss"] = loss = result.loss
            if self.cfg.data.kind.held_out == "pairs":  # preference objectives: held-out pairs ranked right
                record["reward_accuracy"] = result.metrics[REWARD_ACCURACY]
                scalars = {"loss": loss, **result.metrics}
                said.append(f"validation loss {loss:.4f}, reward accuracy {record['reward_accuracy']:.1%}, margin "
                            f"{result.metrics['rewards/margins']:.3f}")
            elif self.cfg.data.kind.held_out == "rewards":  # unpaired rows (KTO): the two labels' mean rewards apart
                m = result.metrics
                record["reward_margin"] = m["rewards/chosen"] - m["rewards/rejected"]
                scalars = {"loss": loss, **m, "rewards/margins": record["reward_margin"]}
                said.append(f"validation loss {loss:.4f}, rewards desirable {m['rewards/chosen']:.3f}, undesirable "
                            f"{m['rewards/rejected']:.3f} (margin {record['reward_margin']:.3f}), kl {m['kl']:.3f}")
            else:
                scalars = {"loss": loss, "perplexity": perplexity(loss), **result.metrics}
                said.append(f"validation loss {loss:.4f}, perplexity {perplexity(loss):.2f}")
        if self.questions:
            begin("questions")
            answers = self.generator(self.steps.weights(params, frozen), [ids for ids, _ in self.questions],
                                     max_new_tokens=e.max_new_tokens, temperature=0.0,
                                     eos_id=stop_ids(self.tokenizer, self.chat), seed=step)
            record["exact_match"] = scalars["exact_match"] = exact_match(
                [self.tokenizer.decode(a) for a in answers], [reference for _, reference in self.questions])
            said.append(f"held-out exact match {_score(record['exact_match'], len(self.questions))}")
        if self.scored:
            begin("scored")
            said.append(self._score_prompts(step, params, frozen, record, scalars))
        if e.prompts:
            begin("samples")
            record["samples"] = self._samples(step, params, frozen)
        if progress is not None:
            progress.done = len(parts)
            progress.close()
        if scalars:
            self.log.writer.write(step, scalars, kind="eval")
            self.log.message(f"step {step}: " + ", ".join(said))
        if record["samples"]:
            if jax.process_index() == 0:
                with open(self.run_dir / "samples.jsonl", "a") as f:
                    f.writelines(json.dumps({"step": step, "text": text}) + "\n" for text in record["samples"])
            for text in record["samples"]:
                self.log.message(f"--- sample @ step {step} ---\n{text}")
        self.evals.append(record)
        if jax.process_index() == 0:
            with open(self.run_dir / EVALS_FILE, "a") as f:
                f.write(json.dumps(record, default=float) + "\n")

    def _samples(self, step: int, params: Any, frozen: tuple) -> list[str]:
        """``eval.prompts`` answered by sampling, each formatted with its prompt."""
        e = self.cfg.eval
        ids = sample(self.generator, self.steps.weights(params, frozen), self.tokenizer, e.prompts, chat=self.chat,
                     max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k, top_p=e.top_p,
                     seed=step)
        return [format_sample(p, shown(self.tokenizer.decode(x)), self.chat) for p, x in zip(e.prompts, ids)]

    def _score_prompts(self, step: int, params: Any, frozen: tuple, record: dict[str, Any],
                       scalars: dict[str, float]) -> str:
        """GRPO: the held-out prompts answered greedily and scored: ``accuracy`` (the share the first answer-checking
        reward scores 1) and the mean total ``reward``; the first few completions with their rewards go to
        samples.jsonl and report.md."""
        rollout = self.rollout
        done, held_out = rollout.held_out(self.steps.weights(params, frozen), self.prompts, self.scored, step)
        scores = done.scores
        scalars.update(held_out)
        record.update(held_out)
        said = f"held-out reward {record['reward']:.3f}"
        if "accuracy" in held_out:
            said = f"held-out accuracy {_score(record['accuracy'], self.scored)}, " + said
        shown_rows = []
        for i in range(min(GRPO_SAMPLES, self.scored)):
            rewards = {label: round(float(scores.per_function[i, k]), 4) for k, label in enumerate(rollout.rewards.labels)}
            prompt = self.prompts.prompt(i)
            text = format_sample(prompt_text(prompt), shown(done.texts[i]), not isinstance(prompt, str))
            shown_rows.append({"text": text, "rewards": rewards})
        record["completions"] = shown_rows
        if jax.process_index() == 0:
            with open(self.run_dir / "samples.jsonl", "a") as f:
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in shown_rows)
        return said

    @property
    def last_loss(self) -> float | None:
        return next((e["loss"] for e in reversed(self.evals) if e["loss"] is not None), None)

    @property
    def samples(self) -> list[str]:
        return next((e["samples"] for e in reversed(self.evals) if e["samples"]), [])

    def _report_rewards(self, first: dict[str, Any], last: dict[str, Any]) -> list[str]:
        """GRPO's part of report.md: held-out accuracy and reward at every evaluation, before and after, and the first
        held-out completions with their rewards, before and after."""
        rows = [e for e in self.history + self.evals if "reward" in e]
        if not rows:
            return []
        n, accuracy = self.scored, "accuracy" in rows[0]
        lines = ["| step |" + (" held-out accuracy |" if accuracy else "") + " held-out reward |",
                 "|--:|" + ("--:|" if accuracy else "") + "--:|"]
        lines += [f"| {e['step']} |" + (f" {_score(e['accuracy'], n)} |" if accuracy else "") + f" {e['reward']:.3f} |"
                  for e in rows]
        lines.append("")
        if accuracy and first is not last and "accuracy" in first:
            lines += [(f"Held-out accuracy ({n} held-out prompts answered greedily, scored by the first answer-checking "
                       f"reward): {_score(first['accuracy'], n)} before (step {first['step']}), "
                       f"{_score(last['accuracy'], n)} after (step {last['step']})."), ""]
        for k, after in enumerate(last.get("completions", [])):
            lines.append(f"## Held-out prompt {k + 1}")
            before = first.get("completions", []) if first is not last else []
            for when, row in ((first, before[k] if k < len(before) else None), (last, after)):
                if row is not None:
                    head = (f"**{'Before' if when is first else 'After'} (step {when['step']}), rewards "
                            f"{json.dumps(row['rewards'])}:**")
                    lines += [head, "", "```", row["text"], "```", ""]
        return lines

    def write_report(self) -> None:
        """report.md: held-out loss and exact match at every evaluation since step 0 (a resumed run's earlier ones
        read back from evals.jsonl), exact match before and after, and the samples of the first and last evaluation
        side by side. Rewritten whole each time."""
        if not self.evals:
            return
        path = self.run_dir / "report.md"
        lines = ["# Run report", ""]
        n = len(self.questions)
        every = self.history + self.evals
        scored = [e for e in every if e["loss"] is not None or e["exact_match"] is not None]
        if scored:
            # Preference objectives: the share of held-out pairs whose chosen reply is rewarded more (their loss is
            # not a log-likelihood: no perplexity).
            rewards = any("reward_accuracy" in e for e in scored)
            margins = any("reward_margin" in e for e in scored)
            second = " reward accuracy |" if rewards else " reward margin |" if margins else " perplexity |"
            lines += ["| step | held-out loss |" + second + (" exact match |" if n else ""),
                      "|--:|--:|--:|" + ("--:|" if n else "")]
            for e in scored:
                loss = "" if e["loss"] is None else (
                    f" {e['loss']:.4f} | {e['reward_accuracy']:.1%} |" if rewards
                    else f" {e['loss']:.4f} | {e['reward_margin']:.3f} |" if margins
                    else f" {e['loss']:.4f} | {perplexity(e['loss']):.2f} |")
                lines.append(f"| {e['step']} |" + (loss or " | |") + (f" {_score(e['exact_match'], n)} |" if n else ""))
            lines.append("")
        first, last = every[0], every[-1]
        lines += self._report_rewards(first, last)
        if n and first is not last:
            lines += [(f"Held-out exact match ({n} held-out rows answered greedily, reply compared with the reference): "
                       f"{_score(first['exact_match'], n)} before (step {first['step']}), "
                       f"{_score(last['exact_match'], n)} after (step {last['step']})."), ""]
        for k, after in enumerate(last["samples"]):
            lines.append(f"## Prompt {k + 1}")
            if first is not last and k < len(first["samples"]):
                lines += [f"**Before (step {first['step']}):**", "", "```", first["samples"][k], "```", ""]
            lines += [f"**After (step {last['step']}):**", "", "```", after, "```", ""]
        write_text_atomically(path, "\n".join(lines) + "\n")


def _score(fraction: float, count: int) -> str:
    return f"{fraction:.1%} ({round(fraction * count)}/{count})"
