"""Tiny random transformers checkpoints with a real tokenizer, made offline: a ChatML byte-level BPE (300 ids, the
ChatML specials first) saved as a transformers tokenizer directory, and Llama / Qwen 2 / Qwen 3 / GPT-2 models of 2
layers, width 64, every tensor perturbed, saved beside it; `IDS`, a batch of inputs for them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

IDS = np.random.default_rng(0).integers(0, 300, (2, 24))
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?", "<|im_start|>user"] * 20

CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_chatml_tokenizer(directory: Path, texts: list[str]) -> int:
    """A 300-id byte-level BPE trained on ``texts`` with the ChatML specials (ids 0, 1, 2), saved as a transformers
    tokenizer directory with the ChatML chat template; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxtune.data.templates import CHATML

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=CHAT_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert [tok.token_to_id(s) for s in CHAT_SPECIALS] == [0, 1, 2]
    return tok.get_vocab_size()


def save_perturbed(make: Callable[[], Any], directory: Path) -> Path:
    """``make()``'s transformers model (seeded), every tensor perturbed by N(0, 0.2^2) so that no weight keeps its
    structured init (norms at 1, biases at 0) and a misplaced tensor shows, saved to ``directory``."""
    import torch

    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(directory)
    return directory


def tiny_llama(directory: Path, arch: str = "llama", **config) -> Path:
    """A tiny random Llama (or ``arch``: qwen2, qwen3) with a real (ChatML BPE) tokenizer, every tensor perturbed,
    saved to ``directory``."""
    import transformers

    directory.mkdir()
    vocab = save_chatml_tokenizer(directory, TEXTS)
    config_cls, model_cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                     attn_implementation="eager", **config)
    return save_perturbed(lambda: model_cls(cfg), directory)


def tiny_gpt2(directory: Path, n_positions: int = 1024) -> Path:
    """A tiny random transformers GPT-2 (2 layers, d_model 64; its Conv1D weights (in, out)) with the ChatML BPE,
    every tensor perturbed, saved to ``directory``. 1024 positions: transformers' GGUF reader maps gpt2's
    context_length to n_ctx only, so a GPT-2 GGUF of another context fails its n_positions check."""
    import transformers

    directory.mkdir()
    cfg = transformers.GPT2Config(vocab_size=save_chatml_tokenizer(directory, TEXTS), n_positions=n_positions,
                                  n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
    return save_perturbed(lambda: transformers.GPT2LMHeadModel(cfg), directory)


def peft_reload(base: Any, adapter: Path | str) -> Any:
    """``peft.PeftModel.from_pretrained(base, adapter)`` in eval mode, its weights read onto the CPU. peft >= 0.22 picks
    the load device from ``torch.accelerator``, which answers torchax's "jax" device once torchax is imported in the
    process (an xdist worker that ran a torchax test first), and safetensors refuses that device."""
    import peft

    return peft.PeftModel.from_pretrained(base, adapter, torch_device="cpu").eval()
