"""The ``data`` and ``tokenizer`` sections: what is read, in which format (`jaxtune.config.kinds` says which batch
kind each format makes), and how it is tokenized."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from jaxtune.config.base import Section
from jaxtune.config.kinds import (
    BATCH_KINDS,
    FORMATS,
    KIND_OF_FORMAT,
    PAIRS,
    PRETOKENIZED_FORMAT,
    UNPAIRED,
    BatchKind,
)


class DataConfig(Section):
    """Training data. ``sources`` entries: ``python-stdlib`` (the running interpreter's own standard
    library source, present on every machine), a local file, glob or directory (.txt/.jsonl/.parquet), or
    ``hf:NAME`` for a HuggingFace dataset (``hf:roneneldan/TinyStories``).

    ``format: text`` is pretraining text cut into windows (``tokens``: pretraining token ids already made, nanoGPT
    or llm.c ``.bin``, ``.npy``, or ``input_ids`` rows; `jaxtune.data.pretokenized`); the other formats are
    supervised fine-tuning rows (see `jaxtune.data.formats`): ``messages`` (OpenAI chat), ``sharegpt``
    (``conversations`` of ``from``/``value``), ``alpaca`` (``instruction``/``input``/``output``) and
    ``prompt_completion``, rendered by the tokenizer's chat template (or ``chat_template``), loss on the tokens
    ``loss_on`` names, packed into ``seq_len`` rows; and ``preference``: pairs of completions,
    ``prompt``/``chosen``/``rejected`` in TRL's forms (text, or messages with an explicit or implicit prompt;
    `jaxtune.data.preference`), one pair per item (never packed), loss on each completion; ``prompts``: prompts
    alone (``prompt`` text or messages, or ``messages`` ending with a user turn) with their answer fields, for
    objectives that generate their completions (``grpo``; `jaxtune.data.prompts`)."""

    sources: list[str] = Field(["python-stdlib"])
    format: Literal[FORMATS] = Field("text", description="what the rows are; it decides the batch kind: "
                                     + "; ".join(f"{', '.join(k.formats)}: {k.name}" for k in BATCH_KINDS.values()))
    text_field: str = "text"
    fields: dict[str, str] = Field({}, description="SFT field names when they differ from the format's: messages, "
                                   "role, content, system, instruction, input, output, prompt, completion, chosen, "
                                   "rejected")
    roles: dict[str, str] = Field({}, description="sharegpt: speaker names -> system/user/assistant "
                                  "(default human->user, gpt->assistant)")
    chat_template: str | None = Field(None, description="chatml, gemma, a .jinja file, or template text; default the "
                                      "tokenizer's own")
    tools: str | None = Field(None, description="tool-calling conversations: the module (by name, e.g. "
                              "jaxtune.recipe_tools) whose `tools` list describes the tools a row's `tools` column "
                              "names, and every row's tools when it has no such column; imported to read the "
                              "functions' schemas, never run")
    loss_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    bad_rows: Literal["raise", "drop"] = Field("raise", description="raise: stop at the first bad row (file:line); "
                                               "drop: skip bad rows, counted per reason")
    overlong: Literal["truncate", "drop", "raise"] = Field("truncate", description="rows longer than seq_len + 1 "
                                                           "tokens")
    packing: bool = Field(True, description="pack several rows per sequence (segment ids keep them apart); "
                          "false: one row per sequence, padded")
    val_sources: list[str] = Field([], description="held-out SFT data; default: data.val_fraction of the rows")
    hf_split: str = "train"
    hf_config: str | None = None
    max_bytes: int | None = Field(None, ge=1, description="stop reading sources after this many bytes of text")
    seq_len: int = Field(256, ge=2)
    val_fraction: float = Field(0.05, ge=0.0, le=0.5)
    length_buckets: int = Field(4, ge=0, description="fine-tuning rows, pairs and GRPO completions: each batch is "
                                "padded only to the shortest of this many lengths per doubling (4: 64, 80, 96, 112, "
                                "128, 160, ...) that holds its longest row, one compiled program per length used; "
                                "0: every batch padded to seq_len")
    share_prompts: bool | None = Field(None, description="lay out the completions of one prompt as one row, the "
                                       "prompt once then each completion, attending to the prompt and itself only "
                                       "(prefix sharing; log-probs equal to a row per completion); false: a row per "
                                       "completion; default: on (measured faster for preference pairs and GRPO "
                                       "groups, benchmarks/RESULTS.md), off with model.backend=torchax, and for "
                                       "GRPO off where objective.prompts_per_step does not divide over the "
                                       "data-parallel devices")
    max_prompt_length: int | None = Field(None, ge=1, description="preference pairs, unpaired rows and GRPO prompts: "
                                          "a prompt of "
                                          "more tokens keeps its last this many (TRL's left truncation), whatever "
                                          "data.overlong says; counted when training starts. Default: no limit "
                                          "but data.seq_len's")
    unpair: bool = Field(False, description="unpaired rows (kto): read preference pairs {prompt, chosen, rejected} "
                         "too, each as two rows: its chosen completion desirable (label true) and its rejected one "
                         "undesirable (TRL's unpair_preference_dataset)")
    cache_dir: str = "~/.cache/jaxtune"
    num_workers: int = Field(0, ge=0, description="grain worker processes; 0 reads in the main process")
    num_proc: int | None = Field(None, ge=1, description="processes tokenizing the corpus; default all cores (the "
                                 "tokens are identical for any count)")
    token_vocab_size: int | None = Field(None, ge=1, description="format tokens: the vocabulary the token files "
                                         "assume; checked against the tokenizer's")
    token_eos_id: int | None = Field(None, ge=0, description="format tokens: the eos id the token files separate "
                                     "documents with; checked against the tokenizer's")

    @property
    def kind(self) -> BatchKind:
        """The batch kind ``format`` makes (`jaxtune.config.kinds`)."""
        return KIND_OF_FORMAT[self.format]

    @property
    def shares_prompts(self) -> bool:
        """Each item's sequences are laid out as one row that holds their prompt once (`BatchKind.shares_prompt`)."""
        if not self.kind.shares_prompt:
            return False
        return self.kind.shares_prompt_by_default if self.share_prompts is None else self.share_prompts

    @property
    def row_formats(self) -> tuple[str, ...]:
        """The formats of the rows it reads: ``format``, and with ``unpair`` preference pairs (each read as two
        unpaired rows)."""
        return (self.format, *PAIRS.formats) if self.unpair else (self.format,)

    def unpair_would_read(self, row_format: str) -> bool:
        """Whether ``data.unpair=true`` would read rows of ``row_format`` as this config's (pairs as unpaired rows)."""
        return self.kind is UNPAIRED and row_format in PAIRS.formats

    @property
    def pretokenized(self) -> bool:
        """``format: tokens``: the sources are token ids already."""
        return self.format == PRETOKENIZED_FORMAT

    @model_validator(mode="after")
    def _unpair_applies(self) -> DataConfig:
        if self.unpair and self.kind is not UNPAIRED:
            raise ValueError(f"data.unpair reads preference pairs as unpaired rows (data.format=unpaired, for "
                             f"objective.name=kto), not with data.format={self.format}; drop it, or set "
                             "data.format=unpaired")
        return self

    @model_validator(mode="after")
    def _prompt_limit_applies(self) -> DataConfig:
        if self.max_prompt_length is not None and not self.kind.prompted:
            takers = [f for k in BATCH_KINDS.values() if k.prompted for f in k.formats]
            raise ValueError(f"data.max_prompt_length applies to data.format={', '.join(takers)} (rows whose prompt "
                             f"is apart from the completions), not {self.format}; a fine-tuning row's length is "
                             "data.seq_len")
        return self

    @field_validator("sources", "val_sources", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("roles")
    @classmethod
    def _known_roles(cls, v: dict[str, str]) -> dict[str, str]:
        wrong = {k: r for k, r in v.items() if r not in ("system", "user", "assistant")}
        if wrong:
            raise ValueError(f"roles map speaker names to system, user or assistant; not {wrong}")
        return v

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one source, e.g. python-stdlib or data/*.txt")
        return v


class TokenizerConfig(Section):
    """``bpe`` trains a byte-level BPE on the corpus (cached); ``hf`` loads a tokenizer directory
    (tokenizer.json) or hub name; ``tiktoken`` uses a tiktoken encoding such as ``gpt2``."""

    kind: Literal["bpe", "hf", "tiktoken"] = "bpe"
    path: str | None = Field(None, description="hf: tokenizer directory or hub name; tiktoken: encoding name")
    vocab_size: int = Field(8192, ge=260)
    train_bytes: int = Field(20_000_000, ge=1, description="bpe: text bytes used to train the tokenizer")
    special_tokens: list[str] = Field([], description="bpe: extra special tokens, e.g. a chat template's "
                                      "<|im_start|> and <|im_end|>")

    # The key errors about ``path`` name: model.from_hf when this is the checkpoint's own tokenizer (`Config`).
    _path_key: str = PrivateAttr("tokenizer.path")

    @model_validator(mode="after")
    def _path_when_needed(self) -> TokenizerConfig:
        if self.kind != "bpe" and not self.path:
            raise ValueError(f"tokenizer.kind={self.kind} needs tokenizer.path")
        return self

    @classmethod
    def of_checkpoint(cls, from_hf: str) -> TokenizerConfig:
        """A HuggingFace checkpoint's own tokenizer (``model.from_hf``); errors about it name model.from_hf."""
        tok = cls(kind="hf", path=from_hf)
        tok._path_key = "model.from_hf"
        return tok

    @property
    def path_key(self) -> str:
        """``tokenizer.path``, or ``model.from_hf`` for a checkpoint's own tokenizer: the key the user set."""
        return self._path_key
