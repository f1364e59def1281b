"""Text ↔ token ids: a byte-level BPE trained on the corpus (cached), a HuggingFace tokenizer, or tiktoken.

Every kind is wrapped in the same small ``Tokenizer`` interface, and ``Tokenizer.save`` writes a directory
that ``load_tokenizer_dir`` reads back without network, so ``jaxtune generate RUN_DIR`` decodes with
exactly the tokenizer the run was trained with.

Text is always encoded as text: a literal ``<|endoftext|>`` inside a document is spelled out with ordinary
tokens, never turned into the eos id, so the only eos ids in the token stream are the document separators
the pipeline inserts.
"""

from __future__ import annotations

import abc
import datetime
import functools
import hashlib
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from jaxtune.config import WINDOWS, DataConfig, TokenizerConfig, local_or_hub
from jaxtune.data.encode_worker import hf_ids
from jaxtune.data.errors import DataError
from jaxtune.data.formats import Example, iter_turn_texts
from jaxtune.data.progress import Progress
from jaxtune.data.sources import Piece, ReadStats, read_pieces, sources_fingerprint, take_bytes
from jaxtune.data.templates import template_text
from jaxtune.io import atomic_dir, read_json, writable_dir

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
META_FILE = "jaxtune_tokenizer.json"
# Part of every cached BPE's key: a change to what _train_bpe produces takes a new number, so no tokenizer trained
# otherwise is loaded from the cache.
_BPE_VERSION = 1
# End-of-text spellings of common tokenizer families (GPT-2, Llama 2/Mistral, Llama 3, Gemma), tried in
# order when a tokenizer.json comes without a tokenizer_config.json that names its eos token.
_KNOWN_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class Tokenizer(abc.ABC):
    """Encodes text to ids in ``[0, vocab_size)``; ``eos_id`` separates documents in the token stream."""

    vocab_size: int  # size of the id space (max id + 1)
    eos_id: int
    pad_id: int | None = None  # the pad token its config names (transformers' pad_token); None without one
    fingerprint: str  # stable across save/load; keys the token cache
    chat_template: str | None = None  # Jinja chat template (transformers' convention); saved with the tokenizer
    response_template: dict[str, Any] | None = None  # how a reply is read back (transformers'; `_HFTokenizer`)
    # What the checkpoint's tokenizer puts before a text (Gemma's <bos>, Llama 3's <|begin_of_text|>): a prompt
    # given as plain text starts with it, as transformers encodes it; models trained with it degrade without it.
    bos_prefix: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def worker_spec(self) -> tuple[str, str] | None:
        """How a tokenizing worker process rebuilds this tokenizer (`jaxtune.data.encode_worker.make_encoder`):
        (kind, payload); None when it cannot, and the corpus is then tokenized in-process."""
        return None

    def encode_chat(self, texts: list[str]) -> list[list[int]]:
        """Encodes rendered chat text, where special-token spellings (``<|im_start|>``, ``<bos>``) are the special
        tokens, as a chat template means them (``encode_batch`` spells them out as text)."""
        raise DataError(f"{type(self).__name__} cannot encode chat templates; use a HuggingFace tokenizer")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` with ``chat_template`` as ``transformers`` does (same sandboxed Jinja environment
        and variables), offline; ``tools``: the JSON schemas of the tools the model may call."""
        if self.chat_template is None:
            raise DataError("this tokenizer has no chat template (tokenizer_config.json chat_template or "
                            "chat_template.jinja); set data.chat_template (e.g. chatml)")
        return _render(self.chat_template, messages, add_generation_prompt, self.special_strings(), tools)

    def special_strings(self) -> dict[str, str]:
        return {}

    @abc.abstractmethod
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes many texts at once (in parallel where the backend can); no special tokens added."""

    @abc.abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abc.abstractmethod
    def save(self, directory: Path, eos_id: int | None = None, pad_id: int | None = None) -> None:
        """Writes ``directory`` so that ``load_tokenizer_dir(directory)`` returns an equal tokenizer offline.
        ``eos_id``: the token the saved tokenizer names as its EOS instead of its own (a chat model's export: the
        template's end-of-turn token, which vLLM and llama.cpp's converter stop at as the EOS). ``pad_id``: the token
        it names as its pad token instead of its own (an export: the ``pad_token_id`` its config.json names, so that
        transformers pads a batch with it)."""


class _HFTokenizer(Tokenizer):
    """A HuggingFace ``tokenizers.Tokenizer`` (our trained BPE, a tokenizer.json, or a hub tokenizer)."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_token: str, where: str, source: Path | None = None):
        eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(f"{where}: eos token {eos_token!r} is not in the vocabulary")
        # The EOS separates documents in the token cache, so two tokenizers that split text alike but end documents
        # with different tokens (a chat export names its end of turn) must not share cached windows.
        self.fingerprint = "hf:" + hashlib.sha256(f"{tok.to_str()}\neos:{eos_token}".encode()).hexdigest()
        tok.encode_special_tokens = True  # see the module docstring: text is always text
        self._tok = tok
        self._eos_token = eos_token
        self.eos_id = eos_id
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self._source = source  # a checkpoint's tokenizer directory: its config files travel with save()
        self._config = _read_json(source / "tokenizer_config.json") if source else {}
        pad = _special_token(source, "pad_token") if source else None
        self.pad_id = tok.token_to_id(pad) if pad is not None else None
        self.chat_template = _chat_template(source, self._config) if source else None
        self._source_template = self.chat_template
        self._chat_tok: tokenizers.Tokenizer | None = None
        with_specials, plain = (tok.encode("a", add_special_tokens=add).ids for add in (True, False))
        if len(with_specials) > len(plain) and with_specials[-len(plain):] == plain:
            self.bos_prefix = tuple(with_specials[:len(with_specials) - len(plain)])

    @property
    def response_template(self) -> dict[str, Any] | None:
        """transformers' declarative reading of a reply (tokenizer_config.json ``response_template``: its content,
        tool calls ...) for the tokenizer's own chat template; None where it has none or data.chat_template
        replaced the template."""
        template = self._config.get("response_template")
        return template if isinstance(template, dict) and self.chat_template == self._source_template else None

    def special_strings(self) -> dict[str, str]:
        specials = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in self._config.items()
                    if k.endswith("_token") and isinstance(v, (str, dict))}
        return {"eos_token": self._eos_token, **specials}

    def encode_chat(self, texts: list[str]) -> list[list[int]]:
        if self._chat_tok is None:  # a copy that maps special-token text to the special ids
            self._chat_tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
            self._chat_tok.encode_special_tokens = False
        return hf_ids(self._chat_tok, texts)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return hf_ids(self._tok, texts)

    def worker_spec(self) -> tuple[str, str]:
        return "hf", self._tok.to_str()

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def save(self, directory: Path, eos_id: int | None = None, pad_id: int | None = None) -> None:
        eos = self._eos_token if eos_id is None else self._tok.id_to_token(eos_id)
        pad = self._tok.id_to_token(pad_id) if pad_id is not None else None
        if pad_id is not None and pad is None:
            raise DataError(f"pad id {pad_id} is past the tokenizer's vocabulary ({self.vocab_size} ids), so the "
                            "saved tokenizer cannot name it as its pad token")
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / "tokenizer.json"))
        if self._source is not None:  # a checkpoint's tokenizer: keep its own config (chat template, specials)
            for name in _TOKENIZER_FILES:
                if (self._source / name).is_file() and self._source.resolve() != directory.resolve():
                    shutil.copyfile(self._source / name, directory / name)
            renamed = {**({"eos_token": eos} if eos != self._eos_token else {}),
                       **({"pad_token": pad} if pad is not None and pad != _special_token(self._source, "pad_token")
                          else {})}
            if renamed:
                _name_specials(directory, renamed)
        else:  # tokenizer_config.json makes the directory loadable by transformers.AutoTokenizer as well.
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                      **({"pad_token": pad} if pad is not None else {})}
            if self.chat_template is not None:
                config["chat_template"] = self.chat_template
            (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if self.chat_template is not None and self.chat_template != self._source_template:
            (directory / "chat_template.jinja").write_text(self.chat_template)  # data.chat_template overrides
        meta = {"kind": "hf", "eos_token": eos, "eos_id": self.eos_id if eos_id is None else eos_id}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


class _TiktokenTokenizer(Tokenizer):
    """A tiktoken ``Encoding``, saved by name (tiktoken caches its files locally after the first download)."""

    def __init__(self, encoding: Any, name: str):
        self._enc = encoding
        self._name = name
        self.eos_id = encoding.eot_token
        self.vocab_size = encoding.n_vocab
        self.fingerprint = f"tiktoken:{name}"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def worker_spec(self) -> tuple[str, str]:
        return "tiktoken", self._name

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def save(self, directory: Path, eos_id: int | None = None, pad_id: int | None = None) -> None:
        """tiktoken's encoding by name; no transformers tokenizer files, so no pad token is written."""
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"kind": "tiktoken", "encoding": self._name, "eos_id": self.eos_id if eos_id is None else eos_id}
        (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def load_tokenizer(tok_cfg: TokenizerConfig, data_cfg: DataConfig) -> Tokenizer:
    """The tokenizer ``tok_cfg`` asks for; ``kind=bpe`` trains one on ``data_cfg``'s corpus, once."""
    if tok_cfg.kind == "bpe":
        return _cached_bpe(tok_cfg, data_cfg)
    assert tok_cfg.path is not None  # TokenizerConfig requires a path for hf and tiktoken
    if tok_cfg.kind == "hf":
        return load_hf_tokenizer(tok_cfg.path, key=tok_cfg.path_key)
    return _load_tiktoken(tok_cfg.path)


def load_tokenizer_dir(directory: Path) -> Tokenizer:
    """Reads a directory written by ``Tokenizer.save`` (e.g. ``RUN_DIR/tokenizer``)."""
    meta_path = Path(directory) / META_FILE
    if not meta_path.is_file():
        raise DataError(
            f"{directory}: not a saved jaxtune tokenizer (no {META_FILE}); pass the run's tokenizer directory"
        )
    meta = read_json(meta_path, error=DataError)
    if meta["kind"] == "tiktoken":
        return _load_tiktoken(meta["encoding"])
    tok = tokenizers.Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    return _HFTokenizer(tok, meta["eos_token"], where=str(directory), source=Path(directory))


def _cached_bpe(tok_cfg: TokenizerConfig, data_cfg: DataConfig) -> Tokenizer:
    """Trains once per (corpus, vocab_size, train_bytes); later runs load the cached directory."""
    # Chat and instruction rows teach the BPE their turns, read by the format, and its special tokens (tool-calling
    # conversations: as the chat template renders them); text documents teach it themselves alone, so their key names
    # neither.
    documents = data_cfg.kind is WINDOWS and not data_cfg.pretokenized
    key_src = json.dumps([sources_fingerprint(data_cfg), tok_cfg.vocab_size, tok_cfg.train_bytes, _BPE_VERSION,
                          *([] if documents else [data_cfg.format, tok_cfg.special_tokens]),
                          # a tool-calling conversation teaches it as the template renders it with its tools
                          *([] if documents or data_cfg.chat_template is None else [data_cfg.chat_template,
                                                                                     data_cfg.tools])])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    directory = Path(data_cfg.cache_dir).expanduser() / f"bpe-{key}"
    if not (directory / META_FILE).is_file():
        writable_dir(directory.parent, "data.cache_dir=", Path(data_cfg.cache_dir))
        progress = Progress(f"training a {tok_cfg.vocab_size}-token BPE tokenizer (reading data.sources)",
                            tok_cfg.train_bytes, str(directory))
        trained = _HFTokenizer(
            _train_bpe(_corpus(data_cfg, tok_cfg.train_bytes, progress, tuple(tok_cfg.special_tokens)),
                       tok_cfg.vocab_size,
                       tuple(tok_cfg.special_tokens)),
            EOS_TOKEN,
            where="tokenizer.kind=bpe",
        )
        progress.close("merges computed")
        # Saved whole or not at all, so a killed run never leaves a half-saved tokenizer; when another process
        # (e.g. a second host sharing the cache) saved its copy first, that one is kept and used.
        atomic_dir(directory, trained.save, replace=False)
    # Load even right after training, so the first run and every later run use the identical object.
    return load_tokenizer_dir(directory)


def _rendered_texts(template: str, specials: tuple[str, ...], example: Example) -> list[str]:
    """A tool-calling conversation as ``template`` renders it (with its tools), cut at the special tokens (which
    the BPE does not learn: they are whole tokens of their own)."""
    text = render_template(template, list(example.messages), tools=list(example.tools) or None)
    if specials:
        text = re.sub("|".join(re.escape(t) for t in specials), "\n", text)
    return [t for t in text.split("\n\n") if t]


def _corpus(data_cfg: DataConfig, train_bytes: int, progress: Progress,
            specials: tuple[str, ...] = ()) -> Iterator[str]:
    """What a BPE learns from, up to ``train_bytes`` bytes: the documents (as the tokenizer reads them: pieces of at
    most a block, `jaxtune.data.sources.read_pieces`, so memory stays bounded), or for chat/instruction data the
    text of every turn (a tool-calling conversation as ``data.chat_template`` renders it, ``specials`` cut out:
    its tools' descriptions and calls' markup are the template's)."""
    if data_cfg.pretokenized:
        raise DataError("data.format=tokens: the sources are token ids already; set tokenizer.kind (hf or tiktoken) "
                        "and tokenizer.path to the tokenizer they were made with, not bpe")
    if data_cfg.kind is WINDOWS:
        pieces = take_bytes(read_pieces(data_cfg, ReadStats()), train_bytes)
    else:
        template = template_text(data_cfg.chat_template)
        rendered = None if template is None else functools.partial(_rendered_texts, template, specials)
        pieces = take_bytes((Piece(t, end=True) for t in iter_turn_texts(data_cfg, rendered)), train_bytes)
    done = 0
    for piece in pieces:
        done += len(piece.text)
        progress.update(done)
        yield piece.text


def _train_bpe(docs: Iterator[str], vocab_size: int, specials: tuple[str, ...] = ()) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE: any string encodes (no unknown tokens) and decodes back exactly."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *(t for t in specials if t != EOS_TOKEN)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_hf_tokenizer(path: str, key: str = "tokenizer.path") -> Tokenizer:
    """A HuggingFace tokenizer: a directory with tokenizer.json (and its config files), or a hub name, whose
    tokenizer files are downloaded once into the HuggingFace cache (`jaxtune.config.local_or_hub`: offline, the
    cached copy). ``key`` is the config key the path came from, named in errors."""
    directory = local_or_hub(path, key, HUB_TOKENIZER_FILES)
    where = f"{key}={path}"
    if not directory.is_dir():
        raise DataError(f"{where}: {'not a directory' if directory.exists() else 'no such directory'}; give a "
                        "HuggingFace model directory (a trained run becomes one with `jaxtune export RUN_DIR DIR`) or "
                        "a hub name")
    file = directory / "tokenizer.json"
    if file.is_file():
        tok = tokenizers.Tokenizer.from_file(str(file))
        return _HFTokenizer(tok, _eos_token_of(directory, tok, where), where=where, source=directory)
    return _converted(directory, where)


# A hub tokenizer's files: tokenizer.json and its config, or what transformers converts to it (vocab, merges, models).
HUB_TOKENIZER_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


def _converted(directory: Path, where: str) -> Tokenizer:
    """A tokenizer directory without tokenizer.json, converted by transformers (from its vocab or sentencepiece
    model) when it can be."""
    from transformers import AutoTokenizer  # lazily: slow to import, and only such directories need it

    try:
        auto = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError):
        raise DataError(f"{where}: no tokenizer.json in this directory ({directory}), nor files transformers "
                        "makes one from; save a fast tokenizer there "
                        "(AutoTokenizer.from_pretrained(...).save_pretrained(DIR))") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"{where}: has no fast (tokenizer.json) version; jaxtune needs one")
    if auto.eos_token is None:
        raise DataError(f"{where}: the tokenizer defines no eos token")
    return _HFTokenizer(backend, auto.eos_token, where=where, source=directory)


_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _name_specials(directory: Path, tokens: dict[str, str]) -> None:
    """A saved checkpoint tokenizer's config files name ``tokens`` (``{"eos_token": "<|im_end|>"}``) as its special
    tokens: tokenizer_config.json, and special_tokens_map.json where there is one (transformers lets it override
    tokenizer_config.json)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        file = directory / name
        if file.is_file() or name == "tokenizer_config.json":
            file.write_text(json.dumps({**_read_json(file), **tokens}, indent=2) + "\n")


def _special_token(directory: Path, key: str) -> str | None:
    """The token a tokenizer directory's config names as ``key`` (``pad_token``): special_tokens_map.json's, which
    transformers lets override tokenizer_config.json's, else tokenizer_config.json's; None where neither names one."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        token = _read_json(directory / name).get(key)
        if isinstance(token, dict):  # AddedToken serialised as {"content": ..., ...}
            token = token.get("content")
        if isinstance(token, str):
            return token
    return None


def _read_json(file: Path) -> dict[str, Any]:
    """``file``'s JSON object, or {} when there is no such file."""
    return read_json(file, error=DataError) if file.is_file() else {}


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json's (a string, or a list of
    named templates of which "default" is used)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    t = config.get("chat_template")
    if isinstance(t, list):
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t


def render_template(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> str:
    """``template`` rendered as transformers renders chat templates, without a tokenizer's special strings."""
    return _render(template, messages, add_generation_prompt, {}, tools)


def _render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
            specials: dict[str, str], tools: list[dict[str, Any]] | None = None) -> str:
    return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                      **specials)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _jinja_env().from_string(template)


@functools.cache
def _jinja_env():
    """The sandboxed Jinja environment transformers renders chat templates in."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DataError(f"chat template: {message}")

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask markers) renders its body; the
        loss mask is found without it (`jaxtune.data.sft`), so templates with and without markers work alike."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, GenerationTag])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _eos_token_of(directory: Path, tok: tokenizers.Tokenizer, where: str) -> str:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        eos = _read_json(directory / name).get("eos_token")
        if isinstance(eos, dict):  # AddedToken serialised as {"content": ..., ...}
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for name in _KNOWN_EOS:
        if name in specials:
            return name
    raise DataError(
        f"{where}: cannot tell which token ends a document: no eos_token in "
        f"tokenizer_config.json and none of {list(_KNOWN_EOS)} is a special token; "
        f'add {{"eos_token": "..."}} to {directory / "tokenizer_config.json"}'
    )


def _load_tiktoken(name: str) -> Tokenizer:
    try:
        import tiktoken  # optional dependency
    except ImportError:
        raise DataError(f"tokenizer.kind=tiktoken ({name}) needs the tiktoken package: pip install tiktoken") from None
    try:
        encoding = tiktoken.get_encoding(name)
    except ValueError:
        raise DataError(
            f"tokenizer.path={name}: unknown tiktoken encoding; known: {tiktoken.list_encoding_names()}"
        ) from None
    return _TiktokenTokenizer(encoding, name)
