import importlib.util
import json
import shutil
import sys
import types

import pytest

from jaxtune.config import DataConfig, TokenizerConfig
from jaxtune.data import DataError, load_tokenizer, load_tokenizer_dir
from jaxtune.data import tokenizer as tokenizer_module

TEXT = "naïve café — 日本語 🙂\n\tdef f(x):\n        return x ** 2  # done\r\n"
BPE = TokenizerConfig(kind="bpe", vocab_size=512, train_bytes=100_000)


@pytest.fixture(scope="module")
def data_cfg(tmp_path_factory):
    return DataConfig(max_bytes=200_000, cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def bpe(data_cfg):
    return load_tokenizer(BPE, data_cfg)


def test_bpe_trains_to_vocab_size_and_round_trips(bpe):
    assert bpe.vocab_size == 512
    ids = bpe.encode(TEXT)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert len(ids) < len(TEXT.encode())  # merges were learned (byte-level alone would be one id per byte)
    assert bpe.decode(ids) == TEXT
    assert bpe.encode_batch([TEXT, "x"]) == [ids, bpe.encode("x")]
    assert bpe.decode([bpe.eos_id]) == "<|endoftext|>"
    # The literal separator in text is text, not the eos id that the pipeline reserves for separators.
    assert bpe.eos_id not in bpe.encode("a <|endoftext|> b")


def test_bpe_is_cached(bpe, data_cfg, monkeypatch):
    def no_training(*args):
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(tokenizer_module, "_train_bpe", no_training)
    again = load_tokenizer(BPE, data_cfg)
    assert again.fingerprint == bpe.fingerprint
    with pytest.raises(AssertionError, match="retrained"):  # a different vocab_size is a different tokenizer
        load_tokenizer(BPE.model_copy(update={"vocab_size": 300}), data_cfg)


def test_bpe_training_is_deterministic(bpe, data_cfg, tmp_path):
    # Hosts of a multi-host run each train their own copy: they must agree.
    other = load_tokenizer(BPE, data_cfg.model_copy(update={"cache_dir": str(tmp_path)}))
    assert other.fingerprint == bpe.fingerprint


def test_save_and_load_dir(bpe, tmp_path):
    bpe.save(tmp_path / "tokenizer")
    loaded = load_tokenizer_dir(tmp_path / "tokenizer")
    assert (loaded.fingerprint, loaded.eos_id, loaded.vocab_size) == (bpe.fingerprint, bpe.eos_id, bpe.vocab_size)
    assert loaded.encode(TEXT) == bpe.encode(TEXT)
    with pytest.raises(DataError, match="not a saved jaxtune tokenizer"):
        load_tokenizer_dir(tmp_path)


def test_another_eos_is_another_tokenizer(bpe, tmp_path):
    """The token cache is keyed by the fingerprint and separates documents with the EOS: a tokenizer saved naming
    another EOS (a chat export's end of turn) splits text alike but must not reuse the first one's cached windows."""
    other_id = next(i for i in range(bpe.vocab_size) if i != bpe.eos_id)
    bpe.save(tmp_path / "renamed", eos_id=other_id)
    renamed = load_tokenizer_dir(tmp_path / "renamed")
    assert renamed.eos_id == other_id and renamed.encode(TEXT) == bpe.encode(TEXT)
    assert renamed.fingerprint != bpe.fingerprint


def test_hf_tokenizer_directory(bpe, data_cfg, tmp_path):
    bpe.save(tmp_path / "saved")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    shutil.copy(tmp_path / "saved" / "tokenizer.json", hf_dir)  # a bare tokenizer.json: eos found by name
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), data_cfg)
    assert (tok.eos_id, tok.vocab_size, tok.encode(TEXT)) == (bpe.eos_id, bpe.vocab_size, bpe.encode(TEXT))

    # tokenizer_config.json, when present, says which token is eos.
    other_eos = bpe.decode([300])
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": other_eos}}))
    assert load_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), data_cfg).eos_id == 300

    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer.path=.*: no tokenizer.json in this directory"):
        load_tokenizer(TokenizerConfig(kind="hf", path=str(hf_dir)), data_cfg)


@pytest.mark.skipif(importlib.util.find_spec("tiktoken") is not None, reason="tiktoken is installed")
def test_tiktoken_missing_says_what_to_install(data_cfg):
    with pytest.raises(DataError, match="pip install tiktoken"):
        load_tokenizer(TokenizerConfig(kind="tiktoken", path="gpt2"), data_cfg)


def test_tiktoken_wrapper_saves_by_name(bpe, data_cfg, tmp_path, monkeypatch):
    # tiktoken downloads its encodings, so stand one in: a byte-per-id encoding with eot 256.
    class ByteEncoding:
        eot_token, n_vocab = 256, 257

        def encode_ordinary_batch(self, texts):
            return [list(t.encode()) for t in texts]

        def decode(self, ids):
            return bytes(ids).decode()

    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: ByteEncoding() if name == "bytes" else (_ for _ in ()).throw(ValueError(name))
    fake.list_encoding_names = lambda: ["bytes"]
    monkeypatch.setitem(sys.modules, "tiktoken", fake)

    tok = load_tokenizer(TokenizerConfig(kind="tiktoken", path="bytes"), data_cfg)
    assert (tok.eos_id, tok.vocab_size, tok.decode(tok.encode(TEXT))) == (256, 257, TEXT)
    tok.save(tmp_path)
    loaded = load_tokenizer_dir(tmp_path)
    assert (loaded.fingerprint, loaded.eos_id) == (tok.fingerprint, 256)
    with pytest.raises(DataError, match=r"unknown tiktoken encoding; known: \['bytes'\]"):
        load_tokenizer(TokenizerConfig(kind="tiktoken", path="gpt9"), data_cfg)


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
         "{% else %}{% set role = m['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim "
         "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@pytest.mark.parametrize("template,in_file", [(CHATML, False), (GEMMA, True)])
def test_checkpoint_chat_template_matches_transformers(tmp_path, template, in_file):
    """A checkpoint's chat template (tokenizer_config.json or chat_template.jinja) renders exactly as
    transformers' apply_chat_template, offline, and survives save/load (a run's tokenizer directory)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models as tok_models

    from jaxtune.config import TokenizerConfig
    from jaxtune.data.tokenizer import load_tokenizer, load_tokenizer_dir

    vocab = {t: i for i, t in enumerate(["<eos>", "<bos>", "<|im_start|>", "<|im_end|>", "a", "b"])}
    raw = RawTokenizer(tok_models.WordLevel(vocab, unk_token="a"))
    raw.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "bos_token": "<bos>"}
    if in_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)), None)
    for gen in (False, True):
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    tok.save(tmp_path / "saved")
    again = load_tokenizer_dir(tmp_path / "saved")
    assert again.apply_chat_template(messages, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
