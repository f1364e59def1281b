import importlib.util
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtune.config import DataConfig
from jaxtune.data import DataError, iter_documents, sources_fingerprint


def _docs(*sources, **kw):
    return list(iter_documents(DataConfig(sources=[str(s) for s in sources], **kw)))


def test_stdlib_is_real_python_and_stops_at_max_bytes():
    docs = _docs("python-stdlib", max_bytes=200_000)
    total = sum(len(d.encode()) for d in docs)
    assert 200_000 - 4 < total <= 200_000  # the last document is cut, at most mid-character
    compile(docs[0], "<stdlib>", "exec")  # whole files, unmodified: the first one is valid Python
    assert any("def " in d for d in docs) and any("import " in d for d in docs)
    assert docs == _docs("python-stdlib", max_bytes=200_000)  # deterministic order


def test_directory_reads_known_suffixes_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "b" / "c.md").write_text("# gamma")
    (tmp_path / "b" / "d.py").write_text("delta = 1\n")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")  # latin-1, not UTF-8: skipped under bad_rows=drop
    (tmp_path / "empty.txt").write_text("  \n")  # whitespace-only documents are dropped
    (tmp_path / "notes.bin").write_text("not data")  # unknown suffix: skipped in a directory
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("hidden")
    # Sorted by path components: b/c.md comes before bad.txt.
    assert _docs(tmp_path, bad_rows="drop") == ["alpha", "# gamma", "delta = 1\n"]


def test_glob_and_single_file(tmp_path):
    for name, text in [("x1.txt", "one"), ("x2.txt", "two"), ("y.txt", "why")]:
        (tmp_path / name).write_text(text)
    assert _docs(tmp_path / "x*.txt") == ["one", "two"]
    assert _docs(tmp_path / "y.txt", tmp_path / "x1.txt") == ["why", "one"]  # entries keep config order


def test_text_file_splits_on_endoftext(tmp_path):
    (tmp_path / "stories.txt").write_text("Once upon a time.\n<|endoftext|>\nThe end.\n<|endoftext|>\n")
    assert _docs(tmp_path / "stories.txt") == ["Once upon a time.", "The end."]


def test_jsonl_json_and_parquet(tmp_path):
    lines = [{"content": "first"}, {"content": "héllo wörld", "id": 2}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps([{"content": "from an array"}]))
    pq.write_table(pa.table({"content": ["p1", None, "p2"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    assert _docs(tmp_path, text_field="content") == ["first", "héllo wörld", "from an array", "p1", "p2"]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: not valid JSON"):
        _docs(bad)
    bad.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    with pytest.raises(DataError, match=rf"{bad}:3: no 'text' field .*\['body'\].*data.text_field"):
        _docs(bad)


def test_parquet_missing_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet: no column 'text' \(columns: \['body'\]\)"):
        _docs(tmp_path / "d.parquet")


def test_missing_path_and_empty_glob(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    with pytest.raises(DataError, match=r"data.sources\[1\]: no such file or directory: .*nope.txt; give a file"):
        _docs(tmp_path / "a.txt", tmp_path / "nope.txt")
    with pytest.raises(DataError, match=r"data.sources\[0\]: no such file or directory: .*\*.jsonl"):
        _docs(tmp_path / "*.jsonl")


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="data.sources produced no text"):
        _docs(tmp_path / "empty.txt")


def test_fingerprint_tracks_files_and_settings(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one")
    cfg = DataConfig(sources=[str(f)])
    first = sources_fingerprint(cfg)
    assert sources_fingerprint(cfg) == first
    assert sources_fingerprint(DataConfig(sources=[str(f)], max_bytes=2)) != first
    assert sources_fingerprint(DataConfig(sources=[str(f)], text_field="body")) != first
    f.write_text("two")
    os.utime(f, ns=(1, 1))  # a rewrite of the same size must count too
    assert sources_fingerprint(cfg) != first
    assert sources_fingerprint(DataConfig()) == sources_fingerprint(DataConfig())


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed")
def test_hf_source_without_datasets_says_what_to_install():
    with pytest.raises(DataError, match=r"hf:roneneldan/TinyStories needs .*pip install 'jaxtune\[hf\]'"):
        _docs("hf:roneneldan/TinyStories")


def test_hf_source_that_cannot_be_had_is_one_line_at_once(monkeypatch, tmp_path):
    """An hf: dataset with the hub out of reach (here HF_HUB_OFFLINE, so no request leaves) and not in the datasets
    cache: one DataError naming the source and the ways on, without datasets' retries (~30 s of them before)."""
    pytest.importorskip("datasets")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DataError) as e:
        _docs("hf:jaxtune-tests/no-such-dataset")
    message = str(e.value)
    assert message.startswith("data.sources: hf:jaxtune-tests/no-such-dataset: HF_HUB_OFFLINE is set and it is not "
                              "in the datasets cache; pass local files") and "\n" not in message
