"""Reward models for the tests that score with one (test_model_reward.py, test_multihost.py): a tiny transformers
`LlamaForSequenceClassification` (num_labels 1) saved beside a copy of another model's tokenizer files."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch", reason="the reward models are transformers checkpoints")
transformers = pytest.importorskip("transformers", reason="the reward models are transformers checkpoints")

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def classifier(model_dir, directory, build=None, **config):
    """A tiny LlamaForSequenceClassification over ``model_dir``'s tokenizer (its files copied: the quickstart's
    export), saved in ``directory``; ``build(model)`` sets its weights (default: random, seed 0)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    c = transformers.LlamaConfig(**{"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
                                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "max_position_embeddings": 128, "initializer_range": 0.2, "pad_token_id": 0,
                                    "num_labels": 1, "tie_word_embeddings": False, **config})
    model = transformers.LlamaForSequenceClassification(c).float()
    if build is not None:
        with torch.no_grad():
            build(model)
    model.save_pretrained(directory)
    for f in model_dir.iterdir():
        if f.name not in MODEL_FILES:
            shutil.copy(f, directory / f.name)
    return directory
