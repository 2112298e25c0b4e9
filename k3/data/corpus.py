"""Text corpora: the default one found on this machine (no download) and user files.

The default corpus is the CPython standard library's own source files plus the documentation that ships with
the interpreter (pydoc's topic texts live in `pydoc_data/topics.py`; some installs also carry .txt/.rst docs or
a `share/doc/python*` folder). Third-party packages (site-packages) and the regression-test folders are left
out: the first is not CPython's text, the second is mostly machine-generated fixtures.

User data (`--data`): .txt files, .jsonl files (one JSON object per line with a "text" field), .parquet files
(a "text" column) and directories holding any of those. Each file line / row is one document, except .txt
where the whole file is one document.

The validation split is by document, chosen by a hash of the document's source name, so it does not change
when files are added elsewhere in the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}
_DOC_SUFFIXES = (".txt", ".rst")


@dataclass
class Document:
    source: str  # file path, plus ":line" / ":row" for multi-document files
    text: str


def stdlib_directory() -> Path:
    """Where this interpreter's standard library lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_corpus_files() -> list[Path]:
    """The stdlib's .py sources and bundled docs, in a stable (sorted) order. No network, nothing installed."""
    root = stdlib_directory()
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_STDLIB_DIRS)
        for name in sorted(names):
            if name.endswith(".py") or name.endswith(_DOC_SUFFIXES):
                files.append(Path(directory) / name)
    # Documentation trees that some installs ship next to the interpreter; absent on many machines.
    for prefix in sorted({sys.prefix, sys.base_prefix}):
        share = Path(prefix) / "share" / "doc"
        if share.is_dir():
            for doc_dir in sorted(share.glob("python*")):
                files.extend(sorted(p for p in doc_dir.rglob("*") if p.suffix in _DOC_SUFFIXES and p.is_file()))
    return files


# Share of characters that are not text (bytes that are not UTF-8, control characters) past which a data file
# is refused as binary: random bytes give about 60%, Latin-1 prose read as UTF-8 a few percent.
MAX_NON_TEXT_FRACTION = 0.1


def _read_text_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise FileNotFoundError(f"cannot read data file {path}: {error.strerror or error}") from error
    sample = text[:1 << 20]
    non_text = sum(1 for c in sample if c == "\ufffd" or (c < " " and c not in "\t\n\r\f\v"))
    if sample and non_text > MAX_NON_TEXT_FRACTION * len(sample):
        raise ValueError(f"data file {path} does not look like text: {100 * non_text / len(sample):.0f}% of its "
                         f"first {len(sample):,} characters are not UTF-8 text (a binary file?); k3 trains on "
                         f"UTF-8 .txt, .jsonl or .parquet text")
    return text


def _read_jsonl(path: Path) -> list[Document]:
    docs = []
    for number, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not valid JSON ({error.msg}); .jsonl files need one JSON "
                             f"object per line with a \"text\" field") from error
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{number} has no string \"text\" field; .jsonl lines must look like "
                             f"{{\"text\": \"...\"}}")
        docs.append(Document(f"{path}:{number}", record["text"]))
    return docs


def _read_parquet(path: Path) -> list[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise RuntimeError(f"reading {path} needs pyarrow; install it with `pip install pyarrow`, or convert "
                           f"the data to .jsonl") from error
    try:
        table = pq.read_table(path, columns=["text"])
    except (OSError, KeyError, ValueError) as error:
        raise ValueError(f"cannot read a \"text\" column from parquet file {path}: {error}") from error
    return [Document(f"{path}:{i}", text) for i, text in enumerate(table.column("text").to_pylist())
            if isinstance(text, str)]


def expand_data_paths(paths: list[str | os.PathLike]) -> list[Path]:
    """Files named directly, plus the .txt/.jsonl/.parquet files under named directories (sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
            if not found:
                raise ValueError(f"data directory {path} holds no {'/'.join(DATA_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in DATA_SUFFIXES + (".py", ".rst"):
                raise ValueError(f"data file {path} has suffix {path.suffix!r}; use one of "
                                 f"{', '.join(DATA_SUFFIXES)} (or a directory of them)")
            files.append(path)
        else:
            raise FileNotFoundError(f"data path {path} does not exist; pass existing files or directories "
                                    f"with --data, or leave --data out to use the default corpus")
    return files


def read_documents(files: list[Path]) -> list[Document]:
    """One Document per text file, per .jsonl line and per parquet row; empty documents are dropped."""
    docs: list[Document] = []
    for path in files:
        if path.suffix == ".jsonl":
            docs.extend(_read_jsonl(path))
        elif path.suffix == ".parquet":
            docs.extend(_read_parquet(path))
        else:
            docs.append(Document(str(path), _read_text_file(path)))
    return [d for d in docs if d.text.strip()]


def load_corpus(data: list[str | os.PathLike] | None = None, max_bytes: int | None = None) -> list[Document]:
    """The documents of `data` (or of the default corpus when None), at most `max_bytes` of text in total.

    With a cap, documents are taken in a fixed hash order so the sample spreads over the whole corpus."""
    if data:
        files = expand_data_paths(list(data))
        where = ", ".join(str(p) for p in data)
    else:
        files = default_corpus_files()
        where = f"the standard library at {stdlib_directory()}"
    if max_bytes is not None:
        files = sorted(files, key=lambda p: _stable_hash(str(p)))
    docs: list[Document] = []
    total = 0
    for path in files:
        for doc in read_documents([path]):
            if max_bytes is not None and total >= max_bytes:
                break
            docs.append(doc)
            total += len(doc.text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            break
    if not docs:
        raise ValueError(f"the corpus is empty: no non-empty text found in {where}; pass --data with .txt, "
                         f".jsonl (\"text\" field) or .parquet files that contain text")
    return docs


def _stable_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:8], "little")


def split_validation(docs: list[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, validation): a document goes to validation when the hash of its source falls below `fraction`.
    Always keeps at least one document on each side when there are two or more."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must be in (0, 1), got {fraction}")
    if len(docs) < 2:
        raise ValueError(f"the corpus has {len(docs)} document(s); at least 2 are needed to hold one out for "
                         f"validation")
    threshold = fraction * 2**64
    # Salted: the corpus cap orders files by the unsalted hash, and the split must not follow that order.
    held_out = [_stable_hash("validation:" + d.source) < threshold for d in docs]
    val = [d for d, out in zip(docs, held_out) if out]
    train = [d for d, out in zip(docs, held_out) if not out]
    if not val:
        val, train = [train[-1]], train[:-1]
    if not train:
        train, val = [val[-1]], val[:-1]
    return train, val
