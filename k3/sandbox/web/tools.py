"""The offline web's tools: ``search(query)``, ``open(url)``, ``find(text)``, as an RL agent uses them.

``WebTools`` is stateless and returns plain data (dicts, lists); ``WebSession`` keeps the page an
agent has open, so ``find`` and link numbers refer to it, and returns the text a model reads.

Only URLs of the corpus resolve: ``open`` looks the URL up in a dictionary (after dropping a
``#fragment``), so no path, ``file://`` URL or ``..`` can reach anything outside the corpus.
"""

from __future__ import annotations

import os

from k3.sandbox.web.corpus import Corpus, Page
from k3.sandbox.web.index import SearchIndex, load_or_build

PAGE_CHARS = 6000  # one screen of ``open``: longer pages are read on with ``offset``
SNIPPET_CHARS = 200


class WebError(ValueError):
    """A web tool was asked for something that is not in the offline web (the message says what is)."""


class WebTools:
    """search / open / find over one corpus and its index."""

    def __init__(self, corpus: Corpus, index: SearchIndex) -> None:
        self.corpus = corpus
        self.index = index

    def _page(self, url: str) -> Page:
        if not isinstance(url, str):
            raise WebError(f"a URL is a string like web://py/mod/json, got {type(url).__name__}")
        page = self.corpus.page(url.strip().split("#", 1)[0])
        if page is None:
            raise WebError(f"{url!r} is not a page of the offline web: use URLs from search results or page links "
                           f"(they start with web://py/)")
        return page

    def search(self, query: str, k: int = 5) -> list[dict]:
        """The ``k`` best pages for ``query``: [{"url", "title", "snippet", "score"}]."""
        if not isinstance(query, str) or not query.strip():
            raise WebError("search needs a non-empty query string")
        k = max(1, min(int(k), 20))
        results = []
        for url, score in self.index.search(query, k):
            page = self.corpus.pages[url]
            results.append({"url": url, "title": page.title, "snippet": _snippet(page.text, query), "score": round(score, 3)})
        return results

    def open(self, url: str, offset: int = 0, limit: int = PAGE_CHARS) -> dict:
        """One page: {"url", "title", "text" (from ``offset``, at most ``limit`` characters),
        "offset", "total_chars", "links": [url, ...]}."""
        page = self._page(url)
        offset = max(0, int(offset))
        limit = max(1, min(int(limit), 50_000))
        return {"url": page.url, "title": page.title, "text": page.text[offset : offset + limit], "offset": offset,
                "total_chars": len(page.text), "links": list(page.links)}

    def html(self, url: str) -> str:
        """The page as HTML (links are ``web://py/...`` URLs)."""
        return self._page(url).html

    def find(self, url: str, text: str, max_hits: int = 20) -> list[dict]:
        """Lines of page ``url`` that contain ``text`` (case-insensitive): [{"line", "text"}]."""
        if not isinstance(text, str) or not text:
            raise WebError("find needs a non-empty text to look for")
        needle = text.lower()
        hits = []
        for number, line in enumerate(self._page(url).text.splitlines(), 1):
            if needle in line.lower():
                hits.append({"line": number, "text": line.strip()[:300]})
                if len(hits) >= max_hits:
                    break
        return hits

    def call(self, request: dict) -> dict:
        """One JSON-able request, as the in-sandbox client sends it: {"tool": "search"|"open"|"find", ...}.

        The request comes from a sandbox: every field is range-checked before any work (it runs on
        the host, outside the sandbox's cgroup), and an error is an answer, never an exception."""
        try:
            tool = request.get("tool")
            if tool == "search":
                query = _text_field(request, "query", MAX_QUERY_CHARS)
                if len(set(query.lower().split())) > MAX_QUERY_WORDS:
                    raise WebError(f"a search query has at most {MAX_QUERY_WORDS} distinct words")
                return {"ok": True, "results": self.search(query, _int_field(request, "k", 5, 1, 20))}
            if tool == "open":
                return {"ok": True, "page": self.open(_text_field(request, "url", MAX_URL_CHARS),
                                                      _int_field(request, "offset", 0, 0, 1 << 40),
                                                      _int_field(request, "limit", PAGE_CHARS, 1, 50_000))}
            if tool == "find":
                return {"ok": True, "hits": self.find(_text_field(request, "url", MAX_URL_CHARS),
                                                      _text_field(request, "text", MAX_QUERY_CHARS))}
            return {"ok": False, "error": f"unknown tool {tool!r}: use search, open or find"}
        except (WebError, TypeError, ValueError, OverflowError, KeyError) as error:
            return {"ok": False, "error": str(error)}


MAX_QUERY_CHARS = 1000  # a search query or find text; longer ones cost host CPU and mean nothing
MAX_QUERY_WORDS = 32
MAX_URL_CHARS = 2048


def _text_field(request: dict, name: str, max_chars: int) -> str:
    value = request.get(name, "")
    if not isinstance(value, str):
        raise WebError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise WebError(f"{name} is {len(value)} characters; at most {max_chars} are accepted")
    return value


def _int_field(request: dict, name: str, default: int, low: int, high: int) -> int:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise WebError(f"{name} must be a whole number from {low} to {high}, got {value!r}")
    return value


def _snippet(text: str, query: str) -> str:
    lower = text.lower()
    positions = [lower.find(word) for word in query.lower().split() if lower.find(word) >= 0]
    start = max(0, min(positions) - 60) if positions else 0
    return " ".join(text[start : start + SNIPPET_CHARS].split())


class WebSession:
    """One agent's browser: the open page is remembered; every method returns text for a model."""

    def __init__(self, tools: WebTools) -> None:
        self.tools = tools
        self.url: str | None = None
        self.links: list[str] = []

    def search(self, query: str) -> str:
        try:
            results = self.tools.search(query)
        except WebError as error:
            return f"error: {error}"
        if not results:
            return f"no results for {query!r}"
        self.links = [r["url"] for r in results]  # `open 2` opens the second result
        return "\n".join(f"[{i}] {r['title']} <{r['url']}>\n    {r['snippet']}" for i, r in enumerate(results, 1))

    def open(self, url: str | int, offset: int = 0) -> str:
        """Open a URL, or the link numbered ``url`` in the last listing (search results or page links)."""
        if isinstance(url, int) or (isinstance(url, str) and url.strip().isdigit()):
            number = int(url)
            if not 1 <= number <= len(self.links):
                return f"error: the last listing has links 1..{len(self.links)}, not {number}"
            url = self.links[number - 1]
        try:
            page = self.tools.open(url, offset)
        except WebError as error:
            return f"error: {error}"
        self.url, self.links = page["url"], page["links"]
        end = page["offset"] + len(page["text"])
        more = f"\n[characters {page['offset']}-{end} of {page['total_chars']}; open with offset={end} for more]" \
            if end < page["total_chars"] else ""
        links = "\n".join(f"[{i}] {link}" for i, link in enumerate(page["links"], 1))
        return f"{page['title']} <{page['url']}>\n\n{page['text']}{more}\n\nLinks:\n{links or '(none)'}"

    def find(self, text: str) -> str:
        if self.url is None:
            return "error: no page is open; open one first"
        try:
            hits = self.tools.find(self.url, text)
        except WebError as error:
            return f"error: {error}"
        if not hits:
            return f"{text!r} does not occur on {self.url}"
        return "\n".join(f"line {h['line']}: {h['text']}" for h in hits)


_default: WebTools | None = None


def default_tools(modules: list[str] | None = None, docs: bool = True) -> WebTools:
    """The tools over the standard corpus of this machine (index cached under the sandbox home)."""
    global _default
    if modules is None and docs and _default is not None:
        return _default
    from k3.sandbox.paths import sandbox_home

    corpus, index = load_or_build(os.path.join(sandbox_home(), "web"), modules, docs)
    tools = WebTools(corpus, index)
    if modules is None and docs:
        _default = tools
    return tools
