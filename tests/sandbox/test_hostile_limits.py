"""Limits for every resource: disk, inodes, open files, directory depth, sparse files, REPL replies,
web requests. One hostile property per test, each asserting the limit held."""

import os

import pytest

from k3.sandbox import Limits, Sandbox, layers
from k3.sandbox.web.corpus import build_corpus, module_url
from k3.sandbox.web.index import SearchIndex
from k3.sandbox.web.tools import WebTools

WRITE_MB = """
import sys
written = 0
try:
    with open(sys.argv[1], "wb") as f:
        for _ in range(int(sys.argv[2])):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
except OSError as error:
    print("refused", error.strerror, written)
else:
    print("written", written)
"""


def _host_bytes(path: str) -> int:
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def test_writes_stop_at_the_disk_quota(sandbox_home):
    with Sandbox(limits=Limits(disk_mb=32, memory_mb=256)) as box:
        box.write_file("/tmp/write.py", WRITE_MB)
        result = box.exec(["python3", "/tmp/write.py", "/work/big", "64"])
        assert result.stdout.startswith("refused No space left"), result.stdout + result.stderr
        assert int(result.stdout.split()[-1]) <= 32
        assert _host_bytes(box.run_dir) < 1 << 20  # nothing of it reached the host's disk


def test_file_creation_stops_at_the_inode_quota(sandbox_home):
    with Sandbox(limits=Limits(inodes=500)) as box:
        result = box.exec("cd /work && for i in $(seq 2000); do touch f$i || exit 3; done")
        assert result.exit_code == 3 and "No space left" in result.stderr, result.stderr
        assert int(box.exec("ls /work | wc -l").stdout) < 500


def test_open_files_stop_at_the_limit(sandbox_home):
    with Sandbox(limits=Limits(open_files=64)) as box:
        result = box.exec(["python3", "-c", "import os\nfds = []\ntry:\n    for _ in range(10000):\n"
                           "        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e:\n"
                           "    print(len(fds), e.strerror)"])
        count, reason = result.stdout.split(" ", 1)
        assert int(count) < 64 and "Too many open files" in reason, result.stdout + result.stderr


def test_a_very_deep_tree_snapshots_exports_and_is_removed_at_close(sandbox_home):
    deep = "import os\nos.chdir('/work')\nfor _ in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nopen('leaf', 'w').write('bottom')"
    box = Sandbox(limits=Limits(disk_mb=None))  # the upper on the host's disk: close must remove it there
    snapshot = None
    try:
        assert box.exec(["python3", "-c", deep]).ok
        snapshot = box.snapshot()
        assert box.store.export(snapshot)["layers"]
        [fork] = box.fork(snapshot)
        with fork:
            assert fork.read_file("/work/" + "/".join(["d"] * 1200) + "/leaf") == b"bottom"
    finally:
        box.close()
        if snapshot is not None:
            box.store.remove(snapshot)  # the layer too is removed without recursion
    assert not os.path.exists(box.run_dir)
    assert not os.path.exists(box.store.path(snapshot))


def test_a_sparse_file_is_stored_sparse(box):
    box.exec(["python3", "-c", "f = open('/work/sparse', 'wb'); f.truncate(256 << 20); f.seek(100 << 20); f.write(b'data')"])
    snapshot = box.snapshot()
    stored = os.lstat(os.path.join(box.store.path(snapshot), "work", "sparse"))
    assert stored.st_size == 256 << 20
    assert stored.st_blocks * 512 < 1 << 20  # the holes stayed holes


def test_a_file_past_the_snapshot_size_bound_is_refused_with_a_clear_error(box, monkeypatch):
    monkeypatch.setattr(layers, "MAX_FILE_BYTES", 1 << 20)
    box.exec(["python3", "-c", "open('/work/huge', 'wb').truncate(8 << 20)"])
    with pytest.raises(OSError, match="a snapshot takes files up to"):
        box.snapshot()


def test_a_repl_reply_past_max_output_is_not_taken(box):
    # The cell writes a well-formed 8 MB reply frame itself, straight to the REPL's answer pipe.
    forged = ("import marshal, os, struct\nbody = marshal.dumps({'ok': True, 'error': None, 'value': 'v' * (8 << 20)})\n"
              "os.write(4, struct.pack('<I', len(body)) + body)")
    result = box.repl().run(forged, max_output=1 << 16)
    assert len(result.value or "") <= 1 << 16
    assert result.died


@pytest.fixture(scope="module")
def web_tools():
    corpus = build_corpus(["json", "heapq"], docs=False)
    return WebTools(corpus, SearchIndex.build(corpus))


@pytest.mark.parametrize("offset", [1e999, -1, "3", True, 1 << 80])
def test_a_web_request_with_an_offset_out_of_range_is_answered_with_an_error(web_tools, offset):
    answer = web_tools.call({"tool": "open", "url": module_url("json"), "offset": offset})
    assert answer["ok"] is False and "offset" in answer["error"]


def test_a_huge_web_query_is_refused_before_any_work(web_tools):
    answer = web_tools.call({"tool": "search", "query": "word " * 200_000})
    assert answer["ok"] is False and "characters" in answer["error"]

