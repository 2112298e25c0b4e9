"""snapshot(memory=True): the REPL's state returns on restore and fork; nothing leaks between forks."""

import os

from k3.sandbox import Sandbox
from k3.sandbox import memory
from k3.sandbox.cgroups import leftover_groups


def test_restore_brings_back_variables_functions_and_classes(box):
    repl = box.repl()
    repl.run("import os\nimport collections\nblob = os.urandom(1 << 20)\nn = 7\n"
             "def scale(v, by=3):\n    return v * by\nclass Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
             "    def norm1(self):\n        return abs(self.x) + abs(self.y)\np = Point(2, -5)\nsquare = lambda v: scale(v, v)\n"
             "counts = collections.Counter('abca')")
    snapshot = box.snapshot(memory=True)
    repl.run("n = 0\ndel p")
    box.restore(snapshot)
    result = box.repl().run("(n, scale(n), p.norm1(), square(4), len(blob), os.sep, counts['a'])")
    assert result.ok, result.stderr
    assert result.value == "(7, 21, 7, 16, 1048576, '/', 2)"


def test_fork_gives_each_branch_the_saved_state(box):
    box.repl().run("counter = 10")
    branches = box.fork(box.snapshot(memory=True), n=2)
    try:
        assert [b.repl().run("counter").value for b in branches] == ["10", "10"]
    finally:
        for branch in branches:
            branch.close()


def test_a_fork_cannot_see_another_forks_memory_or_files(box):
    box.repl().run("secret = None")
    first, second = box.fork(box.snapshot(memory=True), n=2)
    try:
        first.repl().run("secret = 'first'")
        first.write_file("/tmp/secret.txt", "first")
        assert second.repl().run("repr(secret)").value == "'None'"
        assert second.exec("cat /tmp/secret.txt").exit_code != 0
        # Nor across a memory snapshot of its own: a branch of the first carries only the first's state.
        third = first.fork(first.snapshot(memory=True), n=1)[0]
        try:
            assert second.repl().run("repr(secret)").value == "'None'"
            assert third.repl().run("secret").value == "'first'"
        finally:
            third.close()
    finally:
        first.close()
        second.close()


def test_unpicklable_values_are_skipped_and_listed(box):
    repl = box.repl()
    repl.run("import threading\nlock = threading.Lock()\ngen = (i for i in range(3))\nkept = 1")
    info = repl.dump("/tmp/state.pkl")
    assert set(info["skipped"]) == {"lock", "gen"} and "kept" in info["names"]
    snapshot = box.snapshot(memory=True)
    box.restore(snapshot)
    assert box.repl().run("kept, 'gen' in dir()").value == "(1, False)"


def test_memory_files_do_not_stay_in_the_sandbox(box):
    box.repl().run("x = 1")
    snapshot = box.snapshot(memory=True)
    assert box.exec("test -e /.k3").exit_code != 0  # removed from the live sandbox after the snapshot
    assert memory.manifest_of(box) is None
    box.restore(snapshot)
    assert box.exec("test -e /.k3").exit_code != 0  # and after the restore loaded them
    files_only = box.snapshot()
    box.restore(files_only)
    assert not box.repl().alive  # a files-only snapshot never brings a REPL back


def test_nothing_is_left_after_close(sandbox_home):
    box = Sandbox()
    box.repl().run("x = bytearray(1 << 20)")
    box.enable_web(_tiny_web())
    snapshot = box.snapshot(memory=True)
    box.restore(snapshot)
    pids, run_dir, groups = box.pids(), box.run_dir, box.cgroup.procs_files()
    assert len(pids) >= 4  # unshare, PID 1, the REPL, the web relay
    box.close()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _is_other_process(pid)
    assert not any(os.path.exists(os.path.dirname(path)) for path in groups)
    assert not any(box.id in path for path in leftover_groups())
    assert not os.path.exists(run_dir)
    with open("/proc/self/mountinfo") as f:
        assert run_dir not in f.read()
    # The saved state lives in the snapshot's layer only (collected with it by gc), not beside it.
    scratch_files = [name for _, _, names in os.walk(os.path.join(box.scratch, "run")) for name in names]
    assert not any(name.endswith(".pkl") for name in scratch_files)


def _is_other_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"supervisor.py" not in f.read()
    except FileNotFoundError:
        return True


def _tiny_web():
    from k3.sandbox.web.corpus import build_corpus
    from k3.sandbox.web.index import SearchIndex
    from k3.sandbox.web.tools import WebTools

    corpus = build_corpus(["json", "json.decoder"], docs=False)
    return WebTools(corpus, SearchIndex.build(corpus))


def test_the_doctor_names_the_memory_snapshot_path():
    from k3.sandbox.doctor import run_checks

    checks = {check.name: check for check in run_checks()}
    assert "criu (memory snapshots)" in checks
    assert checks["memory snapshots"].ok and memory.BACKEND in checks["memory snapshots"].detail


SERVER = """
import os, socket
path = '/tmp/echo.sock'
if os.path.exists(path):
    os.unlink(path)
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen()
while True:
    connection, _ = server.accept()
    connection.sendall(b'pong ' + connection.recv(100))
    connection.close()
"""
CLIENT = ("import socket, time\nfor _ in range(100):\n    try:\n        s = socket.socket(socket.AF_UNIX)\n"
          "        s.connect('/tmp/echo.sock')\n        break\n    except OSError:\n        time.sleep(0.05)\n"
          "s.sendall(b'ping')\nprint(s.recv(100).decode())")


def test_a_service_listens_again_after_a_memory_restore_and_not_after_a_files_only_one(box):
    box.write_file("/work/server.py", SERVER)
    box.write_file("/work/client.py", CLIENT)
    box.start_service("echo", "exec python3 /work/server.py")
    assert box.exec("python3 /work/client.py", timeout=20).stdout == "pong ping\n"
    with_memory, files_only = box.snapshot(memory=True), box.snapshot()
    box.restore(with_memory)
    assert box.exec("python3 /work/client.py", timeout=20).stdout == "pong ping\n"
    box.restore(files_only)
    count = ("import os\nprint(sum(b'server.py' in open(f'/proc/{p}/cmdline', 'rb').read()\n"
             "          for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()))")
    assert box.exec(["python3", "-c", count]).stdout == "0\n"  # not restarted


def test_a_forged_manifest_cannot_mount_another_sandboxs_memory(sandbox_home):
    import json

    import pytest

    with Sandbox() as victim, Sandbox() as attacker:
        victim.repl().run("secret = 'victim only'")
        victim_snapshot = victim.snapshot(memory=True)
        image_id = memory.manifest_in_chain(victim.scratch, victim.store.chain(victim_snapshot))["image"]
        # Even knowing the image id, a manifest written from inside names nothing it may mount.
        forged = {"backend": memory.BACKEND, "image": image_id, "repls": [{"name": "python", "state": "/.k3/memory/python.pkl"}]}
        attacker.write_file(memory.MANIFEST, json.dumps(forged))
        forged_snapshot = attacker.snapshot()
        with pytest.raises(PermissionError, match="does not match memory image"):
            attacker.restore(forged_snapshot)


def test_memory_images_go_with_their_snapshots_at_gc(sandbox_home):
    from k3.sandbox.layers import LayerStore
    from k3.sandbox.pool import SnapshotStore

    with Sandbox() as box:
        box.repl().run("x = 1")
        snapshot = box.snapshot(memory=True)
        image_id = memory.manifest_of(box) or memory.manifest_in_chain(box.scratch, box.store.chain(snapshot))
        image = memory.image_dir(box.scratch, image_id["image"])
        store = SnapshotStore(LayerStore(box.scratch))
        store.pin(snapshot)
        store.gc()
        assert os.path.isdir(image)  # pinned: kept
        store.unpin(snapshot)
    store.gc()
    assert not os.path.exists(image)  # no layer names it any more


def test_the_async_sandbox_takes_and_restores_memory_snapshots(sandbox_home):
    import asyncio

    from k3.sandbox import AsyncSandbox

    async def scenario():
        async with await AsyncSandbox.create() as box:
            await box.run_python("x = 3")
            snapshot = await box.snapshot(memory=True)
            await box.run_python("x = 0")
            await box.restore(snapshot)
            return (await box.run_python("x * 2")).value

    assert asyncio.run(scenario()) == "6"
