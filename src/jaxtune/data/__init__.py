"""Pretraining data: sources → tokenizer → cached token file → Grain batches. Nothing model-specific.

How the training loop uses it::

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
    data = prepare_tokens(cfg.data, tokenizer)
    train_iter = make_train_iterator(data, global_batch=..., seed=..., process_index=..., process_count=...)
    eval_batches = make_eval_batches(data, batch_size=..., num_batches=...)
"""

from jaxtune.data.errors import DataError
from jaxtune.data.pipeline import (
    Batch,
    TrainingData,
    make_eval_batches,
    make_sequence_batches,
    make_train_iterator,
    make_training_data,
)
from jaxtune.data.sources import iter_documents, sources_fingerprint
from jaxtune.data.tokenizer import Tokenizer, load_tokenizer, load_tokenizer_dir
from jaxtune.data.tokens import TokenData, prepare_tokens

__all__ = [
    "Batch",
    "DataError",
    "TokenData",
    "Tokenizer",
    "TrainingData",
    "iter_documents",
    "load_tokenizer",
    "load_tokenizer_dir",
    "make_eval_batches",
    "make_sequence_batches",
    "make_train_iterator",
    "make_training_data",
    "prepare_tokens",
    "sources_fingerprint",
]
