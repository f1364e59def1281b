"""Whether an exported ChatML model stops at the end of its turn (``<|im_end|>``) in transformers. A model trained
for a few steps may not end a turn by itself, so generation forces ``<|im_end|>`` to be the argmax from the fourth
new token on: a model that stops at it generates at most three tokens and then the end of turn (fewer where it ends
the turn itself); one that does not stop runs on to `MAX_NEW_TOKENS`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

END_OF_TURN = "<|im_end|>"
FORCED_AFTER = 3
MAX_NEW_TOKENS = 40


def forced_generation(model: Any, tokenizer: Any, token_id: int, generation_config: Any = None) -> list[int]:
    """The new ids of greedy generation (at most `MAX_NEW_TOKENS`) from a one-user-turn chat prompt, with
    ``token_id`` the argmax from new token `FORCED_AFTER` + 1 on; ``generation_config``: the model's by default."""
    import torch
    import transformers

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say red then blue"}],
                                           add_generation_prompt=True, return_dict=True, return_tensors="pt")
    start = prompt["input_ids"].shape[1]

    class Force(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - start >= FORCED_AFTER:
                scores[:, token_id] = scores.max() + 100.0
            return scores

    config = copy.deepcopy(generation_config or model.generation_config)
    config.update(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    with torch.no_grad():
        out = model.generate(**prompt, generation_config=config, logits_processor=[Force()])
    return out[0, start:].tolist()


def assert_stops_at_end_of_turn(directory: Path, adapter: bool = False) -> None:
    """``directory`` (an export of a ChatML run; ``adapter``: a PEFT adapter directory, its base named in it) loaded
    by transformers stops greedy generation at ``<|im_end|>``: its tokenizer's EOS is the end of turn, its generation
    config stops at the EOS the run was trained with and the end of turn (an adapter's: the adapter directory's
    generation_config.json, as the base's settings cannot change), and generation stops at the first end of turn."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert tokenizer.eos_token == END_OF_TURN
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    generation = transformers.GenerationConfig.from_pretrained(directory) if adapter else model.generation_config
    assert set(generation.eos_token_id) == {tokenizer.convert_tokens_to_ids("<|endoftext|>"), end}
    if not adapter:
        assert model.config.eos_token_id == end
    assert_stopped_at(forced_generation(model, tokenizer, end, generation), end)


def assert_stopped_at(new: list[int], end: int) -> None:
    """A `forced_generation`'s ids stopped at the first ``end``, where it was forced at the latest."""
    assert new[-1] == end and end not in new[:-1] and len(new) <= FORCED_AFTER + 1, new
