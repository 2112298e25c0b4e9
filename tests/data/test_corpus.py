import json
from pathlib import Path

import pytest

from k3.data.corpus import default_corpus_files, load_corpus, split_validation, stdlib_directory


def test_default_corpus_is_the_stdlib_without_site_packages():
    files = default_corpus_files()
    assert len(files) > 100
    names = {p.name for p in files}
    assert "os.py" in names and "topics.py" in names  # sources and pydoc's bundled docs
    assert all("site-packages" not in p.parts for p in files)
    assert all(str(p).startswith(str(stdlib_directory())) or "share" in p.parts for p in files)


def test_capped_default_corpus_and_split_are_deterministic():
    docs = load_corpus(max_bytes=300_000)
    assert 300_000 <= sum(len(d.text.encode()) for d in docs) < 300_000 + max(len(d.text.encode()) for d in docs) + 1
    again = load_corpus(max_bytes=300_000)
    assert [d.source for d in docs] == [d.source for d in again]
    train, val = split_validation(docs, 0.2)
    assert train and val
    assert not {d.source for d in train} & {d.source for d in val}
    assert len(train) + len(val) == len(docs)


def test_user_files_txt_jsonl_parquet_and_directories(tmp_path: Path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "line one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["row a", "row b", ""]}), tmp_path / "c.parquet")
    docs = load_corpus([tmp_path])
    assert sorted(d.text for d in docs) == ["first document", "line one", "row a", "row b", "two"]
    assert [d.text for d in load_corpus([tmp_path / "a.txt"])] == ["first document"]


def test_missing_data_path_says_what_to_do(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist.*--data"):
        load_corpus([tmp_path / "nope.txt"])


def test_unreadable_data_file(tmp_path: Path, monkeypatch):
    path = tmp_path / "a.txt"
    path.write_text("x")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(FileNotFoundError, match="cannot read data file .*a.txt: Permission denied"):
        load_corpus([path])


def test_empty_corpus_is_an_error(tmp_path: Path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="corpus is empty"):
        load_corpus([tmp_path])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="holds no .txt"):
        load_corpus([tmp_path / "other"])


def test_bad_jsonl_lines(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text("{not json}\n")
    with pytest.raises(ValueError, match=r"a.jsonl:1 is not valid JSON"):
        load_corpus([tmp_path / "a.jsonl"])
    (tmp_path / "b.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="no string \"text\" field"):
        load_corpus([tmp_path / "b.jsonl"])
