"""Training data: sources → tokenizer → cached token file or packed fine-tuning rows → Grain batches. Nothing
model-specific.

How the training loop uses it::

    tokenizer = load_tokenizer(cfg.tokenizer, cfg.data)
    data = make_training_data(cfg.data, tokenizer, batch_size=..., seed=..., eval_batches=...)
    batch = next(data.train_iter)

Inside, modules import only downward: ``errors``, ``synthetic`` → ``documents`` → ``sources`` → ``rows`` →
``formats`` → ``tokenizer`` → ``chat``, ``shards`` → ``tokens``, ``encoded``, ``row_policy`` → ``sft`` →
``preference``, ``prompts`` → ``pipeline``.
"""

from jaxtune.data.chat import encode_prompt, end_of_turn_ids, format_sample, resolve_chat_template, stop_ids
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example, Pair, detect_format, renders_chat
from jaxtune.data.pipeline import (
    Batch,
    TrainingData,
    make_eval_batches,
    make_sequence_batches,
    make_train_iterator,
    make_training_data,
    test_sequences,
)
from jaxtune.data.preference import PairRows, PreferenceData, PreferenceStats, prepare_preference
from jaxtune.data.prompts import PromptData, PromptRows, prepare_prompts
from jaxtune.data.sft import question
from jaxtune.data.sources import iter_documents, sources_fingerprint
from jaxtune.data.tokenizer import Tokenizer, load_hf_tokenizer, load_tokenizer, load_tokenizer_dir
from jaxtune.data.tokens import TokenData, prepare_tokens

__all__ = [
    "Batch",
    "DataError",
    "Example",
    "Pair",
    "PairRows",
    "PreferenceData",
    "PreferenceStats",
    "PromptData",
    "PromptRows",
    "TokenData",
    "Tokenizer",
    "TrainingData",
    "detect_format",
    "encode_prompt",
    "end_of_turn_ids",
    "format_sample",
    "iter_documents",
    "load_hf_tokenizer",
    "load_tokenizer",
    "load_tokenizer_dir",
    "make_eval_batches",
    "make_sequence_batches",
    "make_train_iterator",
    "make_training_data",
    "prepare_preference",
    "prepare_prompts",
    "prepare_tokens",
    "question",
    "renders_chat",
    "resolve_chat_template",
    "sources_fingerprint",
    "stop_ids",
    "test_sequences",
]
