"""The offline web: pages, index and tools; reachable in a network-less sandbox; nothing outside it."""

import json
import os

import pytest

from k3.sandbox.web.corpus import build_corpus, doc_pages, module_url, source_url
from k3.sandbox.web.index import SearchIndex, load_or_build
from k3.sandbox.web.tools import WebSession, WebTools

MODULES = ["json", "json.decoder", "json.encoder", "json.scanner", "re", "collections", "_collections_abc", "codecs",
           "encodings", "encodings.utf_8", "heapq", "bisect", "string", "textwrap"]


@pytest.fixture(scope="module")
def tools():
    corpus = build_corpus(MODULES, docs=False)
    return WebTools(corpus, SearchIndex.build(corpus))


def test_module_pages_state_imports_classes_and_link_to_their_source(tools):
    page = tools.open(module_url("json.decoder"))
    assert "class JSONDecoder(object)" in page["text"] and "raw_decode" in page["text"]
    assert module_url("json.scanner") in page["links"] and source_url("json.decoder") in page["links"]
    assert '<a href="web://py/mod/json.scanner">' in tools.html(module_url("json.decoder"))


def test_search_ranks_the_page_that_names_the_query_first(tools):
    assert tools.search("heap queue algorithm heappush")[0]["url"] == module_url("heapq")
    assert tools.search("JSONDecoder raw_decode")[0]["url"] == module_url("json.decoder")
    assert tools.search("zzzzqqqq") == []


def test_find_returns_the_matching_lines(tools):
    hits = tools.find(source_url("bisect"), "def insort_left")
    assert hits and all("def insort_left" in hit["text"] for hit in hits)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "/etc/passwd", "web://py/mod/../../../../etc/passwd",
                                 "web://py/src/os", "http://127.0.0.1:80/", "web://py/mod/json\x00", ""])
def test_nothing_outside_the_corpus_can_be_opened(tools, url):
    answer = tools.call({"tool": "open", "url": url})
    assert not answer["ok"] and "not a page of the offline web" in answer["error"]


def test_a_request_of_the_wrong_shape_is_an_error_not_a_crash(tools):
    assert not tools.call({"tool": "open", "url": ["web://py/mod/json"]})["ok"]
    assert not tools.call({"tool": "rm -rf /"})["ok"]
    assert not tools.call({"tool": "find", "url": module_url("json"), "text": ""})["ok"]


def test_a_session_opens_results_and_links_by_number(tools):
    session = WebSession(tools)
    assert "Module json.decoder" in session.search("JSONDecoder raw_decode")
    assert session.open(1).startswith("Module json.decoder")
    assert "line" in session.find("raw_decode")
    assert session.open(99).startswith("error:")


def test_documentation_pages_keep_their_text_and_internal_links(tmp_path):
    library = tmp_path / "library"
    library.mkdir()
    body = ('<html><head><title>demo \u2014 A demo module \u2014 Python 3.x documentation</title></head><body>'
            '<div class="related">nav</div><div class="body" role="main"><h1>demo</h1><p>Text of <a href="other.html#x">'
            'other</a> and <a href="https://example.org/">out</a>.</p><script>ignored()</script></div>'
            '<div class="sphinxsidebar">sidebar</div></body></html>')
    (library / "demo.html").write_text(body)
    (library / "other.html").write_text(body.replace("demo", "other"))
    pages = {page.url: page for page in doc_pages(str(tmp_path))}
    demo = pages["web://py/docs/library/demo.html"]
    assert demo.title == "demo \u2014 A demo module"
    assert "Text of other and out." in demo.text and "ignored" not in demo.text and "sidebar" not in demo.text
    assert demo.links == ["web://py/docs/library/other.html"]


def test_the_index_is_built_once_and_cached(tmp_path):
    first_corpus, _ = load_or_build(str(tmp_path), ["heapq", "bisect", "string", "textwrap"], docs=False)
    [cached] = os.listdir(tmp_path)
    mtime = os.stat(tmp_path / cached).st_mtime_ns
    corpus, index = load_or_build(str(tmp_path), ["heapq", "bisect", "string", "textwrap"], docs=False)
    assert os.stat(tmp_path / cached).st_mtime_ns == mtime
    assert set(corpus.pages) == set(first_corpus.pages) and index.search("heappush")[0][0] == module_url("heapq")


def test_the_web_is_reachable_inside_a_sandbox_without_a_network(box, tools):
    box.enable_web(tools)
    result = box.exec("web search heap queue heappush")
    assert result.ok and module_url("heapq") in result.stdout.splitlines()[0], result.stderr
    opened = box.exec(["web", "open", module_url("bisect")])
    assert opened.ok and "def insort_left" in opened.stdout
    interfaces = [line.split(":")[0].strip() for line in box.read_file("/proc/net/dev").decode().splitlines()[2:]]
    assert interfaces == ["lo"]  # still no network device but a loopback that is down


def test_the_web_from_inside_reaches_no_host_file(box, tools, tmp_path):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only")
    box.enable_web(tools)
    for url in (f"file://{secret}", str(secret), f"web://py/mod/../../..{secret}"):
        result = box.exec(["web", "open", url])
        assert result.exit_code == 1 and "host only" not in result.stdout + result.stderr
        assert "not a page of the offline web" in result.stderr


def test_the_web_relay_survives_restore_and_fork(box, tools):
    box.enable_web(tools)
    snapshot = box.snapshot()
    box.restore(snapshot)
    assert box.exec("web search heappush").ok
    [branch] = box.fork(snapshot)
    try:
        assert branch.exec("web search heappush").ok
    finally:
        branch.close()


def test_a_garbage_frame_to_the_relay_does_not_break_it(box, tools):
    box.enable_web(tools)
    box.write_file("/tmp/garbage.py", "import socket, struct\ns = socket.socket(socket.AF_UNIX)\n"
                   "s.connect('/run/k3/web.sock')\ns.sendall(struct.pack('<I', 9) + b'not json!')\n"
                   "print(s.recv(1000))\ns.close()\n"
                   "s = socket.socket(socket.AF_UNIX)\ns.connect('/run/k3/web.sock')\n"
                   "s.sendall(struct.pack('<I', 1 << 30))\ns.close()\n")
    result = box.exec("python3 /tmp/garbage.py")
    assert result.ok and b"bad request" in result.stdout_bytes
    assert box.exec("web search heappush").ok  # still serving


def test_the_cache_is_json_and_a_pickle_in_its_place_is_never_read(tmp_path):
    """Reading a pickle runs the code it names; the cache is JSON, and a file of another kind where it lies is
    rebuilt over, never executed."""
    import pickle

    modules = ["heapq", "bisect", "string", "textwrap"]  # BM25 gives a term in half of two pages no weight
    corpus, _ = load_or_build(str(tmp_path), modules, docs=False)
    [cached] = os.listdir(tmp_path)
    assert cached.endswith(".json") and json.loads((tmp_path / cached).read_text())["source"] == corpus.source
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / cached).write_bytes(pickle.dumps(Payload()))
    rebuilt, index = load_or_build(str(tmp_path), modules, docs=False)
    assert not marker.exists() and set(rebuilt.pages) == set(corpus.pages)
    assert rebuilt.modules == corpus.modules and index.search("heappush")[0][0] == module_url("heapq")
