"""Whether a tokenizer and the configured lengths fit a model (`check_fits`): the one check the training loop,
``jaxtune eval``, the TPU plan, the backends and model resolution make, with an error naming the key to change."""

from __future__ import annotations

from jaxtune.config import ConfigError


def check_fits(vocab_size: int, context: int, *, tokenizer_vocab: int | None = None, seq_len: int | None = None,
               max_seq_len: int | None = None, what: str = "the model") -> None:
    """The one check that a tokenizer and the configured lengths fit a model of ``vocab_size`` ids and ``context``
    positions (``what`` names it in the error): a `ConfigError` naming the key to change."""
    if tokenizer_vocab is not None and tokenizer_vocab > vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab} ids but {what} only {vocab_size}; use the model's "
                          "tokenizer (or a model with a larger vocabulary)")
    if max_seq_len is not None and max_seq_len > context:
        raise ConfigError(f"model.max_seq_len={max_seq_len} exceeds the context of {what}, {context}")
    if seq_len is not None and seq_len > context:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's context (model.max_seq_len={context}); lower "
                          "data.seq_len or raise max_seq_len")
