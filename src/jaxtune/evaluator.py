"""The training loop's evaluations (`Evaluator`), every ``eval.every`` steps, before the first step and at the end,
written to metrics.jsonl, samples.jsonl, evals.jsonl and report.md.

An evaluation is a list of parts, each owning what it computes and its rows in report.md: the data kind's held-out
part, chosen once from `BatchKind.held_out` (`HeldOutLoss` with perplexity, `HeldOutPairs` and `HeldOutRewards`
against the reference, `HeldOutAnswers` scored by the reward functions), `ExactMatch` (held-out rows answered
greedily) and `Samples` (``eval.prompts``). Each part returns an `Outcome`; the `Evaluator` merges them into one
record, and `report_lines` asks each part for its columns and sections."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax

from jaxtune.config import Config, ConfigError, EvalConfig
from jaxtune.data import Example, PromptRows, Tokenizer, format_sample, question, renders_chat, stop_ids
from jaxtune.data.progress import Progress
from jaxtune.generate import sample
from jaxtune.io import write_text_atomically
from jaxtune.rollout.rollout import Rollout, prompt_text
from jaxtune.train.metrics import EVALS_FILE, StepLog, perplexity, read_rows
from jaxtune.train.step import Steps

GRPO_SAMPLES = 4  # held-out completions shown with their rewards at each evaluation (GRPO)
HELD_OUT_REWARD = "reward"  # the mean total reward of held-out completions (the sampling objectives' evaluation)
REWARD_ACCURACY = "rewards/accuracies"  # TRL's name: the share of held-out pairs whose chosen reply is rewarded more
EMPTY_ANSWER = "(empty)"  # how a sample shows an answer that is empty or only whitespace
NO_ROWS = "n/a (no rows)"  # a mean over held-out rows of a label the held-out batches do not hold


def exact_match(answers: list[str], references: list[str]) -> float:
    """The fraction of ``answers`` equal to their reference, both stripped of surrounding whitespace."""
    if len(answers) != len(references) or not answers:
        raise ValueError(f"exact_match: {len(answers)} answers for {len(references)} references")
    return sum(a.strip() == r.strip() for a, r in zip(answers, references)) / len(answers)


def shown(completion: str) -> str:
    """A generated answer as samples show it: `EMPTY_ANSWER` when there is nothing to see."""
    return completion if completion.strip() else EMPTY_ANSWER


@dataclass(frozen=True)
class Outcome:
    """What one part of an evaluation found: fields of the evaluation's record (evals.jsonl), scalars for
    metrics.jsonl, what the log line says, rows for samples.jsonl (without the step) and lines to log after it."""

    record: dict[str, Any]
    scalars: dict[str, float] = field(default_factory=dict)
    said: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


class Part:
    """One part of an evaluation and its rows in report.md. ``what``: what it does (its progress bar's line), empty
    where it has nothing to do. ``header`` and ``rule``: its columns of report.md's score table, if any; ``has(e)``:
    the evaluation record ``e`` has a score for them, ``cells(e)``: the row's cells. ``section``: its own lines,
    after the table, from the first and last evaluations and every one since step 0."""

    header = ""
    rule = ""

    @property
    def what(self) -> str:
        return ""

    def run(self, step: int, params: Any, frozen: Any) -> Outcome:
        raise NotImplementedError

    def has(self, e: dict[str, Any]) -> bool:
        return False

    def cells(self, e: dict[str, Any]) -> str:
        return ""

    def section(self, first: dict[str, Any], last: dict[str, Any], every: list[dict[str, Any]]) -> list[str]:
        return []


@dataclass
class HeldOutLoss(Part):
    """``held_out: loss``: the objective's loss on the fixed held-out batches, and its perplexity."""

    steps: Steps
    batches: list[Any]
    header = " held-out loss | perplexity |"
    rule = "--:|--:|"

    @property
    def what(self) -> str:
        return f"held-out loss of {len(self.batches)} batches" if self.batches else ""

    def run(self, step: int, params: Any, frozen: Any) -> Outcome:
        result = self.steps.evaluate(params, frozen, self.batches)
        return self.outcome(result.loss, result.metrics)

    def outcome(self, loss: float, metrics: dict[str, float]) -> Outcome:
        return Outcome({"loss": loss}, {"loss": loss, "perplexity": perplexity(loss), **metrics},
                       f"validation loss {loss:.4f}, perplexity {perplexity(loss):.2f}")

    def has(self, e: dict[str, Any]) -> bool:
        return e["loss"] is not None

    def cells(self, e: dict[str, Any]) -> str:
        return f" {e['loss']:.4f} | {self.second(e)} |" if self.has(e) else " | |"

    def second(self, e: dict[str, Any]) -> str:
        """The column beside the loss."""
        return f"{perplexity(e['loss']):.2f}"


@dataclass
class HeldOutPairs(HeldOutLoss):
    """``held_out: pairs`` (preference objectives): the loss and the share of held-out pairs whose chosen reply is
    rewarded more than the reference's; the loss is not a log-likelihood, so there is no perplexity."""

    header = " held-out loss | reward accuracy |"

    def outcome(self, loss: float, metrics: dict[str, float]) -> Outcome:
        # a policy's implicit rewards (DPO's names), or a reward model's own scores (RewardTrainer's)
        accuracy = metrics[REWARD_ACCURACY] if REWARD_ACCURACY in metrics else metrics["accuracy"]
        margin = metrics["rewards/margins"] if "rewards/margins" in metrics else metrics["margin"]
        return Outcome({"loss": loss, "reward_accuracy": accuracy}, {"loss": loss, **metrics},
                       f"validation loss {loss:.4f}, reward accuracy {accuracy:.1%}, margin {margin:.3f}")

    def second(self, e: dict[str, Any]) -> str:
        return f"{e['reward_accuracy']:.1%}"


@dataclass
class HeldOutRewards(HeldOutLoss):
    """``held_out: rewards`` (unpaired rows, KTO): the loss and how far apart the two labels' mean rewards are. A
    label without held-out rows has no mean reward, and then there is no margin: said so, never a 0."""

    header = " held-out loss | reward margin |"

    def outcome(self, loss: float, metrics: dict[str, float]) -> Outcome:
        m, margin = metrics, metrics.get("rewards/margins")
        rewards = ", ".join(f"{label} {_mean(m, f'rewards/{side}')}"
                            for label, side in (("desirable", "chosen"), ("undesirable", "rejected")))
        said = f"validation loss {loss:.4f}, rewards {rewards}" + ("" if margin is None else f", margin {margin:.3f}")
        return Outcome({"loss": loss, "reward_margin": margin}, {"loss": loss, **m},
                       said + (f", kl {m['kl']:.3f}" if "kl" in m else ""))

    def second(self, e: dict[str, Any]) -> str:
        return NO_ROWS if e.get("reward_margin") is None else f"{e['reward_margin']:.3f}"


LOSS_PARTS: dict[str, type[HeldOutLoss]] = {"loss": HeldOutLoss, "pairs": HeldOutPairs, "rewards": HeldOutRewards}


@dataclass
class HeldOutAnswers(Part):
    """``held_out: answers`` (GRPO and the objectives that sample): the first ``eval.exact_match`` held-out prompts
    answered greedily and scored: ``accuracy`` (the share the answer-checking reward scores 1) and the mean total
    ``reward``; the first few completions with their rewards go to samples.jsonl and report.md."""

    steps: Steps
    rollout: Rollout
    prompts: PromptRows | None
    wanted: int  # eval.exact_match

    def __post_init__(self) -> None:
        self.scored = min(self.wanted, len(self.prompts)) if self.prompts is not None else 0
        if self.wanted and not self.scored:
            raise ConfigError(f"eval.exact_match={self.wanted}: there are no held-out prompts to answer "
                              "(data.val_fraction=0 without data.val_sources); set eval.exact_match=0 or hold "
                              "prompts out")

    @property
    def what(self) -> str:
        return f"answering and scoring {self.scored} held-out prompts" if self.scored else ""

    def run(self, step: int, params: Any, frozen: Any) -> Outcome:
        done, held_out = self.rollout.held_out(self.steps.weights(params, frozen), self.prompts, self.scored, step)
        said = f"held-out reward {held_out['reward']:.3f}"
        if "accuracy" in held_out:
            said = f"held-out accuracy {_score(held_out['accuracy'], self.scored)}, " + said
        labels = self.rollout.rewards.labels
        rows = []
        for i in range(min(GRPO_SAMPLES, self.scored)):
            rewards = {label: round(float(done.scores.per_function[i, k]), 4) for k, label in enumerate(labels)}
            prompt = self.prompts.prompt(i)
            text = format_sample(prompt_text(prompt), shown(done.texts[i]), not isinstance(prompt, str))
            rows.append({"text": text, "rewards": rewards})
        return Outcome({**held_out, "completions": rows}, held_out, said, samples=rows)

    def section(self, first: dict[str, Any], last: dict[str, Any], every: list[dict[str, Any]]) -> list[str]:
        """Held-out accuracy and reward at every evaluation, before and after, and the first held-out completions
        with their rewards, before and after."""
        rows = [e for e in every if HELD_OUT_REWARD in e]
        if not rows:
            return []
        n, accuracy = self.scored, "accuracy" in rows[0]
        lines = ["| step |" + (" held-out accuracy |" if accuracy else "") + " held-out reward |",
                 "|--:|" + ("--:|" if accuracy else "") + "--:|"]
        lines += [f"| {e['step']} |" + (f" {_score(e['accuracy'], n)} |" if accuracy else "") + f" {e['reward']:.3f} |"
                  for e in rows]
        lines.append("")
        if accuracy and first is not last and "accuracy" in first:
            lines += [(f"Held-out accuracy ({n} held-out prompts answered greedily, scored by the first "
                       f"answer-checking reward): {_score(first['accuracy'], n)} before (step {first['step']}), "
                       f"{_score(last['accuracy'], n)} after (step {last['step']})."), ""]
        before = first.get("completions", []) if first is not last else []
        for k, after in enumerate(last.get("completions", [])):
            lines.append(f"## Held-out prompt {k + 1}")
            for when, row in ((first, before[k] if k < len(before) else None), (last, after)):
                if row is not None:
                    head = (f"**{'Before' if when is first else 'After'} (step {when['step']}), rewards "
                            f"{json.dumps(row['rewards'])}:**")
                    lines += [head, "", "```", row["text"], "```", ""]
        return lines


@dataclass
class Sampler:
    """What the parts that generate share: one generator (so each program compiles once), the tokenizer, and whether
    prompts are chat turns."""

    steps: Steps
    tokenizer: Tokenizer
    chat: bool

    @functools.cached_property
    def generator(self) -> Any:
        """Made at its first use: a run that never generates (no ``eval.prompts``, no exact match) does not build the
        sampling model's layout (~2 s of setup at 135M)."""
        return self.steps.spec.generator()


@dataclass
class ExactMatch(Part):
    """The first ``eval.exact_match`` held-out rows answered greedily, each compared with its reference reply."""

    sampler: Sampler
    questions: list[tuple[Any, str]]  # (prompt ids, reference reply); the prompts are fixed: the sampler compiles once
    max_new_tokens: int
    header = " exact match |"
    rule = "--:|"

    @property
    def what(self) -> str:
        return f"answering {len(self.questions)} held-out rows"

    def run(self, step: int, params: Any, frozen: Any) -> Outcome:
        s = self.sampler
        answers = s.generator(s.steps.weights(params, frozen), [ids for ids, _ in self.questions],
                              max_new_tokens=self.max_new_tokens, temperature=0.0,
                              eos_id=stop_ids(s.tokenizer, s.chat), seed=step).ids
        score = exact_match([s.tokenizer.decode(a) for a in answers], [reference for _, reference in self.questions])
        return Outcome({"exact_match": score}, {"exact_match": score},
                       f"held-out exact match {_score(score, len(self.questions))}")

    def has(self, e: dict[str, Any]) -> bool:
        return e["exact_match"] is not None

    def cells(self, e: dict[str, Any]) -> str:
        return f" {_score(e['exact_match'], len(self.questions))} |"

    def section(self, first: dict[str, Any], last: dict[str, Any], every: list[dict[str, Any]]) -> list[str]:
        if first is last:
            return []
        n = len(self.questions)
        return [(f"Held-out exact match ({n} held-out rows answered greedily, reply compared with the reference): "
                 f"{_score(first['exact_match'], n)} before (step {first['step']}), "
                 f"{_score(last['exact_match'], n)} after (step {last['step']})."), ""]


@dataclass
class Samples(Part):
    """``eval.prompts`` answered by sampling, each formatted with its prompt; report.md shows the first and last
    evaluation's side by side."""

    sampler: Sampler
    cfg: EvalConfig

    @property
    def what(self) -> str:
        return f"sampling {len(self.cfg.prompts)} eval.prompts" if self.cfg.prompts else ""

    def run(self, step: int, params: Any, frozen: Any) -> Outcome:
        s, e = self.sampler, self.cfg
        ids = sample(s.generator, s.steps.weights(params, frozen), s.tokenizer, e.prompts, chat=s.chat,
                     max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_k=e.top_k, top_p=e.top_p,
                     seed=step)
        texts = [format_sample(p, shown(s.tokenizer.decode(x)), s.chat) for p, x in zip(e.prompts, ids)]
        return Outcome({"samples": texts}, samples=[{"text": text} for text in texts],
                       messages=[f"--- sample @ step {step} ---\n{text}" for text in texts])

    def section(self, first: dict[str, Any], last: dict[str, Any], every: list[dict[str, Any]]) -> list[str]:
        lines = []
        for k, after in enumerate(last["samples"]):
            lines.append(f"## Prompt {k + 1}")
            if first is not last and k < len(first["samples"]):
                lines += [f"**Before (step {first['step']}):**", "", "```", first["samples"][k], "```", ""]
            lines += [f"**After (step {last['step']}):**", "", "```", after, "```", ""]
        return lines


def report_lines(parts: list[Part], every: list[dict[str, Any]]) -> list[str]:
    """report.md: a table of the held-out scores at every evaluation since step 0 (a column group per part that has
    one, a row per evaluation that scored), then each part's own section."""
    lines = ["# Run report", ""]
    columns = [p for p in parts if p.header]
    scored = [e for e in every if any(p.has(e) for p in columns)]
    if scored:
        lines += ["| step |" + "".join(p.header for p in columns), "|--:|" + "".join(p.rule for p in columns)]
        lines += [f"| {e['step']} |" + "".join(p.cells(e) for p in columns) for e in scored]
        lines.append("")
    for part in parts:
        lines += part.section(every[0], every[-1], every)
    return lines


@dataclass
class Evaluator:
    """The training loop's evaluations, every ``eval.every`` steps, before the first step and at the end: the data
    kind's held-out part (loss on the fixed eval batches, or GRPO's prompts answered and scored), held-out exact
    match (the first ``eval.exact_match`` held-out rows answered greedily, compared with their reference reply), and
    samples for ``eval.prompts``, written to metrics.jsonl, samples.jsonl, evals.jsonl and report.md."""

    cfg: Config
    steps: Steps
    tokenizer: Tokenizer
    batches: list[Any]
    run_dir: Path
    log: StepLog
    examples: list[Example] = field(default_factory=list)  # held-out rows (`TrainingData.eval_examples`)
    rollout: Rollout | None = None  # GRPO: samples and scores completions
    prompts: PromptRows | None = None  # GRPO: the held-out prompts
    evals: list[dict[str, Any]] = field(default_factory=list)  # this session's evaluation records, in order
    start: int = 0  # the step this session resumed from: earlier evaluations are read back for report.md

    def __post_init__(self) -> None:
        # evaluations of the attempts before this one (up to the resumed step; later rows were dropped when the
        # run's logs were opened), so that report.md keeps one table from step 0
        self.history = read_rows(self.run_dir / EVALS_FILE) if self.start else []
        self.parts = self._parts()

    def _parts(self) -> list[Part]:
        """The data kind's held-out part (chosen once, from `BatchKind.held_out`), exact match, samples."""
        e, held_out = self.cfg.eval, self.cfg.data.kind.held_out
        chat = renders_chat(self.cfg.data.format) and self.tokenizer.chat_template is not None
        sampler = Sampler(self.steps, self.tokenizer, chat)
        samples = Samples(sampler, e)
        if held_out == "answers":  # eval.exact_match counts the held-out prompts answered and scored
            return [HeldOutAnswers(self.steps, self.rollout, self.prompts, e.exact_match), samples]
        if e.exact_match and not self.examples:
            raise ConfigError(f"eval.exact_match={e.exact_match}: there are no held-out rows to answer (pretraining "
                              "text, or data.val_fraction=0 without data.val_sources, or every held-out row was "
                              "truncated); set eval.exact_match=0 or hold rows out")
        questions = [question(self.tokenizer, ex) for ex in self.examples[:e.exact_match]]
        exact = [ExactMatch(sampler, questions, e.max_new_tokens)] if questions else []
        return [LOSS_PARTS[held_out](self.steps, self.batches), *exact, samples]

    @property
    def active(self) -> bool:
        return any(part.what for part in self.parts)

    def due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and step % every == 0 and step < self.cfg.train.steps

    def run(self, step: int, params: Any, frozen: Any, bar: bool = False) -> dict[str, Any]:
        """One evaluation at ``step``, its record returned; ``bar``: its parts advance a progress bar (the first
        evaluation, which compiles each part's programs)."""
        parts = [part for part in self.parts if part.what]
        baseline = " the starting model (the baseline report.md compares against)" if step == 0 else ""
        progress = Progress(f"step {step}: evaluating{baseline}", len(parts), "", unit="parts") \
            if bar and parts and jax.process_index() == 0 else None
        outcomes = []
        for i, part in enumerate(parts):
            if progress is not None:
                progress.update(i, part.what + " ...")
            outcomes.append(part.run(step, params, frozen))
        if progress is not None:
            progress.done = len(parts)
            progress.close()
        return self._record(step, outcomes)

    def _record(self, step: int, outcomes: list[Outcome]) -> dict[str, Any]:
        """The evaluation's record from its parts' outcomes, written to metrics.jsonl, samples.jsonl, evals.jsonl
        and the log."""
        record: dict[str, Any] = {"step": step, "loss": None, "exact_match": None, "samples": []}
        scalars: dict[str, float] = {}
        for outcome in outcomes:
            record |= outcome.record
            scalars |= outcome.scalars
        if scalars:
            self.log.writer.write(step, scalars, kind="eval")
            self.log.message(f"step {step}: " + ", ".join(o.said for o in outcomes if o.said))
        shown_rows = [{"step": step, **row} for o in outcomes for row in o.samples]
        if shown_rows and jax.process_index() == 0:
            with open(self.run_dir / "samples.jsonl", "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in shown_rows)
        for message in (m for o in outcomes for m in o.messages):
            self.log.message(message)
        self.evals.append(record)
        if jax.process_index() == 0:
            with open(self.run_dir / EVALS_FILE, "a") as f:
                f.write(json.dumps(record, default=float) + "\n")
        return record

    @property
    def last_loss(self) -> float | None:
        return next((e["loss"] for e in reversed(self.evals) if e["loss"] is not None), None)

    @property
    def samples(self) -> list[str]:
        return next((e["samples"] for e in reversed(self.evals) if e["samples"]), [])

    def write_report(self) -> None:
        """report.md, rewritten whole from every evaluation since step 0 (a resumed run's earlier ones read back
        from evals.jsonl)."""
        if self.evals:
            write_text_atomically(self.run_dir / "report.md",
                                  "\n".join(report_lines(self.parts, self.history + self.evals)) + "\n")


def _mean(metrics: dict[str, float], name: str) -> str:
    """Metric ``name`` as a log line shows it; `NO_ROWS` where it is a mean of nothing."""
    return f"{metrics[name]:.3f}" if name in metrics else NO_ROWS


def _score(fraction: float, count: int) -> str:
    return f"{fraction:.1%} ({round(fraction * count)}/{count})"
