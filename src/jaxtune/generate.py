"""Sampling from a trained model by prompt text: what `jaxtune generate` and the training loop's eval prompts share.

The model-level samplers live with their backend (`jaxtune.models.sampling.Generator` for native models, a torchax
one for HF models); this module turns prompt strings into ids (plain, or as a user turn through the chat template)
and stops at EOS and, for chat, the template's end-of-turn token. A prompt that is empty or fills the context is a
`PromptError`, unless ``truncate="left"`` keeps its last tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from jaxtune.data import encode_prompt, stop_ids
from jaxtune.models.sampling import truncate_left
from jaxtune.train.state import Sampler


def sample(generator: Sampler, weights: Any, tokenizer: Any, prompts: list[str], *, chat: bool, max_new_tokens: int,
           temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
           truncate: Literal["left"] | None = None,
           on_step: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
    """The new token ids for each prompt string (stop ids excluded). ``generator``: a `ModelSpec.generator()` (keep
    it to reuse its compiled shapes); ``weights``: `ModelSpec.weights`. ``truncate="left"``: a prompt that leaves no
    room for ``max_new_tokens`` keeps its last tokens (at least one), else it is a `PromptError` when it fills the
    context. ``on_step`` is first called once the prompts passed their checks."""
    ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    if truncate == "left":
        ids = truncate_left(ids, generator.max_seq_len, max_new_tokens)
    return generator(weights, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     eos_id=stop_ids(tokenizer, chat), seed=seed, on_step=on_step).ids

