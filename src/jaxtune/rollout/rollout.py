"""GRPO's rollouts: completions sampled by the run's own generator inside the loop, scored by the reward functions,
and laid out as the batch the ``grpo`` objective trains on.

Each step takes ``objective.prompts_per_step`` prompts (`jaxtune.data.PromptRows` items; the run's
``train.batch_size``) and samples ``num_generations`` completions of each, at most ``max_completion_length`` tokens,
with the policy's current weights (``temperature``, ``top_p``, ``top_k``). The sampler is the backend's
(`ModelSpec.generator`: the native KV-cache generator), one compiled program per shape bucket, reused every step
after. Its random key is a function of ``train.seed`` and the step alone, so a resumed run samples exactly what the
uninterrupted one did.

With several processes each holds its share of the step's prompts. The completions of all of them are sampled in
one SPMD generation over the whole mesh (the weights sharded as in training; the tokens those of one process
sampling the whole batch), each process scores its own prompts' completions with the reward functions on its host,
the scores are shared (`every_process`) so advantages and metrics are the whole batch's, and each process trains on
its own rows, which the step assembles into the global batch. A reward error on one process is raised on every
process (`first_failure`), so none is left waiting.

A completion ends at the first stop id (EOS, and for chat prompts the template's end-of-turn token), which it keeps
and is trained on, or at ``max_completion_length`` tokens. Its text (without the stop id) is what reward functions
read. With ``data.share_prompts`` (the default with native models) a prompt's group is one row in regions: the
prompt's slots once, then each completion in ``max_completion_length`` slots of its own (`shared_rows`), attended
per region (`jaxtune.models.layers.RegionMask`), and ``advantages`` are (prompts, ``num_generations``), each
completion's as its objective computes them from every process's rewards (its ``advantages``,
`jaxtune.train.objectives.advantages`). With ``data.share_prompts: false`` the rows are
prompt then completion, one per completion, right-padded to ``data.seq_len``, the loss mask on the completion.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxtune.config import Config
from jaxtune.config.kinds import BRANCH_KEY, SAMPLER_LOGPS_KEY
from jaxtune.data import DataError, PromptRows, Tokenizer, stop_ids
from jaxtune.data.encoded import shared_row
from jaxtune.job.distributed import every_process, first_failure
from jaxtune.models.sampling import Generation
from jaxtune.rollout.agent import Agent, Extend, Trajectories, on_cache, prefilled_again, shared_ragged
from jaxtune.rollout.rewards import ModelScores, RewardError, Rewards, Scores, make_rewards
from jaxtune.rollout.tools import ToolError
from jaxtune.train.objectives import OBJECTIVES
from jaxtune.train.objectives.advantages import Rewarded, informative_groups, nanstd
from jaxtune.train.state import Sampler


def prompt_text(prompt: str | list[dict[str, Any]]) -> str:
    """A prompt as samples show it: its text, or a conversation's last (user) message."""
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step``: a function of the run's seed and the step only (resumes sample the same)."""
    return (seed * 1_000_003 + step * 7_919 + 1) % (1 << 31)


PromptBatch = dict[str, np.ndarray]  # a batch of prompt items: "row", each prompt's row in its source


def resample_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of ``step``'s extra round ``round_`` ≥ 1 (dynamic sampling), apart from every step's own."""
    return int.from_bytes(hashlib.sha256(f"jaxtune-resample:{seed}:{step}:{round_}".encode()).digest()[:4], "little") \
        % (1 << 31)


@dataclass
class Completions:
    """Sampled completions of a batch of prompts, ``group`` per prompt, contiguous, scored."""

    prompt_ids: list[list[int]]  # per completion: its prompt's ids
    ids: list[list[int]]  # per completion: the new ids, the stop id last if it stopped
    texts: list[str]  # per completion: its text, the stop id left out
    rows: list[int]  # per completion: its prompt's row in the source
    scores: Scores
    stopped: np.ndarray  # (N,) bool: ended with a stop id (else cut at max_completion_length)
    logps: list[list[float]]  # per completion: each new id's log-prob under the distribution it was drawn from
    # multi-turn rollouts (`jaxtune.rollout.agent`): per completion, 1 on the model's tokens, 0 on the tools'
    tool_mask: list[list[int]] | None = None
    tool_calls: tuple[int, int, int] = (0, 0, 0)  # (calls made, failed, unreadable turns), every process's

    @property
    def lengths(self) -> np.ndarray:
        """Each completion's tokens, the model's own only (TRL counts no tool-result token)."""
        if self.tool_mask is not None:
            return np.array([sum(m) for m in self.tool_mask], np.int32)
        return np.array([len(c) for c in self.ids], np.int32)

    def subset(self, at: list[int] | slice, scores: Scores | None = None) -> Completions:
        """The completions ``at`` (indices or a slice), with ``scores`` (default: theirs)."""
        pick = (lambda xs: xs[at]) if isinstance(at, slice) else (lambda xs: [xs[i] for i in at])
        if scores is None:
            s = self.scores
            scores = Scores(per_function=s.per_function[at], total=s.total[at], errors=s.errors, logged=s.logged)
        return Completions(pick(self.prompt_ids), pick(self.ids), pick(self.texts), pick(self.rows), scores,
                           self.stopped[at], pick(self.logps), None if self.tool_mask is None
                           else pick(self.tool_mask), self.tool_calls)

    def groups(self, picked: list[int], group: int) -> Completions:
        """The completions of the groups ``picked`` (indices of ``group``-sized groups), in that order."""
        return self.subset([g * group + k for g in picked for k in range(group)])

    @staticmethod
    def joined(parts: list[Completions]) -> Completions:
        """The completions of ``parts`` one after the other (their reward errors added, the last logged metrics)."""
        errors: dict[str, int] = {}
        for part in parts:
            for k, n in part.scores.errors.items():
                errors[k] = errors.get(k, 0) + n
        scores = Scores(per_function=np.concatenate([p.scores.per_function for p in parts]),
                        total=np.concatenate([p.scores.total for p in parts]), errors=errors,
                        logged=parts[-1].scores.logged)
        cat = lambda name: [x for p in parts for x in getattr(p, name)]
        masked = parts[0].tool_mask is not None
        return Completions(cat("prompt_ids"), cat("ids"), cat("texts"), cat("rows"), scores,
                           np.concatenate([p.stopped for p in parts]), cat("logps"),
                           cat("tool_mask") if masked else None,
                           tuple(int(sum(p.tool_calls[k] for p in parts)) for k in range(3)))

    def informative(self, group: int) -> np.ndarray:
        """(groups,) bool: whether a group's rewards differ (std > 0), so its advantages are not all 0."""
        return informative_groups(self.scores.scored_total, group)


@dataclass
class Rollout:
    """Samples, scores and lays out GRPO's completions (`batch`), and answers held-out prompts (`answer`)."""

    cfg: Config
    generator: Sampler
    tokenizer: Tokenizer
    rewards: Rewards
    chat: bool
    agent: Agent | None = None  # objective.tools: multi-turn rollouts (`jaxtune.rollout.agent`)
    timings: dict[str, float] = field(default_factory=dict)

    def close(self) -> None:
        """Stops the tools' worker, if there is one."""
        if self.agent is not None:
            self.agent.close()

    @property
    def stops(self) -> list[int]:
        return stop_ids(self.tokenizer, self.chat)

    def sample(self, weights: Any, source: PromptRows, rows: list[int], *, group: int, temperature: float,
               seed: int, step: int = 0, local: bool = False, between: Callable[[], None] | None = None) -> Completions:
        """``group`` completions of each of the prompts ``rows`` of ``source`` (temperature 0: greedy), scored.

        ``local``: ``rows`` are this process's share of the step's prompts (several processes): the completions of
        every process's prompts are sampled together, SPMD over the whole mesh (the same tokens as one process
        sampling the whole batch), each process scores its own with the reward functions, and the scores are
        shared; a reward that fails on one process stops every process with its error. Otherwise every process
        holds the same ``rows`` (held-out prompts) and does the same. ``between()`` is called once the completions
        are on the host and before they are scored (`jaxtune.rollout.lagged` dispatches a train step there)."""
        o = self.cfg.objective
        together = local and jax.process_count() > 1
        every = [int(r) for r in every_process(np.asarray(rows, np.int64))] if together else list(rows)
        expanded = [r for r in every for _ in range(group)]
        mine = slice(jax.process_index() * len(rows) * group, (jax.process_index() + 1) * len(rows) * group) \
            if together else slice(0, len(expanded))
        if self.agent is not None:  # rendered with their tools, after their environments' reset (this process's)
            prompt_ids = self.agent.prompts(source, expanded[mine], 0)
            prompt_ids = shared_ragged([*[None] * mine.start, *prompt_ids, *[None] * (len(expanded) - mine.stop)],
                                        mine) if together else prompt_ids
        else:
            prompt_ids = [source.ids(r) for r in expanded]
        jax.block_until_ready(weights)  # the previous update: its time is the step's, not the sampler's
        t0 = time.perf_counter()
        greedy = temperature == 0.0

        def generate(prompts: list[list[int]], max_new: int, seed: int, group: int):
            return self.generator(weights, prompts, max_new_tokens=max_new, temperature=temperature,
                                  top_k=None if greedy else o.top_k,
                                  top_p=None if greedy or o.top_p >= 1.0 else o.top_p, eos_id=self.stops, seed=seed,
                                  keep_stop=True, group=group, draw=self.cfg.train.draw)

        equal = all(prompt_ids[i] == prompt_ids[i - i % group] for i in range(len(prompt_ids)))
        trajectories = None
        if self.agent is None:
            sampled = generate(prompt_ids, o.max_completion_length, seed, group if equal else 1)
        else:  # multi-turn: later turns on the first one's KV cache where the sampler keeps one
            trajectories = self.agent.run(*self._first_turn(generate, weights, prompt_ids, seed,
                                                            group if equal else 1, temperature), seed, mine, 0)
            sampled = Generation(trajectories.ids, trajectories.logps)
        ids = sampled.ids
        t1 = time.perf_counter()
        if between is not None:
            between()
        stops, t2 = set(self.stops), time.perf_counter()
        stopped = np.array([bool(c) and c[-1] in stops for c in ids])
        texts = trajectories.texts if trajectories is not None else \
            [self.tokenizer.decode(c[:-1] if s else c) for c, s in zip(ids, stopped)]
        scores = self._scored(source, expanded, texts, ids, mine, step, trajectories, together)
        self.timings = {"generation": t1 - t0, "rewards": time.perf_counter() - t2,
                        "generated_tokens": float(sum(len(c) for c in ids))}
        if trajectories is None:
            return Completions(prompt_ids, ids, texts, expanded, scores, stopped, sampled.logps)
        return Completions(prompt_ids, ids, texts, expanded, scores, stopped, sampled.logps, trajectories.tool_mask,
                           (trajectories.calls, trajectories.failures, trajectories.malformed))

    def _first_turn(self, generate: Callable[..., Generation], weights: Any, prompt_ids: list[list[int]], seed: int,
                    group: int, temperature: float) -> tuple[Extend, list[list[int]], Generation]:
        """A multi-turn rollout's first turns, and how its later ones are generated (`jaxtune.rollout.agent`)."""
        o = self.cfg.objective
        if getattr(self.generator, "open", None) is None or getattr(self.generator, "windowed", False):
            return prefilled_again(generate, o.max_completion_length, len(prompt_ids)), prompt_ids, \
                generate(prompt_ids, o.max_completion_length, seed, group)
        greedy = temperature == 0.0
        first, session = self.generator.open(weights, prompt_ids, max_new_tokens=o.max_completion_length,
                                             temperature=temperature, top_k=None if greedy else o.top_k,
                                             top_p=None if greedy or o.top_p >= 1.0 else o.top_p,
                                             eos_id=self.stops, seed=seed, group=group, draw=self.cfg.train.draw)
        return on_cache(session, o.max_completion_length), prompt_ids, first

    def _scored(self, source: PromptRows, expanded: list[int], texts: list[str], ids: list[list[int]], mine: slice,
                step: int, trajectories: Trajectories | None, together: bool) -> Scores:
        """This process's completions ``mine`` scored (every process's reward-model scores computed together), and
        with several processes every process's scores; a reward that fails on one process stops every process."""
        failure, scores = None, None
        prompts = [source.prompt(r) for r in expanded]
        # Reward models score every process's completions in one program over the mesh; each process keeps its own.
        given = {**self.rewards.modelled(prompts, texts), **self._environment_scores(trajectories)}
        given = {k: (s[mine], {i - mine.start: why for i, why in problems.items() if mine.start <= i < mine.stop})
                 for k, (s, problems) in given.items()}
        try:
            scores = self.rewards.score(prompts[mine], texts[mine], [source.fields(r) for r in expanded[mine]],
                                        [len(c) for c in ids[mine]], [source.where(r) for r in expanded[mine]],
                                        completion_ids=ids[mine], step=step, modelled=given)
        except RewardError as e:
            if jax.process_count() == 1:
                raise
            failure = str(e)
        if jax.process_count() > 1:  # every process stops on any process's failure (held-out prompts too)
            failed = first_failure(failure)
            if failed is not None:
                raise RewardError(failed)
        return self._shared(scores) if together else scores

    def _environment_scores(self, trajectories: Trajectories | None) -> dict[int, tuple[np.ndarray, dict[int, str]]]:
        """The environments' own rewards (``get_reward``), by their reward function's index."""
        if trajectories is None:
            return {}
        at = {label: k for k, label in enumerate(self.rewards.labels)}
        return {at[label]: v for label, v in trajectories.environment_rewards.items()}

    def _shared(self, scores: Scores) -> Scores:
        """Every process's scores in process order (each scored its own completions)."""
        labels = self.rewards.labels
        errors = every_process(np.asarray([[scores.errors.get(k, 0) for k in labels]], np.int64)).sum(axis=0)
        return Scores(per_function=every_process(scores.per_function), total=every_process(scores.total),
                      errors={k: int(n) for k, n in zip(labels, errors) if n}, logged=scores.logged)

    def held_out(self, weights: Any, source: PromptRows, count: int, seed: int) -> tuple[Completions, dict[str, float]]:
        """The first ``count`` prompts of ``source`` answered greedily and scored: the mean total ``reward`` and
        ``accuracy``, the share the success criterion (`Rewards.accuracy`: the reward marked ``accuracy: true``, else
        the first built-in answer check) scores at least 1 (if there is one)."""
        done = self.sample(weights, source, list(range(count)), group=1, temperature=0.0, seed=seed)
        scores = {"reward": float(done.scores.total.mean())}
        if self.rewards.accuracy is not None:
            scores["accuracy"] = float(np.mean(done.scores.per_function[:, self.rewards.accuracy] >= 1.0))
        return done, scores

    def batch(self, weights: Any, source: PromptRows, prompts: PromptBatch, step: int,
              more: Callable[[], PromptBatch] | None = None,
              between: Callable[[], None] | None = None) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The training batch for the prompt batch ``prompts`` at ``step`` (N = prompts × ``num_generations`` rows)
        and the rollout's metrics. ``more()``: the next prompt batch of the data, for dynamic sampling.
        ``between()``: called once, when the first completions are on the host (`sample`); before returning at the
        latest."""
        o = self.cfg.objective
        rows = [int(r) for r in prompts["row"]]
        mixed = o.spec.completions == "mixed"  # some steps train on the data's completions (gkd's lmbda)
        on_policy = not mixed or on_policy_step(self.cfg.train.seed, step, o.lmbda)
        resampled: dict[str, float] = {}
        if on_policy:
            done = self.sample(weights, source, rows, group=o.num_generations, temperature=o.temperature,
                               seed=rollout_seed(self.cfg.train.seed, step), step=step, local=True, between=between)
            if getattr(o, "dynamic_sampling", False):
                done, resampled = self.resampled(done, weights, source, more, step)
        else:
            done = self.given(source, rows, o.num_generations)
            if between is not None:
                between()
        advantages, zero_std = OBJECTIVES[o.name].advantages(o, self.rewarded(done))
        metrics = {**self.metrics(done, zero_std), **resampled}  # over every process's completions
        if mixed:
            metrics["on_policy"] = float(on_policy)
        if jax.process_count() > 1 and on_policy:  # this process trains on its own prompts' completions
            n = len(prompts["row"]) * o.num_generations
            mine = slice(jax.process_index() * n, (jax.process_index() + 1) * n)
            done = done.subset(mine, done.scores)
            advantages = advantages[mine]
        rows = self.laid_out(done, advantages)
        if getattr(o, "mask_truncated_completions", False):
            rows["loss_mask"] = rows["loss_mask"] * completion_kept(rows, done.stopped)
        return rows, metrics

    def rewarded(self, done: Completions) -> Rewarded:
        """The completions' rewards as an objective's ``advantages`` reads them."""
        s = done.scores
        return Rewarded(s.per_function, s.total, s.scored_total, np.asarray(self.rewards.weights),
                        self.cfg.objective.num_generations)

    def laid_out(self, done: Completions, advantages: np.ndarray) -> dict[str, np.ndarray]:
        """The completions as training rows with their ``advantages`` (`layout`)."""
        o = self.cfg.objective
        g = o.num_generations
        if self.cfg.data.shares_prompts and self.agent is not None and any(
                done.prompt_ids[i] != done.prompt_ids[i - i % g] for i in range(len(done.prompt_ids))):
            raise DataError(f"objective.tools={o.tools}: the environment's reset() gave one prompt's rollouts "
                            "different texts, so they share no prompt; set data.share_prompts=false (a row per "
                            "rollout)")
        return layout(self.cfg, done.prompt_ids, done.ids, done.logps, advantages, done.tool_mask)

    def given(self, source: PromptRows, rows: list[int], group: int) -> Completions:
        """``group`` copies of each prompt row's own completion (its ``completion`` field, or the reply that ended
        its conversation), ended by the stop id as a sampled one is, unscored: gkd's supervised steps. This
        process's ``rows`` only (each process trains on its own)."""
        stop = self.stops[-1]
        prompt_ids, ids, texts, expanded = [], [], [], []
        for r in rows:
            fields = source.fields(r)
            text = fields.get("completion", fields.get("reference"))
            if isinstance(text, list):  # a conversational completion: its (one) reply
                text = text[-1].get("content") if text and isinstance(text[-1], dict) else None
            if not isinstance(text, str):
                raise DataError(f"{source.where(r)}: objective.lmbda={self.cfg.objective.lmbda} trains some steps on "
                                 "each prompt's own completion, and this row has none (a 'completion' field, or a "
                                 "conversation ending in a reply); add them, or set objective.lmbda=1")
            completion = self.tokenizer.encode(text)[:self.cfg.objective.max_completion_length - 1] + [stop]
            for _ in range(group):
                prompt_ids.append(source.ids(r))
                ids.append(completion)
                texts.append(text)
                expanded.append(r)
        n = len(ids)
        self.timings = {"generation": 0.0, "rewards": 0.0, "generated_tokens": 0.0}
        scores = Scores(per_function=np.zeros((n, len(self.rewards.labels)), np.float32),
                        total=np.zeros(n, np.float32), errors={}, logged={})
        return Completions(prompt_ids, ids, texts, expanded, scores, np.ones(n, bool), [[0.0] * len(c) for c in ids])

    def resampled(self, done: Completions, weights: Any, source: PromptRows,
                  more: Callable[[], PromptBatch] | None, step: int) -> tuple[Completions, dict[str, float]]:
        """DAPO's dynamic sampling (``objective.dynamic_sampling``): groups whose rewards all agree carry no signal,
        so they are dropped and the next prompt batches of the data sampled (each with its own key, a function of the
        seed, the step and the round) until the step holds as many informative groups as it trains on, or
        ``max_resample`` more rounds were sampled; then the first informative groups in sampling order, and if too
        few, the last uninformative ones after them (advantage 0, as a step without filtering has). Every process
        sees every process's scores, so all decide alike and sample the same rounds; the data position each extra
        batch consumes is the iterator's, saved with the checkpoint, so a resumed run draws the same prompts."""
        o, g = self.cfg.objective, self.cfg.objective.num_generations
        want, parts, timings = len(done.ids) // g, [done], dict(self.timings)
        found = int(done.informative(g).sum())
        while found < want and len(parts) <= o.max_resample and more is not None:
            rows = [int(r) for r in more()["row"]]
            parts.append(self.sample(weights, source, rows, group=g, temperature=o.temperature, step=step,
                                     seed=resample_seed(self.cfg.train.seed, step, len(parts)), local=True))
            timings = {k: timings[k] + self.timings[k] for k in timings}
            found += int(parts[-1].informative(g).sum())
        every = Completions.joined(parts)
        useful = every.informative(g)
        picked = [*np.flatnonzero(useful)[:want], *np.flatnonzero(~useful)[::-1]][:want]
        self.timings = timings
        stats = {"dynamic_sampling/rounds": float(len(parts)), "dynamic_sampling/groups_sampled": float(useful.size),
                 "dynamic_sampling/groups_dropped": float(useful.size - want),
                 "dynamic_sampling/informative_fraction": min(found, want) / want,
                 "dynamic_sampling/reward": float(np.nanmean(every.scores.scored_total))}
        return every.groups([int(i) for i in picked], g), stats

    def metrics(self, done: Completions, zero_std: np.ndarray | None = None) -> dict[str, float]:
        """TRL's rollout metrics (rewards, completion lengths), and the time spent sampling and scoring.
        ``zero_std``: per completion, whether the std its advantage was scaled by is 0 (default: its group's)."""
        total, g = done.scores.scored_total, self.cfg.objective.num_generations
        if zero_std is None:
            zero_std = np.isclose(np.nan_to_num(total.reshape(-1, g)).std(axis=1), 0.0)
        lengths = done.lengths
        scored = total[~np.isnan(total)]
        out = {"reward": float(scored.mean()) if scored.size else float("nan"),
               "reward_std": nanstd(total).item() if scored.size > 1 else 0.0,
               "frac_reward_zero_std": float(np.mean(zero_std)),
               "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
               "completions/clipped_ratio": float(np.mean(~done.stopped))}
        for k, label in enumerate(self.rewards.labels):  # NaN: "does not apply" (a TRL-form function's None)
            column = done.scores.per_function[:, k]
            column = column[~np.isnan(column)]
            out[f"rewards/{label}/mean"] = float(column.mean()) if column.size else float("nan")
            out[f"rewards/{label}/std"] = float(column.std(ddof=1)) if column.size > 1 else 0.0
        out.update(done.scores.logged)
        if self.agent is not None:  # TRL's: calls per rollout, failures per call; and unreadable calls per rollout
            calls, failed, malformed = done.tool_calls
            out["tools/call_frequency"] = calls / len(done.ids)
            out["tools/failure_frequency"] = failed / calls if calls else 0.0
            out["tools/malformed_frequency"] = malformed / len(done.ids)
        for label, n in done.scores.errors.items():
            out[f"reward_errors/{label}"] = float(n)
        gen = self.timings["generation"]
        out["time/generation"] = gen
        out["time/rewards"] = self.timings["rewards"]
        out["generation_tok_s"] = self.timings["generated_tokens"] / max(gen, 1e-9)
        return out


def completion_kept(rows: dict[str, np.ndarray], stopped: np.ndarray) -> np.ndarray:
    """(rows, T) 1 on the tokens of completions that ``stopped`` (emitted an end token), 0 on those cut at the
    length limit: ``mask_truncated_completions``. A row per completion, or a row per prompt with its completions as
    branches (``branch_ids``: k on the k-th completion's tokens)."""
    stopped = np.asarray(stopped, np.float32)
    if BRANCH_KEY not in rows:
        return stopped[:, None]
    kept = stopped.reshape(len(rows[BRANCH_KEY]), -1)  # (prompts, G)
    branch = rows[BRANCH_KEY]
    return np.take_along_axis(kept, np.clip(branch - 1, 0, kept.shape[1] - 1), axis=1) * (branch > 0)


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """gkd: whether ``step`` trains on the student's own samples (probability ``lmbda``, TRL's draw per step), a
    function of the run's seed and the step only (a resumed run draws the same)."""
    return lmbda >= 1.0 or (lmbda > 0.0 and float(np.random.default_rng([seed, step, 17]).random()) < lmbda)


def make_rollout(cfg: Config, generator: Sampler, tokenizer: Tokenizer,
                 models: dict[int, ModelScores] | None = None) -> Rollout:
    """The run's rollouts; ``models``: its reward models, loaded (`jaxtune.companions.load_reward_models`). With
    ``objective.tools``, its tools' worker is started (`jaxtune.rollout.agent.Agent`): `Rollout.close` stops it."""
    chat = tokenizer.chat_template is not None
    o = cfg.objective
    agent = None
    if getattr(o, "tools", None) is not None:
        agent = Agent(o, tokenizer, stop_ids(tokenizer, chat), cfg.data.seq_len - o.max_completion_length)
    try:
        rewards = make_rewards(o, models, agent.reward_labels if agent is not None else ())
        if agent is not None and not rewards.labels:
            raise ToolError(f"objective.tools={o.tools!r}: no reward: its environment has no get_reward() and "
                            "objective.rewards is empty; add a reward function or a get_reward method")
    except Exception:
        if agent is not None:
            agent.close()
        raise
    return Rollout(cfg, generator, tokenizer, rewards, chat, agent)


def layout(cfg: Config, prompt_ids: list[list[int]], ids: list[list[int]], logps: list[list[float]],
           advantages: np.ndarray, tool_mask: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """Completions (each group's ``num_generations`` in a row) as training rows with their ``advantages``: a row per
    prompt, its prompt once and then its group's completions (``data.share_prompts``), or a row per completion."""
    if not cfg.data.shares_prompts:
        return {**training_rows(prompt_ids, ids, logps, cfg.data.seq_len, tool_mask), "advantages": advantages}
    g = cfg.objective.num_generations
    rows = shared_rows(prompt_ids, ids, logps, g, cfg.data.seq_len, cfg.objective.max_completion_length, tool_mask)
    return {**rows, "advantages": advantages.reshape(-1, g)}


def clipped_rows(cfg: Config, source: PromptRows, prompts: PromptBatch) -> dict[str, np.ndarray]:
    """The training rows of ``prompts`` if every completion ``max_completion_length`` tokens long: the shape of a
    step whose longest completion was cut there, which the train step is compiled ahead for (`jaxtune.loop`: the
    first step's completions are not known before they are sampled, and at the start of a run a group of sampled
    completions often has one that runs to the cap)."""
    group, width = cfg.objective.num_generations, cfg.objective.max_completion_length
    prompt_ids = [source.ids(int(r)) for r in prompts["row"] for _ in range(group)]
    ids, logps = [[0] * width for _ in prompt_ids], [[0.0] * width for _ in prompt_ids]
    return layout(cfg, prompt_ids, ids, logps, np.zeros(len(prompt_ids), np.float32))


def training_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], logps: list[list[float]],
                  seq_len: int, tool_mask: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """(N, seq_len) rows of prompt then completion: ``inputs`` and ``targets`` shifted by one, ``positions`` from
    0, ``segment_ids`` 1 (0: padding), ``loss_mask`` on the targets that are completion tokens (the model's own
    only, with a ``tool_mask``) and ``sampler_logps`` there, each completion token's sampling log-prob (``logps``)."""
    n = len(prompt_ids)
    out = {"inputs": np.zeros((n, seq_len), np.int32), "targets": np.zeros((n, seq_len), np.int32),
           "positions": np.zeros((n, seq_len), np.int32), "segment_ids": np.zeros((n, seq_len), np.int32),
           "loss_mask": np.zeros((n, seq_len), np.float32), SAMPLER_LOGPS_KEY: np.zeros((n, seq_len), np.float32)}
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        _check_fits(i, p, c, seq_len)
        seq = list(p) + list(c)
        m = len(seq) - 1
        out["inputs"][i, :m] = seq[:-1]
        out["targets"][i, :m] = seq[1:]
        out["positions"][i, :m] = np.arange(m)
        out["segment_ids"][i, :m] = 1
        out["loss_mask"][i, len(p) - 1:m] = 1.0 if tool_mask is None else tool_mask[i]
        out[SAMPLER_LOGPS_KEY][i, len(p) - 1:m] = logps[i]
    return out


def shared_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], logps: list[list[float]], group: int,
                seq_len: int, width: int, tool_mask: list[list[int]] | None = None) -> dict[str, np.ndarray]:
    """(N / group, P + group x ``width``) rows in regions, one per prompt: the prompt's positions once in its P =
    ``seq_len - width`` slots, then each of its ``group`` completions (at most ``width`` tokens) as a branch in
    ``width`` slots of its own (`jaxtune.data.encoded.shared_row`, `jaxtune.models.layers.RegionMask`), the loss
    mask (on the model's own tokens only, with a ``tool_mask``) and ``sampler_logps`` on the completions' tokens,
    and ``branch_slots`` (N / group, group, width)."""
    n = len(prompt_ids)
    rows = []
    for g in range(0, n, group):
        sequences, sampled = [], []
        for i in range(g, g + group):
            p, c = prompt_ids[i], completion_ids[i]
            _check_fits(i, p, c, seq_len)
            if len(c) > width:
                raise ValueError(f"rollout row {i}: {len(c)} completion tokens exceed max_completion_length={width}")
            trained = np.ones(len(c), bool) if tool_mask is None else np.asarray(tool_mask[i], bool)
            sequences.append((np.asarray([*p, *c], np.int32), np.concatenate([np.zeros(len(p), bool), trained])))
            sampled.append(np.concatenate([np.zeros(len(p), np.float32), np.asarray(logps[i], np.float32)]))
        rows.append(shared_row(sequences, len(prompt_ids[g]), seq_len - width + group * width,
                               {SAMPLER_LOGPS_KEY: sampled}, regions=(seq_len - width, width)))
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _check_fits(i: int, prompt: list[int], completion: list[int], seq_len: int) -> None:
    if len(prompt) + len(completion) - 1 > seq_len:
        raise ValueError(f"rollout row {i}: {len(prompt)} prompt + {len(completion)} completion tokens exceed "
                         f"data.seq_len + 1 = {seq_len + 1}")
