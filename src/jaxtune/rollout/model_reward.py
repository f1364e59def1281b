"""A learned reward model as a reward of GRPO and RLOO (``objective.rewards: [{name: model, path: ...}]``): each
completion scored by the model's score head at the last token of the prompt and completion, on the run's devices.

The text is the reward model's as it was trained on pairs (`jaxtune.data.sft.Encoder`, with the reward model's own
tokenizer and chat template): a conversation's prompt with the completion as the assistant's reply, rendered by its
template; a text prompt with the completion, after its BOS and ending with its EOS. TRL's ``GRPOTrainer`` scores the
same conversation, but a text prompt and completion without the EOS its ``RewardTrainer`` trained on; the score is
what transformers' *ForSequenceClassification gives for those tokens (``tests/train/test_model_reward.py``).

The sequences are scored as the reward objective scores them (`jaxtune.train.objectives.reward`): one per row from
position 0 under the causal mask alone, right-padded, the score read at the last real token. The rows are laid out
in fixed shapes: ``batch_size`` rows (default: the call's sequences, rounded up to the data-parallel size) of a
power-of-two width (16 at least, at most the model's context), so a run compiles one program per width it meets and
per number of sequences it scores at once (a step's completions, and the held-out prompts'). The weights are placed
once on the policy's mesh; the rows are sharded over its data axes. With several processes every process passes the
same sequences (every process's completions; `jaxtune.rollout.rollout.Rollout.sample`) and reads every score.

A sequence longer than the reward model's context is not scored: the reward says which (`ModelReward.__call__`), and
`jaxtune.rollout.rewards.Rewards` raises or scores it 0, as ``objective.reward_errors`` says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxtune import sharding
from jaxtune.config import DataConfig
from jaxtune.data import Tokenizer
from jaxtune.data.formats import Example
from jaxtune.data.sft import Encoder
from jaxtune.models.sampling import bucket
from jaxtune.train.state import Forward


def last_token_scores(forward: Forward) -> Any:
    """(weights, (R, W) right-padded token rows, (R,) each row's last real index) -> (R,) float32 scores: the score
    head there, one sequence per row under the causal mask."""
    def score(weights: Any, tokens: jax.Array, last: jax.Array) -> jax.Array:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        scores = forward.scores(weights, {"inputs": tokens, "positions": positions})  # (R, W)
        return jnp.take_along_axis(scores, last[:, None], axis=1)[:, 0]
    return score


@dataclass
class ModelReward:
    """A reward model ready to score: its forward and its weights on ``mesh``, its tokenizer and the data settings it
    was trained with (``data_cfg``: how a pair's text became tokens), its context ``max_len``."""

    source: str  # what the config named (for messages)
    forward: Forward
    weights: Any
    mesh: Mesh
    tokenizer: Tokenizer
    data_cfg: DataConfig
    max_len: int
    batch_size: int | None = None
    _programs: dict[tuple[int, int], Any] = field(default_factory=dict)

    @property
    def compiles(self) -> int:
        """Programs compiled so far: one per (rows, width) met."""
        return len(self._programs)

    def encode(self, prompts: list[Any], completions: list[str]) -> list[np.ndarray]:
        """Each prompt (text, or a conversation's message dicts) with its completion, as the reward model's tokens."""
        examples = [Example(messages=(*p, {"role": "assistant", "content": c})) if isinstance(p, list)
                    else Example(prompt=p, completion=c) for p, c in zip(prompts, completions)]
        encoder = Encoder(self.tokenizer, self.data_cfg)
        out: list[np.ndarray | None] = [None] * len(examples)
        for chat in (False, True):  # an encoder call renders either conversations or text
            picked = [i for i, ex in enumerate(examples) if bool(ex.messages) == chat]
            if picked:
                turns = [len(prompts[i]) if chat else 0 for i in picked]
                for i, enc in zip(picked, encoder.encode([examples[i] for i in picked], turns)):
                    out[i] = enc.ids
        return out

    def __call__(self, prompts: list[Any], completions: list[str]) -> tuple[np.ndarray, dict[int, str]]:
        """(N,) float32 scores of the N completions of ``prompts``, and the ones not scored (NaN there): index ->
        why."""
        sequences = self.encode(prompts, completions)
        problems = {i: f"its {len(s)} tokens exceed the reward model's context ({self.max_len}); lower "
                       "objective.max_completion_length or data.max_prompt_length"
                    for i, s in enumerate(sequences) if len(s) > self.max_len}
        scores = np.full(len(sequences), np.nan, np.float32)
        todo = [i for i in range(len(sequences)) if i not in problems and len(sequences[i])]
        if not todo:
            return scores, problems
        units = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        rows = -(-(self.batch_size or len(todo)) // units) * units
        width = min(bucket(max(len(sequences[i]) for i in todo)), self.max_len)
        for start in range(0, len(todo), rows):
            chunk = todo[start:start + rows]
            tokens = np.zeros((rows, width), np.int32)
            last = np.zeros(rows, np.int32)
            for r, i in enumerate(chunk):
                tokens[r, :len(sequences[i])] = sequences[i]
                last[r] = len(sequences[i]) - 1
            with sharding.use_mesh(self.mesh):
                out = self._program(rows, width)(self.weights, self._placed(tokens), self._placed(last))
            scores[chunk] = out[:len(chunk)]
        return scores, problems

    def _placed(self, host: np.ndarray) -> jax.Array:
        """A host array every process holds whole, sharded over the mesh's data axes."""
        return jax.make_array_from_callback(host.shape, sharding.batch_sharding(self.mesh), lambda at: host[at])

    def _program(self, rows: int, width: int) -> Any:
        if (rows, width) not in self._programs:
            jitted = jax.jit(last_token_scores(self.forward), out_shardings=sharding.replicated(self.mesh))
            self._programs[rows, width] = lambda *a: np.asarray(jitted(*a))
        return self._programs[rows, width]
