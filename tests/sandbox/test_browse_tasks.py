"""The browse suite: multi-hop, verifiable from the pages it names, deterministic, split by module."""

import pytest

from k3.sandbox.web.corpus import build_corpus, stdlib_modules, stdlib_dir
from k3.sandbox.web.tasks import all_browse_tasks, check_answer, generate_browse_tasks, normalize_answer

PACKAGES = ("json", "email", "encodings", "collections", "importlib", "concurrent", "logging", "http", "xml", "urllib")
TOP = ["re", "codecs", "os", "stat", "posixpath", "genericpath", "functools", "abc", "types", "io", "string",
       "heapq", "bisect", "warnings", "keyword", "operator", "reprlib", "_collections_abc", "copy", "weakref",
       "numbers", "quopri", "token", "tokenize", "calendar", "datetime", "locale", "enum", "socket", "selectors", "threading", "queue", "base64"]


@pytest.fixture(scope="module")
def corpus():
    found = stdlib_modules(stdlib_dir())
    names = [m for m in found if m.split(".")[0] in PACKAGES] + [m for m in TOP if m in found]
    return build_corpus(sorted(set(names)), docs=False)


def test_every_kind_is_generated_and_needs_two_pages(corpus):
    tasks = all_browse_tasks(corpus)
    assert {task["kind"] for task in tasks} == {"base_method", "import_constant", "import_default", "import_most",
                                                "compare_classes"}
    assert all(task["hops"] == len(task["pages"]) >= 2 and task["start"] == task["pages"][0] for task in tasks)


def test_each_answer_is_stated_on_the_pages_it_cites(corpus):
    for task in all_browse_tasks(corpus):
        pages = [corpus.pages[url] for url in task["pages"]]
        assert all(page is not None for page in pages)
        if task["kind"] in ("base_method", "import_constant", "import_default"):
            assert task["answer"] in pages[-1].text, task  # read off the last page
            assert task["pages"][-1] in pages[0].links, task  # reached through a link of the first
        else:
            assert task["answer"] in {page.url.rsplit("/", 1)[-1] for page in pages}, task


def test_answers_are_recomputed_from_the_module_facts(corpus):
    for task in all_browse_tasks(corpus):
        if task["kind"] == "import_most":
            imports = [url.rsplit("/", 1)[-1] for url in task["pages"][1:]]
            best = max(imports, key=lambda name: len(corpus.modules[name].functions))
            assert task["answer"] == best
        if task["kind"] == "compare_classes":
            a, b = (url.rsplit("/", 1)[-1] for url in task["pages"])
            assert task["answer"] == (a if len(corpus.modules[a].classes) > len(corpus.modules[b].classes) else b)


def test_generation_is_deterministic_and_the_splits_do_not_share_a_start(corpus):
    train = generate_browse_tasks(20, seed=3, split="train", corpus=corpus)
    assert train == generate_browse_tasks(20, seed=3, split="train", corpus=corpus)
    assert train != generate_browse_tasks(20, seed=4, split="train", corpus=corpus)
    test = [task for task in all_browse_tasks(corpus) if task["split"] == "test"]
    assert test and {t["start"] for t in train}.isdisjoint({t["start"] for t in test})
    assert len({task["kind"] for task in train}) >= 4  # kinds are interleaved


def test_asking_for_more_tasks_than_exist_says_how_many_there_are(corpus):
    with pytest.raises(ValueError, match="browse tasks, fewer than"):
        generate_browse_tasks(10**6, split="test", corpus=corpus)
    with pytest.raises(ValueError, match="split must be"):
        generate_browse_tasks(1, split="validation", corpus=corpus)


def test_check_answer_accepts_formatting_and_rejects_other_answers():
    task = {"answer": "'utf-8'"}
    assert check_answer(task, " `utf-8`. ") and check_answer(task, '"utf-8"') and check_answer(task, "'utf-8'")
    assert not check_answer(task, "utf-16") and not check_answer(task, "")
    assert normalize_answer("  json.decoder.  ") == "json.decoder"


def _links_on(text: str) -> list[str]:
    return [part.split(">")[0] for part in text.split("<web://")[1:] if "/mod/" in part.split(">")[0]]


def _solve(tools, task):
    """A scripted reader: only open() and the text a model would see, never the corpus facts."""
    prompt = task["prompt"]
    names = prompt.split("`")[1::2]
    start = tools.open(task["start"], limit=50_000)["text"]
    if task["kind"] == "base_method":
        line = next(l for l in start.splitlines() if l.strip().startswith(f"class {names[1]}("))
        base_url = "web://" + _links_on(line)[0]
        base_name = line.split("(", 1)[1].split(" ")[0].split(",")[0].rstrip(")").rsplit(".", 1)[-1]
        lines = tools.open(base_url, limit=50_000)["text"].splitlines()
        at = next(i for i, l in enumerate(lines) if l.strip().startswith(f"class {base_name}("))
        return lines[at + 1].split(":", 1)[1].split(",")[0].strip()
    imports = ["web://" + url for url in _links_on(start.split("Imports", 1)[1].split("\n\n", 1)[0])] if "Imports" in start else []
    if task["kind"] == "import_constant":
        for url in imports:
            for line in tools.open(url, limit=50_000)["text"].splitlines():
                if line.startswith(f"  {names[1]} = "):
                    return line.split(" = ", 1)[1]
    if task["kind"] == "import_default":
        for url in imports:
            for line in tools.open(url, limit=50_000)["text"].splitlines():
                if line.startswith(f"  def {names[1]}("):
                    for param in line.split("(", 1)[1].rsplit(")", 1)[0].split(", "):
                        if param.startswith(names[2] + "="):
                            return param.split("=", 1)[1]
    if task["kind"] == "import_most":
        def count(url):
            text = tools.open(url, limit=50_000)["text"]
            return int(text.split("Functions (", 1)[1].split()[0]) if "Functions (" in text else 0
        return max(imports, key=count).rsplit("/", 1)[-1]
    if task["kind"] == "compare_classes":
        def classes(name):
            return sum(1 for l in tools.open(f"web://py/mod/{name}", limit=50_000)["text"].splitlines() if l.startswith("  class "))
        return names[0] if classes(names[0]) > classes(names[1]) else names[1]
    return None


def test_a_scripted_reader_answers_every_task_through_the_tools(corpus):
    from k3.sandbox.web.index import SearchIndex
    from k3.sandbox.web.tools import WebTools

    tools = WebTools(corpus, SearchIndex.build(corpus))
    tasks = all_browse_tasks(corpus)
    wrong = [(task["prompt"], task["answer"], _solve(tools, task)) for task in tasks if not check_answer(task, _solve(tools, task) or "")]
    assert not wrong, wrong[:3]
