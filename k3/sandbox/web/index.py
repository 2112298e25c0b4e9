"""The search index of the offline web: BM25 (Okapi, from ``rank_bm25``) over module and doc pages.

Source pages are not indexed (they are reached through the module pages' links): a module page
already names every class, function and constant of its source. Titles count three times.
The corpus is built once and cached on disk as JSON (``load_or_build``), keyed by where it came from; the index
is rebuilt from it on load (0.4 s for the standard library's 1,495 pages, where building the corpus takes 7 s).
JSON and not pickle: reading a pickle runs whatever code it names, and a cache is a file like any other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass

from k3.sandbox.web.corpus import ClassFacts, Corpus, ModuleFacts, Page, build_corpus, docs_dir, stdlib_dir

TOKEN = re.compile(r"[a-z0-9]+")
FORMAT = 2  # bump when the corpus layout changes: old caches are then ignored (2: JSON, was a pickle)


def tokenize(text: str) -> list[str]:
    """Lower-case alphanumeric runs: ``json.JSONDecoder`` -> ["json", "jsondecoder"]."""
    return TOKEN.findall(text.lower())


@dataclass
class SearchIndex:
    urls: list[str]
    bm25: object  # rank_bm25.BM25Okapi

    @staticmethod
    def build(corpus: Corpus) -> "SearchIndex":
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as error:  # pragma: no cover - rank-bm25 is in k3's test extra
            raise ImportError("the offline web's index needs rank-bm25: pip install rank-bm25") from error
        urls = sorted(url for url, page in corpus.pages.items() if page.kind != "source")
        documents = []
        for url in urls:
            page = corpus.pages[url]
            documents.append(tokenize(page.title) * 3 + tokenize(page.text))
        return SearchIndex(urls, BM25Okapi(documents))

    def search(self, query: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` best (url, score) for ``query``; pages with no query term are left out."""
        tokens = tokenize(query)
        if not tokens or not self.urls:
            return []
        scores = self.bm25.get_scores(tokens)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], self.urls[i]))
        return [(self.urls[i], float(scores[i])) for i in order[:k] if scores[i] > 0]


def _cache_key(modules: list[str] | None, docs: bool) -> str:
    root = stdlib_dir()
    parts = [str(FORMAT), root, str(os.stat(root).st_mtime_ns), ",".join(modules or ["*"])]
    docs_root = docs_dir() if docs else None
    if docs_root:
        parts += [docs_root, str(os.stat(os.path.join(docs_root, "library")).st_mtime_ns)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def load_or_build(cache_dir: str | None, modules: list[str] | None = None, docs: bool = True) -> tuple[Corpus, SearchIndex]:
    """The corpus and its index, the corpus from ``cache_dir`` when built before, else built and saved there."""
    path = os.path.join(cache_dir, f"web-{_cache_key(modules, docs)}.json") if cache_dir else None
    corpus = _read_corpus(path) if path and os.path.exists(path) else None
    if corpus is None:
        corpus = build_corpus(modules, docs=docs)
        if path:
            from pathlib import Path

            from k3.atomic import atomic_write_bytes

            atomic_write_bytes(Path(path), json.dumps(dataclasses.asdict(corpus)).encode())
    return corpus, SearchIndex.build(corpus)


def _read_corpus(path: str) -> Corpus | None:
    """The cached corpus, or None for a file that is damaged or of another layout (then it is built again)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
        modules = {}
        for name, facts in data["modules"].items():
            facts = dict(facts)
            facts["functions"] = {f: [tuple(p) for p in ps] for f, ps in facts["functions"].items()}
            facts["classes"] = {c: ClassFacts(**k) for c, k in facts["classes"].items()}
            modules[name] = ModuleFacts(**facts)
        return Corpus({url: Page(**page) for url, page in data["pages"].items()}, modules, data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
