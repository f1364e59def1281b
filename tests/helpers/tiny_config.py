"""The tiny runs most tests train: a GPT-2-shaped model of 2 layers, width 64, over real text (the stdlib source)
through a 512-id BPE, CPU-sized (`TINY`, the overrides of conftest's ``tiny_overrides`` and ``tiny_cfg``); the
settings that keep a short run quiet and quick (`QUICK`); and the same-sized transformers Llama the torchax backend
runs instead (`TORCHAX_LLAMA`, conftest's ``torchax_overrides``)."""

from __future__ import annotations

TINY = [
    "model.preset=tiny",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=64",
    "model.max_seq_len=64",
    "data.sources=[python-stdlib]",
    "data.max_bytes=300000",
    "data.seq_len=32",
    "data.val_fraction=0.05",
    "tokenizer.kind=bpe",
    "tokenizer.vocab_size=512",
    "tokenizer.train_bytes=300000",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "train.steps=20",
    "train.batch_size=8",
    "eval.batches=2",
    "checkpoint.every=5",
    "checkpoint.keep=10",
    "logging.every=1",
    "logging.progress=false",
    "logging.tensorboard=false",
]

QUICK = ["eval.exact_match=0", "eval.prompts=[]", "logging.progress=false", "logging.tensorboard=false"]

TORCHAX_LLAMA = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
                 "tie_word_embeddings": True}
